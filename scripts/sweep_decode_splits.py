"""Decode attention split counts at small batches, as the decode CUDA graph runs them.

28 layers' worth of KV caches (Qwen3-0.6B shapes, bf16, block size 16), one attention call per
layer captured in one CUDA graph with the graph's loose ``max_seq_len`` bound (4096); prints
µs per layer for each ``num_splits`` (the combine kernel included) and the planner's choice.

Usage (GPU machine): python scripts/sweep_decode_splits.py
"""

import torch

from mrv2_kernels.bench_skinny import time_graph
from mrv2_kernels.paged_attention import attention_plan, paged_attention

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 28, 16, 8, 128, 16


def decode_case(batch: int, ctx: int, layers: int
                ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(caches, [table, query, query_start_loc, seq_lens])`` of a uniform decode step:
    ``batch`` requests of ``ctx`` keys each over ``layers`` random bf16 caches, their blocks
    shuffled."""
    dev = torch.device("cuda")
    blocks = -(-ctx // BLOCK)
    caches = [torch.randn(2, batch * blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, device=dev,
                          dtype=torch.bfloat16) for _ in range(layers)]
    table = torch.randperm(batch * blocks, device=dev).to(torch.int32).view(batch, blocks)
    query = torch.randn(batch, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, device=dev, dtype=torch.int32)
    seq_lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    return caches, [table, query, qsl, seq_lens]


def sweep(batch: int, ctx: int) -> str:
    """One result line: µs per layer for each split count."""
    caches, (table, query, qsl, seq_lens) = decode_case(batch, ctx, LAYERS)
    planned = attention_plan(query, caches[0], max_query_len=1, max_seq_len=4096,
                             num_reqs=batch, uniform_decode=True).num_splits
    row = []
    for splits in [1, 2, 4, 8, 16, 32]:
        def call(i: int, splits: int = splits) -> torch.Tensor:
            return paged_attention(query, caches[i], qsl, seq_lens, table, HEAD_DIM**-0.5,
                                   max_query_len=1, max_seq_len=4096, num_reqs=batch,
                                   uniform_decode=True, num_splits=splits)
        row.append(f"{splits}:{time_graph(call, LAYERS):6.2f}")
    return (f"batch {batch:3d} ctx {ctx:5d} planned {planned:2d} | us/layer by splits  "
            + "  ".join(row))


if __name__ == "__main__":
    for b, c in [(1, 640), (1, 2048), (8, 640), (8, 2048), (64, 640)]:
        print(sweep(b, c), flush=True)
