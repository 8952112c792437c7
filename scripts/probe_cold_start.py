"""What the first requests after start-up wait for on an empty Triton cache: each request kind
alone, its wall time (submit to last token) and the kernels Triton compiled while it ran.

The runner's start-up captures CUDA graphs from dummy batches; whatever a real step runs
outside them (the batch builder's kernels, eager sampling, logprobs) compiles at the first
request that needs it unless the engine's start-up warm-up (``warmup``, on by default on CUDA)
ran it. Run once with ``--no-warmup`` and once without to see what the warm-up saves; each run
uses a fresh Triton cache (``TRITON_CACHE_DIR`` is set before Triton is imported) unless
``--cache-dir`` names one.

Usage (GPU machine): ``python scripts/probe_cold_start.py [--model Qwen3-0.6B] [--no-warmup]``;
on a CPU it runs (slowly) but nothing compiles.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _kernels(cache: Path) -> set[str]:
    """Compiled kernels in a Triton cache: ``<hash>/<kernel name>.json``, one per
    specialization (the group files ``__grp__*.json`` excluded)."""
    return {f"{p.parent.name[:8]}/{p.stem}" for p in cache.glob("*/*.json")
            if not p.name.startswith("__grp__")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="Qwen3-0.6B", help="bundled config name or checkpoint")
    ap.add_argument("--warmup", default=True, action=argparse.BooleanOptionalAction,
                    help="the engine's start-up warm-up (the engine's default: on)")
    ap.add_argument("--cache-dir", default=None, help="Triton cache (default: a fresh one)")
    args = ap.parse_args()
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="triton-cold-"))
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    assert "triton" not in sys.modules, "TRITON_CACHE_DIR must be set before Triton loads"

    import torch

    from mrv2.bench.measure import resolve_model
    from mrv2.config import EngineConfig
    from mrv2.contract.params import SamplingParams
    from mrv2.engine.engine import LLMEngine
    from mrv2.logs import configure_logging

    configure_logging()  # the start-up report (weights, KV cache, graphs, warm-up) on stderr
    cpu = not torch.cuda.is_available()
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=resolve_model(args.model), load_format="dummy",
        dtype="float32" if cpu else "bfloat16", device="cpu" if cpu else "auto",
        max_model_len=1024 if cpu else 4096, max_num_seqs=64, warmup=args.warmup))
    start_s = time.perf_counter() - t0
    after_start = _kernels(cache)
    warm_s = engine.warmup_seconds
    print(f"{args.model}, warmup {'on' if args.warmup else 'off'}: engine built in "
          f"{start_s:.1f} s (the warm-up's part: "
          f"{'-' if warm_s is None else f'{warm_s:.2f} s'}), {len(after_start)} kernels "
          f"compiled by then", flush=True)

    def params(**kw: Any) -> SamplingParams:
        return SamplingParams(**{"max_tokens": 8, "ignore_eos": True, **kw})

    vocab = engine.runner.vocab_size
    kinds: list[tuple[str, int, int, SamplingParams]] = [
        ("greedy", 1, 100, params(temperature=0.0)),
        ("greedy, again", 1, 100, params(temperature=0.0)),
        ("temperature 1", 1, 100, params(temperature=1.0)),
        ("top-k 20, top-p 0.9", 1, 100, params(temperature=0.8, top_k=20, top_p=0.9)),
        ("8 requests, top-p 0.95", 8, 100, params(temperature=0.7, top_p=0.95)),
        ("logprobs 5", 1, 100, params(temperature=0.0, logprobs=5)),
        ("prompt logprobs 1", 1, 100, params(temperature=0.0, prompt_logprobs=1)),
        ("min-p 0.1", 1, 100, params(temperature=1.0, min_p=0.1)),
        ("min-p + top-k/top-p", 1, 100, params(temperature=0.8, min_p=0.05, top_k=40,
                                               top_p=0.95)),
        ("penalties", 1, 100, params(temperature=1.0, repetition_penalty=1.2,
                                     presence_penalty=0.5)),
        ("greedy + penalty", 1, 100, params(temperature=0.0, repetition_penalty=1.1)),
        ("top-k/top-p + penalty", 1, 100, params(temperature=0.7, top_k=20, top_p=0.8,
                                                 presence_penalty=1.5)),
        ("logit_bias", 1, 100, params(temperature=1.0, logit_bias={5: 2.0})),
        ("long prompt", 1, min(1500, engine.max_model_len - 16), params(temperature=0.0)),
        ("greedy, last", 1, 100, params(temperature=0.0)),
    ]
    rows = []
    seen = set(after_start)
    for i, (name, num, prompt_len, sp) in enumerate(kinds):
        for r in range(num):
            engine.add_request([(31 * i + 17 * r + 7 * t) % vocab for t in range(prompt_len)],
                               sp)
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        ms = 1e3 * (time.perf_counter() - t)
        now = _kernels(cache)
        new = sorted(k.split("/", 1)[1] for k in now - seen)
        seen = now
        rows.append((name, ms, new))
        print(f"{name}: {ms:.1f} ms, compiled {len(new)}: {', '.join(new) or '-'}", flush=True)
    print(f"\n{'request kind':<26} {'wall ms':>9} {'compiled':>9}")
    for name, ms, new in rows:
        print(f"{name:<26} {ms:>9.1f} {len(new):>9}")
    print(f"engine start-up {start_s:.1f} s (warmup {'on' if args.warmup else 'off'}); "
          f"total compiled after start-up: {sum(len(n) for _, _, n in rows)}")


if __name__ == "__main__":
    main()
