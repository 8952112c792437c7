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

from mrv2.bench.measure import resolve_model
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
    args = ap.parse_args()
    cpu = not torch.cuda.is_available()
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=resolve_model(args.model), load_format="dummy",
        dtype="float32" if cpu else "bfloat16", device="cpu" if cpu else "auto",
        max_model_len=1024 if cpu else 4096, max_num_seqs=max(args.batches)))
    runner: Any = engine.runner
    kinds: list[str] = []
    forward_and_sample = runner._forward_and_sample

    def spy(step: Any) -> Any:
        kind = ("decode graph" if step.replay_query_len else
                "mixed graph" if step.replay_tokens else "eager")
        kinds.append(f"{kind} ({step.batch.num_tokens} tokens)")
        return forward_and_sample(step)

    runner._forward_and_sample = spy
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
            for i in range(1000):
                if not engine.has_unfinished():
                    break
                kinds.clear()
                t0 = time.perf_counter()
                outs = engine.step()
                t1 = time.perf_counter()
                if first is None and outs:
                    first = t1
                if i < args.steps:
                    print(f"batch {batch} round {rnd} step {i}: {', '.join(kinds) or '-'}; "
                          f"step() {1e3 * (t1 - t0):.2f} ms, at {1e3 * (t1 - start):.2f} ms, "
                          f"{len(outs)} outputs", flush=True)
            assert first is not None
            print(f"batch {batch} round {rnd}: TTFT {1e3 * (first - start):.2f} ms", flush=True)


if __name__ == "__main__":
    main()
