"""Profile steady decode steps on the GPU: CPU time per step by function, GPU time by kernel.

Usage (GPU machine): python scripts/profile_decode.py [--batch 1] [--steps 64]
"""

import argparse
import cProfile
import pstats
import random
import time

import torch

from mrv2.bench.measure import resolve_model
from mrv2.config import EngineConfig
from mrv2.engine.engine import LLMEngine
from mrv2.sample.params import SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--steps", type=int, default=64)
parser.add_argument("--temperature", type=float, default=0.0)
args = parser.parse_args()

engine = LLMEngine(EngineConfig.from_kwargs(
    model=resolve_model("Qwen3-0.6B"), load_format="dummy", dtype="bfloat16", max_model_len=4096,
    max_num_seqs=max(args.batch, 8)))
rng = random.Random(0)
params = SamplingParams(temperature=args.temperature, max_tokens=4 * args.steps, ignore_eos=True)
for _ in range(args.batch):
    engine.add_request([rng.randint(0, 10000) for _ in range(128)], params)
for _ in range(args.steps):  # prefill, compile, warm up
    engine.step()
torch.cuda.synchronize()
start = time.perf_counter()
profile = cProfile.Profile()
profile.enable()
for _ in range(args.steps):
    engine.step()
profile.disable()
torch.cuda.synchronize()
print(f"wall per step: {(time.perf_counter() - start) / args.steps * 1e3:.3f} ms")
pstats.Stats(profile).sort_stats("tottime").print_stats(18)
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                        torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
