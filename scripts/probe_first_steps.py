"""Where the time to first token goes: each of a batch's first engine steps, its kind (eager,
mixed graph, decode graph) and its host and wall time.

``mrv2 bench latency`` reports TTFT as one number; this splits it. With async scheduling the
first outputs come back from the *second* ``engine.step()`` (the first decode step is launched
before the prefill's tokens are read), so TTFT is the prefill step's host time plus the
second step's host time up to its wait, or the prefill's device time, whichever is longer.
Run it twice to compare an environment switch (e.g. ``MRV2_PDL_GEMM=1``, which raised TTFT by
1-2.8 ms at 16-64 prompts on the H200 in the nineteenth session without touching prefill).

Usage (GPU machine): ``python scripts/probe_first_steps.py [--model Qwen3-0.6B] [--batches 32
64] [--prompt-len 128] [--rounds 2]``; on a CPU it runs the same steps eagerly (slowly).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Any

import torch

from mrv2.bench.measure import resolve_model, time_host_parts
from mrv2.config import EngineConfig
from mrv2.contract.params import SamplingParams
from mrv2.engine.engine import LLMEngine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="Qwen3-0.6B", help="bundled config name or checkpoint")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="rounds per batch (the first warms)")
    ap.add_argument("--steps", type=int, default=4, help="steps printed per round")
    ap.add_argument("--layers", type=int, default=0,
                    help="decoder layers (0: the model's; fewer for a quick host profile)")
    ap.add_argument("--cprofile", action="store_true",
                    help="also cProfile the last round's first step (top functions)")
    args = ap.parse_args()
    cpu = not torch.cuda.is_available()
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=resolve_model(args.model), load_format="dummy",
        dtype="float32" if cpu else "bfloat16", device="cpu" if cpu else "auto",
        max_model_len=1024 if cpu else 4096, max_num_seqs=max(args.batches),
        hf_overrides={"num_hidden_layers": args.layers} if args.layers else None))
    runner: Any = engine.runner
    kinds: list[str] = []
    forward_and_sample = runner._forward_and_sample

    def spy(step: Any) -> Any:
        kind = ("decode graph" if step.replay_query_len else
                "mixed graph" if step.replay_tokens else "eager")
        kinds.append(f"{kind} ({step.batch.num_tokens} tokens)")
        return forward_and_sample(step)

    runner._forward_and_sample = spy
    # Host time of each part of a step (nested parts too), the last call's.
    phases: dict[str, float] = {}

    parts = {"schedule": (engine.scheduler, "schedule"), "execute": (runner, "execute"),
             "process": (engine, "_process"), "build": (runner.builder, "build"),
             "upload": (runner._uploader, "upload"),
             "forward+sample": (runner, "_forward_and_sample"),
             "output_copy": (runner, "_start_output_copy")}
    if runner.graphs is not None:
        parts["mixed_replay"] = (runner.graphs, "replay_mixed")
    time_host_parts(parts, phases)
    gpu = torch.cuda.is_available()
    rng = random.Random(0)
    switches = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                        if k.startswith("MRV2_")) or "defaults"
    print(f"{args.model}, {switches}")
    for batch in args.batches:
        for rnd in range(args.rounds):
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            for _ in range(batch):
                engine.add_request([rng.randint(0, 10000) for _ in range(args.prompt_len)],
                                   params, stream=True)
            start = time.perf_counter()
            first = None
            begin_ev = end_ev = None
            if gpu:
                begin_ev = torch.cuda.Event(enable_timing=True)
                end_ev = torch.cuda.Event(enable_timing=True)
                begin_ev.record()
            for i in range(1000):
                if not engine.has_unfinished():
                    break
                kinds.clear()
                phases.clear()
                profiler = None
                if args.cprofile and i == 0 and rnd == args.rounds - 1:
                    import cProfile

                    profiler = cProfile.Profile()
                    profiler.enable()
                t0 = time.perf_counter()
                outs = engine.step()
                t1 = time.perf_counter()
                if profiler is not None:
                    profiler.disable()
                if i == 0 and end_ev is not None:
                    end_ev.record()  # after everything the first step enqueued
                if first is None and outs:
                    first = t1
                if i < args.steps:
                    print(f"batch {batch} round {rnd} step {i}: {', '.join(kinds) or '-'}; "
                          f"step() {1e3 * (t1 - t0):.2f} ms, at {1e3 * (t1 - start):.2f} ms, "
                          f"{len(outs)} outputs", flush=True)
                    print("    host ms: " + ", ".join(f"{k} {1e3 * v:.2f}"
                                                     for k, v in phases.items()), flush=True)
                if profiler is not None:
                    import pstats

                    stats = pstats.Stats(profiler)
                    stats.sort_stats("tottime").print_stats(25)
                    stats.sort_stats("cumulative").print_stats(40)
            assert first is not None
            gpu_done = ""
            if begin_ev is not None and end_ev is not None:
                gpu_done = (f"; the first step's device work done "
                            f"{begin_ev.elapsed_time(end_ev):.2f} ms after its start")
            print(f"batch {batch} round {rnd}: TTFT {1e3 * (first - start):.2f} ms{gpu_done}",
                  flush=True)


if __name__ == "__main__":
    main()
