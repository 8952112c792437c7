"""A quick tensor-parallel check on a GPU machine: a tiny random Qwen3 at TP=N, eager and then
with CUDA graphs, each timed in stages. Run it with ``PYTHONFAULTHANDLER=1`` under
``timeout -s ABRT`` so a hang prints every rank's Python stack (the workers share the process
group and the environment).

Usage: python scripts/tp_smoke.py [--tp 2] [--modes eager graphs] [--dtype bfloat16]
"""

import argparse
import tempfile
import time

from mrv2 import LLM, SamplingParams
from mrv2.testing import make_tiny_checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--tp", type=int, default=2)
parser.add_argument("--modes", nargs="+", default=["eager", "graphs"])
parser.add_argument("--dtype", default="bfloat16")
args = parser.parse_args()

start = time.perf_counter()


def say(what: str) -> None:
    print(f"[{time.perf_counter() - start:7.2f} s] {what}", flush=True)


ckpt = make_tiny_checkpoint(tempfile.mkdtemp(), "Qwen3ForCausalLM", hidden_size=256,
                            intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64)
prompts = [{"prompt_token_ids": [5, 17, 42, 9]}, {"prompt_token_ids": [8, 8, 250]}]
greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
for mode in args.modes:
    say(f"{mode}: building the engine (TP={args.tp})")
    with LLM(str(ckpt), device="cuda", dtype=args.dtype, tensor_parallel_size=args.tp,
             gpu_memory_utilization=0.3, max_num_seqs=8,
             enforce_eager=mode == "eager") as llm:
        say(f"{mode}: engine up; generating")
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        say(f"{mode}: tokens {[o.outputs[0].token_ids for o in outs]}")
    say(f"{mode}: engine shut down")
