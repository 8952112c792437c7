"""Decode attention at long contexts: launch options against the KV bytes they read.

``paged_attention``'s decode plan was tuned at 256-4,096 keys (BENCHMARKS.md 2026-12-01/03);
this times it where a request's keys dominate the step (a 48,000-token context read at batch 1:
5.5 GB of Qwen3-0.6B's KV a step, against 1.2 GB of weights). Qwen3-0.6B's heads (16 query,
8 kv, 128 wide), bf16, block size 16; ``LAYERS`` layers' caches, one attention call per layer
captured in one CUDA graph with the graph's loose ``max_seq_len`` bound, as the decode graphs
run it. Prints, per case and launch option, µs per layer and the rate of the KV bytes it reads
(``2 x ctx x kv_heads x 128 x 2`` bytes per request), the planner's own choice first.

Usage (GPU machine): python scripts/sweep_long_decode.py [--cases 1x48000 8x8000]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from sweep_decode_splits import HEAD_DIM, KV_HEADS, decode_case  # (scripts/: its own folder)

from mrv2_kernels.bench_skinny import time_graph
from mrv2_kernels.paged_attention import attention_plan, paged_attention

#: (label, paged_attention overrides): the plan's defaults, then one change at a time.
OPTIONS: list[tuple[str, dict[str, Any]]] = [
    ("plan", {}),
    ("splits 16", {"num_splits": 16}),
    ("splits 64", {"num_splits": 64}),
    ("warps 2", {"num_warps": 2}),
    ("warps 8", {"num_warps": 8}),
    ("block_n 128", {"block_n": 128}),
    ("block_n 32", {"block_n": 32}),
    ("stages 3", {"num_stages": 3}),
    ("stages 4", {"num_stages": 4}),
    ("splits 64 warps 2", {"num_splits": 64, "num_warps": 2}),
    ("splits 64 block_n 128", {"num_splits": 64, "block_n": 128}),
    ("block_n 128 stages 3", {"block_n": 128, "num_stages": 3}),
]


def sweep(batch: int, ctx: int, layers: int, max_seq_len: int) -> list[str]:
    """Result lines of one case."""
    caches, (table, query, qsl, seq_lens) = decode_case(batch, ctx, layers)
    plan = attention_plan(query, caches[0], max_query_len=1, max_seq_len=max_seq_len,
                          num_reqs=batch, uniform_decode=True)
    kv_bytes = 2 * batch * ctx * KV_HEADS * HEAD_DIM * 2
    lines = [f"batch {batch} ctx {ctx}: plan splits {plan.num_splits} warps {plan.num_warps} "
             f"block_n {plan.block_n} stages {plan.num_stages}; {kv_bytes / 1e6:.1f} MB of KV "
             "a layer"]
    for label, overrides in OPTIONS:
        def call(i: int, kw: dict[str, Any] = overrides) -> torch.Tensor:
            return paged_attention(query, caches[i], qsl, seq_lens, table, HEAD_DIM**-0.5,
                                   max_query_len=1, max_seq_len=max_seq_len, num_reqs=batch,
                                   uniform_decode=True, **kw)
        try:
            us = time_graph(call, layers)
        except Exception as error:  # noqa: BLE001 (an option that does not compile: say so)
            lines.append(f"  {label:<24} failed: {type(error).__name__}: {str(error)[:80]}")
            continue
        lines.append(f"  {label:<24} {us:8.2f} us/layer  {kv_bytes / us / 1e3:7.0f} GB/s")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=["1x48000", "1x8000", "8x8000", "32x4000"],
                   help="BATCHxCONTEXT")
    p.add_argument("--layers", type=int, default=8, help="caches (layers) per graph")
    p.add_argument("--max-seq-len", type=int, default=65536,
                   help="the graph's bound (a decode graph's: max_model_len)")
    args = p.parse_args()
    for case in args.cases:
        batch, ctx = (int(x) for x in case.split("x"))
        for line in sweep(batch, ctx, args.layers, args.max_seq_len):
            print(line, flush=True)


if __name__ == "__main__":
    main()
