"""Where an engine's start-up goes: ``LLMEngine(...)`` under cProfile, the start-up report's
lines, then the functions that took the most cumulative and own time.

The start-up report times the weights, the KV cache (with the profiling forward), the CUDA
graphs and the warm-up; ``engine ready in X s`` also counts what lies between them (the
device's first use, the config, the tokenizer, the sampler, the tables). This finds which.
Run it twice in one machine to see a warm Triton cache's start-up (the first run compiles).

Usage (GPU machine): ``python scripts/probe_startup.py [--model Qwen3-0.6B] [--top 30]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="Qwen3-0.6B", help="bundled config name or checkpoint")
    ap.add_argument("--top", type=int, default=30, help="rows of each table")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--cuda-first", action="store_true",
                    help="create the CUDA context before the profile (timed apart), so the "
                         "profile does not charge it to whatever touches the device first")
    args = ap.parse_args()

    t_import = time.perf_counter()
    import torch

    from mrv2.bench.measure import resolve_model
    from mrv2.config import EngineConfig
    from mrv2.engine.engine import LLMEngine
    from mrv2.logs import configure_logging

    configure_logging()
    print(f"imports: {time.perf_counter() - t_import:.2f} s", flush=True)
    cpu = not torch.cuda.is_available()
    if args.cuda_first and not cpu:
        t_cuda = time.perf_counter()
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        print(f"CUDA context: {time.perf_counter() - t_cuda:.2f} s", flush=True)
    config = EngineConfig.from_kwargs(
        model=resolve_model(args.model), load_format="dummy",
        dtype="float32" if cpu else "bfloat16", device="cpu" if cpu else "auto",
        max_model_len=1024 if cpu else 4096, max_num_seqs=args.max_num_seqs)
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    engine = LLMEngine(config)
    profiler.disable()
    total = time.perf_counter() - t0
    for sort in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(sort).print_stats(args.top)
        body = text.getvalue()
        print(f"\n=== by {sort} ===")
        print(body[body.find("   ncalls"):].rstrip())
    parts = dict(engine.runner.startup.seconds)
    if engine.warmup_seconds is not None:
        parts["warm-up"] = engine.warmup_seconds
    timed = sum(parts.values())
    print(f"\nLLMEngine(...) {total:.2f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
          + f", untimed {total - timed:.2f} s")


if __name__ == "__main__":
    main()
