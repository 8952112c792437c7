"""The DSA kernels (:mod:`mrv2_kernels.sparse_mla`, :mod:`mrv2_kernels.indexer_topk`) against
their torch references: the indexer's scores over a paged key cache (positions past each token
and padding rows left unwritten by the kernel, ``-inf`` in the reference), the top-k selection
as cache slots (reading only each row's visible positions), and latent attention over
selected slots (``-1`` entries skipped, a row with none zero); all compiled for sm_90 at
DeepSeek-V3.2's shapes."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from mrv2_kernels.indexer_topk import (
    indexer_topk_slots_full_width,
    indexer_topk_slots_ref,
    indexer_topk_slots_triton,
)
from mrv2_kernels.sparse_mla import (
    indexer_logits_ref,
    indexer_logits_triton,
    sparse_mla_attention_ref,
    sparse_mla_attention_triton,
)

DEVICE = "cuda" if os.environ.get("MRV2_TEST_GPU") and torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_refs(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    heads, dim, blocks, block_size, span = 5, 24, 12, 4, 19

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    k_cache = rand(blocks, block_size, dim)
    block_table = torch.randperm(blocks, generator=gen)[:10].view(2, 5).int().to(DEVICE)
    # request 0: 3 tokens at 9..11; request 1: 4 tokens at 14..17; two padding rows
    token_req = torch.tensor([0, 0, 0, 1, 1, 1, 1, -1, -1], dtype=torch.int32, device=DEVICE)
    token_pos = torch.tensor([9, 10, 11, 14, 15, 16, 17, -1, -1], dtype=torch.int32,
                             device=DEVICE)
    q, weights = rand(9, heads, dim), rand(9, heads).float()
    ref = indexer_logits_ref(q, weights, k_cache, block_table, token_req, token_pos, 0.3,
                             torch.empty(9, span, device=DEVICE))
    assert torch.isinf(ref[7:]).all()
    assert torch.isinf(ref[0, 10:]).all() and torch.isfinite(ref[0, :10]).all()
    visible = torch.isfinite(ref)
    for splits in (1, 2):  # one program a token looping over its tiles; two interleaved
        out = torch.full((9, span), float("nan"), device=DEVICE)
        got = indexer_logits_triton(q, weights, k_cache, block_table, token_req, token_pos,
                                    0.3, out, block_n=4, splits=splits)
        assert torch.isnan(got[~visible]).all(), "wrote past a token or on a padding row"
        torch.testing.assert_close(got[visible], ref[visible], atol=1e-2, rtol=1e-2)

    rank, rope, num_heads, top = 32, 16, 3, 6
    cache = rand(blocks, block_size, rank + rope)
    slots = torch.randint(0, blocks * block_size, (4, top), generator=gen).to(DEVICE)
    slots[1, 2:] = -1
    slots[2] = -1
    q_latent, q_pe = rand(4, num_heads, rank), rand(4, num_heads, rope)
    out2 = torch.full((4, num_heads, rank), float("nan"), dtype=dtype, device=DEVICE)
    got2 = sparse_mla_attention_triton(q_latent, q_pe, cache, slots, 0.2, out2, block_n=16)
    ref2 = sparse_mla_attention_ref(q_latent, q_pe, cache, slots, 0.2,
                                    torch.empty_like(out2))
    assert (ref2[2] == 0).all()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got2.float(), ref2.float(), atol=tol, rtol=tol)


def test_topk_slots_match_ref() -> None:
    """Rows longer than ``top`` (random, heavy ties, a tie before higher values, negatives),
    shorter ones, a padding row; columns past each row poisoned (NaN, +inf) to show they are
    never read; several tiles a row."""
    gen = torch.Generator().manual_seed(1)
    rows, span, top, block_size = 8, 150, 20, 4
    logits = torch.randn(rows, span, generator=gen)
    logits[2, :100] = torch.randint(0, 3, (100,), generator=gen).float()  # ties at the cut
    logits[3] = 0.0
    logits[3, 100:110] = 5.0  # above the tie, after it: the tie's first ten only
    logits[4, :50] = -logits[4, :50].abs()
    logits[7, :40] = -0.0  # equal values: the key order puts -0.0 below 0.0 (either is right)
    logits[7, 40:80] = 0.0
    token_req = torch.tensor([0, 1, 0, 1, 0, -1, 1, 0], dtype=torch.int32)
    token_pos = torch.tensor([149, 10, 99, 120, 19, 5, 20, 79], dtype=torch.int32)
    for t in range(rows):
        logits[t, int(token_pos[t]) + 1:] = float("inf") if t % 2 else float("nan")
    block_table = torch.randperm(80, generator=gen)[:76].view(2, 38).int()
    ref = indexer_topk_slots_ref(logits, token_req, token_pos, block_table, block_size,
                                 torch.full((rows, top), 7, dtype=torch.int64))
    # the specification itself, by hand on row 0 (no ties) and the lengths of the others
    best = logits[0].topk(top).indices.sort().values
    assert torch.equal(ref[0], (block_table[0, best // 4].long() * 4 + best % 4))
    flat = block_table[1].long().repeat_interleave(4) * 4 + torch.arange(152) % 4
    assert (ref[[1, 4, 6]] >= 0).sum(1).tolist() == [11, 20, 20] and (ref[5] == -1).all()
    assert (ref[1, 11:] == -1).all() and (ref[[0, 2, 3, 7]] >= 0).all()
    assert torch.equal(ref[3], torch.cat([flat[:10], flat[100:110]]))
    tied = ref[2]  # the values 2 (and then 1) taken in position order
    flat = block_table[0].long().repeat_interleave(4) * 4 + torch.arange(152) % 4
    picked = logits[2, [int((flat == slot).nonzero()) for slot in tied]]
    assert picked.min() >= logits[2, :100].sort(descending=True).values[top - 1]
    logits, token_req, token_pos = (x.to(DEVICE) for x in (logits, token_req, token_pos))
    out = torch.full((rows, top + 1), 7, dtype=torch.int64, device=DEVICE)  # a guard column
    got = indexer_topk_slots_triton(logits, token_req, token_pos, block_table.to(DEVICE),
                                    block_size, out[:, :top], block=16)
    assert torch.equal(got.cpu(), ref) and (out[:, top] == 7).all()
    # torch.topk over the full width, past each row filled with -inf: the same sets where no
    # tie sits at the threshold (rows 0, 1, 4, 5, 6)
    full = indexer_topk_slots_full_width(logits.clone(), token_req, token_pos,
                                         block_table.to(DEVICE), block_size,
                                         torch.full((rows, top), 7, dtype=torch.int64,
                                                    device=DEVICE)).cpu()
    plain = [0, 1, 4, 5, 6]
    assert torch.equal(full[plain].sort(dim=1).values, ref[plain].sort(dim=1).values)


_SM90_SCRIPT = r"""
from mrv2_kernels import indexer_topk as t
from mrv2_kernels import sparse_mla as m

