"""The DSA indexer's selection on a GPU: the scores
(:func:`~mrv2_kernels.sparse_mla.indexer_logits`) and the top-k
(:func:`~mrv2_kernels.indexer_topk.indexer_topk_slots`) of a decode step whose logits are
``max_model_len`` wide, as under CUDA graphs, at DeepSeek-V3.2's indexer shapes
(64 heads of 128, ``index_topk`` 2,048, 163,840 positions), against the path they replace:
every column past each token filled with ``-inf`` and ``torch.topk`` over the full width, then
the positions mapped to slots. "same rows" counts the rows whose selections are equal (a tie
at the threshold may differ: either choice is right).

``python -m mrv2_kernels.bench_dsa_indexer [--width 163840] [--batches 1 16 64]
[--contexts 2048 32768 131072]``: one row per (batch, context), microseconds a step (the
median of 20 launches after warm-up) and the speed-up."""

from __future__ import annotations

import argparse
import statistics

import torch

from ._backend import cuda_event_ms
from .indexer_topk import indexer_topk_slots
from .sparse_mla import indexer_logits

HEADS, DIM, TOP, BLOCK_SIZE = 64, 128, 2048, 64


def _time_us(fn: object, reps: int = 20) -> float:
    assert callable(fn)
    for _ in range(3):
        fn()
    return 1e3 * statistics.median(cuda_event_ms(fn) for _ in range(reps))


def _measure(q: torch.Tensor, w: torch.Tensor, k_cache: torch.Tensor, table: torch.Tensor,
             context: int, width: int) -> tuple[float, float, int]:
    """(old us, new us, rows whose selections agree) of one decode step."""
    batch, dev = q.shape[0], q.device
    req = torch.arange(batch, device=dev, dtype=torch.int32)
    pos = torch.full((batch,), context - 1, device=dev, dtype=torch.int32)
    logits = torch.empty(batch, width, device=dev)
    slots = torch.empty(batch, TOP, device=dev, dtype=torch.int64)
    past = torch.arange(width, device=dev)[None, :] > pos[:, None].long()

    def new() -> None:
        indexer_logits(q, w, k_cache, table, req, pos, DIM**-0.5, logits)
        indexer_topk_slots(logits, req, pos, table, BLOCK_SIZE, slots)

    def old() -> torch.Tensor:
        indexer_logits(q, w, k_cache, table, req, pos, DIM**-0.5, logits)
        logits.masked_fill_(past, float("-inf"))
        index = logits.topk(TOP, dim=-1).indices
        blocks = table[req.long()[:, None], index // BLOCK_SIZE].long()
        return blocks * BLOCK_SIZE + index % BLOCK_SIZE

    new()
    expected = old()
    same = int((slots.sort(dim=-1).values == expected.sort(dim=-1).values).all(-1).sum())
    return _time_us(old), _time_us(new), same


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--width", type=int, default=163840, help="max_model_len")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 32768, 131072])
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    blocks_per_req = -(-args.width // BLOCK_SIZE)
    print(f"{'batch':>5} {'context':>8} {'old us':>9} {'new us':>9} {'speed-up':>8} same rows")
    for batch in args.batches:
        num_blocks = batch * blocks_per_req
        k_cache = torch.randn(num_blocks, BLOCK_SIZE, DIM, device=dev, generator=gen,
                              dtype=torch.bfloat16)
        table = torch.randperm(num_blocks, device=dev, generator=gen).int().view(batch, -1)
        q = torch.randn(batch, HEADS, DIM, device=dev, generator=gen, dtype=torch.bfloat16)
        w = torch.randn(batch, HEADS, device=dev, generator=gen) * HEADS**-0.5
        for context in args.contexts:
            t_old, t_new, same = _measure(q, w, k_cache, table, context, args.width)
            print(f"{batch:>5} {context:>8} {t_old:>9.1f} {t_new:>9.1f} {t_old / t_new:>7.2f}x"
                  f" {same}/{batch}")


if __name__ == "__main__":
    main()
