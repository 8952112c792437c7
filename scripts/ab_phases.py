"""Host time per engine phase of steady decode (schedule / execute / process), for A/B runs of
two builds on one GPU machine: uses only names both old and new builds export.

Usage (GPU machine): PYTHONPATH=/tmp/site-old python scripts/ab_phases.py --batch 8
"""

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from mrv2 import EngineConfig, SamplingParams
from mrv2.bench.measure import resolve_model
from mrv2.engine.engine import LLMEngine

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--label", default="")
args = parser.parse_args()

for batch in args.batch:
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=resolve_model("Qwen3-0.6B"), load_format="dummy", dtype="bfloat16",
        max_model_len=4096, max_num_seqs=max(batch, 8), gpu_memory_utilization=0.5))
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=4 * args.steps, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randint(0, 10000) for _ in range(128)], params, stream=True)
    for _ in range(args.steps):  # prefill, compile, warm up
        engine.step()
    torch.cuda.synchronize()
    phases: dict[str, list[float]] = {"schedule": [], "execute": [], "process": []}

    def timed(name: str, fn: Callable[..., Any],
              phases: dict[str, list[float]] = phases) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            begin = time.perf_counter()
            out = fn(*a, **k)
            phases[name].append(time.perf_counter() - begin)
            return out
        return wrapper

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)  # type: ignore
    engine.runner.execute = timed("execute", engine.runner.execute)  # type: ignore
    engine._process = timed("process", engine._process)  # type: ignore
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.steps
    host = "  ".join(f"{n} {statistics.median(v) * 1e3:.3f}" for n, v in phases.items() if v)
    print(f"{args.label} b{batch}: step {wall * 1e3:.3f} ms  host medians (ms): {host}")
    del engine, timed  # the wrappers hold the engine in a cycle: collect it before the next
    gc.collect()
    torch.cuda.empty_cache()