bf, f32, i32 = "*bf16", "*fp32", "*i32"
build(m._indexer_logits_kernel,
      {"q_ptr": bf, "w_ptr": f32, "k_ptr": bf, "bt_ptr": i32, "req_ptr": i32, "pos_ptr": i32,
       "out_ptr": f32},
      dict(HEADS=64, DIM=128, BLOCK_H=64, BLOCK_D=128, BLOCK_N=64, KV_BLOCK_SIZE=16,
           DOT_FP32=False, FP32_PRECISION="tf32x3"), num_warps=4)
build(m._sparse_mla_kernel,
      {"ql_ptr": bf, "qp_ptr": bf, "cache_ptr": bf, "slot_ptr": "*i64", "out_ptr": bf},
      dict(HEADS=128, RANK=512, ROPE=64, RANK_P2=512, ROPE_P2=64, BLOCK_H=16, BLOCK_N=32,
           KV_BLOCK_SIZE=16, DOT_FP32=False, FP32_PRECISION="tf32x3"), num_warps=4)
build(t._indexer_topk_kernel,
      {"logits_ptr": f32, "req_ptr": i32, "pos_ptr": i32, "bt_ptr": i32, "out_ptr": "*i64"},
      dict(TOP=2048, KV_BLOCK_SIZE=64, BLOCK=1024), num_warps=8)
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU run compiles them for real")
def test_kernels_compile_for_sm90(tmp_path: Any) -> None:
    from sm90 import compile_for_sm90

    shared = [size for sizes in compile_for_sm90(_SM90_SCRIPT, tmp_path).values()
              for size in sizes]
    assert len(shared) == 3 and max(shared) <= 200 * 1024, shared
