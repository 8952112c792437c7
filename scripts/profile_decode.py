"""Profile steady decode steps on the GPU: host time per engine phase, GPU time by kernel, and
the GPU's idle gaps between kernels (which say whether the host or the device is the limit).

Usage (GPU machine): python scripts/profile_decode.py [--model Qwen3-0.6B] [--batch 1] [--steps 64]
[--trace DIR]
"""

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

import torch

from mrv2.bench.measure import kernel_increments, resolve_model, time_host_parts
from mrv2.config import EngineConfig
from mrv2.contract.params import SamplingParams
from mrv2.engine.engine import LLMEngine

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="Qwen3-0.6B", help="bundled config name or checkpoint")
parser.add_argument("--batch", type=int, default=1)
parser.add_argument("--steps", type=int, default=64)
parser.add_argument("--temperature", type=float, default=0.0)
parser.add_argument("--prompt-lens", type=int, nargs=2, default=(128, 128), metavar=("LO", "HI"),
                    help="prompt lengths drawn uniformly from LO..HI (default 128 128)")
parser.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks (one GPU each); the profile is rank 0's, and the NCCL kernels' "
                         "share of its step is printed (it includes waiting for the other ranks)")
parser.add_argument("--speculative-config", default=None,
                    help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                         '"rejection_sample_method": "synthetic", '
                         '"synthetic_acceptance_rate": 0.9}\'')
parser.add_argument("--host-breakdown", action="store_true",
                    help="also time the parts of Runner.execute on the host (median per step)")
parser.add_argument("--quantization", default=None,
                    help="random weights of this method (gptq, awq, fp8: mrv2 bench's quant "
                         "variants)")
parser.add_argument("--hf-overrides", type=json.loads, default=None, metavar="JSON",
                    help='config fields to override, e.g. \'{"num_hidden_layers": 8}\'')
parser.add_argument("--trace", default=os.environ.get("OUT"))
parser.add_argument("--cprofile", action="store_true",
                    help="also print the host's Python profile of the timed steps (top functions "
                         "by own time and by cumulative time)")
args = parser.parse_args()

engine = LLMEngine(EngineConfig.from_kwargs(
    model=resolve_model(args.model), load_format="dummy", dtype="bfloat16", max_model_len=4096,
    max_num_seqs=max(args.batch, 8), tensor_parallel_size=args.tensor_parallel_size,
    hf_overrides=args.hf_overrides or {},
    **({"quantization": args.quantization} if args.quantization else {}),
    **({"speculative_config": json.loads(args.speculative_config)}
       if args.speculative_config else {})))
rng = random.Random(0)
# enough tokens for every timed step, up to 1 + k a step with speculation
k = engine.runner.num_speculative_tokens
params = SamplingParams(temperature=args.temperature, max_tokens=6 * (1 + k) * args.steps,
                        ignore_eos=True)
for _ in range(args.batch):
    engine.add_request([rng.randint(0, 10000) for _ in range(rng.randint(*args.prompt_lens))],
                       params, stream=True)
for _ in range(2 * args.steps):  # prefill, compile, warm up
    engine.step()
torch.cuda.synchronize()

parts: dict[str, tuple[Any, str]] = {"schedule": (engine.scheduler, "schedule"),
                                     "execute": (engine.runner, "execute"),
                                     "process": (engine, "_process")}
if args.host_breakdown:  # the parts of execute, each timed on its own (nested ones too)
    import mrv2.runner.batch_builder as bb

    runner = engine.runner
    parts.update({
        "build": (runner.builder, "build"), "upload": (runner._uploader, "upload"),
        "forward_and_sample": (runner, "_forward_and_sample"),
        "replay_tail": (runner, "_replay_tail"), "draft": (runner, "_draft"),
        "output_copy": (runner, "_start_output_copy"), "plan": (runner.sampler, "plan"),
        "prepare_inputs": (bb, "prepare_inputs"),
        "record_sampled": (runner.sampler, "record_sampled")})
    if runner.graphs is not None:
        parts["graph_replay"] = (runner.graphs, "replay")
step_sums: dict[str, float] = {}  # this step's host seconds by part
restore = time_host_parts(parts, step_sums)
phases: dict[str, list[float]] = {name: [] for name in parts}
start = time.perf_counter()
for _ in range(args.steps):
    step_sums.clear()
    engine.step()
    for name, seconds in step_sums.items():
        phases[name].append(seconds)
torch.cuda.synchronize()
wall = (time.perf_counter() - start) / args.steps
restore()
print(f"batch {args.batch}: wall per step {wall * 1e3:.3f} ms")
for name, values in phases.items():
    if values:
        print(f"  host {name:9s} median {statistics.median(values) * 1e3:.3f} ms")
if args.cprofile:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(35)
    stats.sort_stats("cumulative").print_stats(45)

with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                        torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
if args.trace:
    prof.export_chrome_trace(os.path.join(args.trace, f"decode_b{args.batch}.json"))
kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
if kernels:
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    busy = sum(e.time_range.end - e.time_range.start for e in kernels)
    gaps = [b.time_range.start - a.time_range.end
            for a, b in zip(kernels, kernels[1:], strict=False)]
    big = sorted(((g, a.name) for g, a in zip(gaps, kernels[:-1], strict=True)
                  if g > 20), reverse=True)[:8]
    print(f"GPU over 8 steps: span {span / 8e3:.3f} ms/step, kernels busy {busy / 8e3:.3f} "
          f"ms/step, {len(kernels) / 8:.0f} kernels/step, gaps > 20 us: "
          f"{sum(g for g, _ in big) / 8e3:.3f} ms/step")
    for gap, after in big:
        print(f"  gap {gap:8.1f} us after {after[:70]}")
    # Where the steps' time goes with PDL's overlap: each kernel's increment of the span
    incs, idle, span = kernel_increments([(e.name, e.time_range.start, e.time_range.end)
                                          for e in kernels])
    print(f"increments per step (us; idle {idle / 8:.1f}, span {span / 8:.1f}):")
    for name, (calls, total) in sorted(incs.items(), key=lambda kv: -kv[1][1])[:16]:
        print(f"  {total / 8:8.1f} us in {calls / 8:5.1f} calls ({total / calls:5.2f} each)  "
              f"{name[:60]}")
    nccl = [e for e in kernels if "nccl" in e.name.lower()]
    if nccl:
        comm = sum(e.time_range.end - e.time_range.start for e in nccl)
        print(f"NCCL kernels: {len(nccl) / 8:.0f}/step, {comm / 8e3:.3f} ms/step, "
              f"{comm / span:.1%} of the span (rank 0; includes waiting for the other ranks)")
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
engine.shutdown()
