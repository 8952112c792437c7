"""DeepSeek Sparse Attention (DSA) kernels: the lightning indexer's scores over a paged cache
of indexer keys, and absorbed multi-head latent attention over a top-k set of cache slots;
references in sparse_mla_ref.

* :func:`indexer_logits`: ``out[t, s] = sum_h w[t, h] * relu(scale * q[t, h] . k[s])`` for
  every cached key position ``s <= pos(t)`` of token ``t``'s request; the kernel leaves the
  columns past that (and padding rows) unwritten (the reference writes ``-inf`` there), as
  nothing reads them. The key cache is one vector per token, ``[num_blocks, block_size, D]``,
  addressed through the request's block table like the latent cache. A program per (token,
  split), each split looping over every ``splits``-th tile of ``BLOCK_N`` key positions up to
  the token's own: the launch and the work follow the real context, not the width of
  ``out`` (``max_model_len`` under CUDA graphs).
* :func:`sparse_mla_attention`: MLA in the absorbed form (see
  :mod:`~mrv2_kernels.mla_attention`) of token ``t`` over the cache rows ``slots[t]`` (flat
  slots, ``-1``: none), online softmax in base 2. A program per (token, head tile); the
  selected rows are gathered ``BLOCK_N`` at a time and each serves every head of the tile as
  key and value.

The top-k between them is :func:`mrv2_kernels.indexer_topk.indexer_topk_slots` (bounded by
each row's position as well). Neither kernel reads anything back to the host; bf16 is
converted to fp32 right after loading on the interpreter and for fp32 caches.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from ._backend import LOG2E as _LOG2E
from ._backend import M_INIT as _M_INIT
from ._backend import cdiv, next_power_of_2, use_triton
from .sparse_mla_ref import (
    _check_logits,
    _check_sparse,
    indexer_logits_ref,
    sparse_mla_attention_ref,
)

#: Programs the indexer's score kernel aims to launch on a GPU (a few per SM).
_PROGRAMS = 1024

__all__ = [
    "indexer_logits",
    "indexer_logits_ref",
    "indexer_logits_triton",
    "sparse_mla_attention",
    "sparse_mla_attention_ref",
    "sparse_mla_attention_triton",
]


@triton.jit
def _indexer_logits_kernel(
    q_ptr: tl.tensor, w_ptr: tl.tensor, k_ptr: tl.tensor, bt_ptr: tl.tensor, req_ptr: tl.tensor,
    pos_ptr: tl.tensor, out_ptr: tl.tensor, scale: float, span: tl.tensor,
    stride_qt: tl.tensor, stride_qh: tl.tensor, stride_wt: tl.tensor, stride_kb: tl.tensor,
    stride_ks: tl.tensor, stride_bt: tl.tensor, stride_ot: tl.tensor,
    HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr,
    FP32_PRECISION: tl.constexpr,
) -> None:
    tok = tl.program_id(0).to(tl.int64)
    req = tl.load(req_ptr + tok)
    pos = tl.load(pos_ptr + tok)
    if req < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(q_ptr + tok * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_h[:, None] < HEADS) & (offs_d[None, :] < DIM), other=0.0)
    w = tl.load(w_ptr + tok * stride_wt + offs_h, mask=offs_h < HEADS, other=0.0).to(tl.float32)
    if DOT_FP32:
        q = q.to(tl.float32)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    last = tl.minimum(pos, span - 1)
    # this program's tiles: every num_programs(1)-th one up to the token's own position
    for tile in range(tl.program_id(1), last // BLOCK_N + 1, tl.num_programs(1)):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        visible = offs_n <= last
        block = tl.load(bt_row + offs_n // KV_BLOCK_SIZE, mask=visible, other=0).to(tl.int64)
        rows = block * stride_kb + (offs_n % KV_BLOCK_SIZE) * stride_ks
        k = tl.load(k_ptr + rows[:, None] + offs_d[None, :],
                    mask=visible[:, None] & (offs_d[None, :] < DIM), other=0.0)
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=FP32_PRECISION)
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.maximum(s * scale, 0.0)
        logits = tl.sum(s * w[:, None], 0)
        tl.store(out_ptr + tok * stride_ot + offs_n, logits, mask=visible)


def indexer_logits_triton(
    q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
    token_req: torch.Tensor, token_pos: torch.Tensor, scale: float, out: torch.Tensor,
    *, block_n: int | None = None, splits: int | None = None,
) -> torch.Tensor:
    """:func:`indexer_logits_ref` as a Triton kernel, writing only the visible positions
    (``s <= pos(t)`` of real rows): a program per token and split of its ``block_n``-key
    tiles (``splits`` of them, each taking every ``splits``-th tile up to the token's
    position, so the launch does not grow with the width of ``out``). ``q`` rows ``[H, D]``
    must be contiguous per token."""
    _check_logits(q, weights, k_cache, token_req, token_pos, out)
    num_tokens, heads, dim = q.shape
    span = out.shape[1]
    if num_tokens == 0 or span == 0:
        return out
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and out.stride(1) == 1, "rows contiguous"
    on_gpu = q.is_cuda
    block_n = block_n or (64 if on_gpu else 16)
    tiles = cdiv(span, block_n)
    # enough programs to fill the GPU whatever the batch; one per token on the interpreter
    splits = min(tiles, splits or (max(1, cdiv(_PROGRAMS, num_tokens)) if on_gpu else 1))
    _indexer_logits_kernel[(num_tokens, splits)](
        q, weights, k_cache, block_table, token_req, token_pos, out, float(scale), span,
        q.stride(0), q.stride(1), weights.stride(0), k_cache.stride(0), k_cache.stride(1),
        block_table.stride(0), out.stride(0),
        HEADS=heads, DIM=dim, BLOCK_H=max(16, next_power_of_2(heads)),
        BLOCK_D=max(16, next_power_of_2(dim)), BLOCK_N=block_n, KV_BLOCK_SIZE=k_cache.shape[1],
        DOT_FP32=(not on_gpu) or k_cache.dtype == torch.float32,
        FP32_PRECISION="tf32x3" if on_gpu else "ieee",
        num_warps=4 if on_gpu else 1,
    )  # fmt: skip
    return out


def indexer_logits(
    q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
    token_req: torch.Tensor, token_pos: torch.Tensor, scale: float, out: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """The indexer's scores (:func:`indexer_logits_ref`; the columns past each token's
    position are not part of the result): Triton (see :func:`use_triton`) or the
    reference."""
    if use_triton(q):
        return indexer_logits_triton(q, weights, k_cache, block_table, token_req, token_pos,
                                     scale, out, **kwargs)
    return indexer_logits_ref(q, weights, k_cache, block_table, token_req, token_pos, scale, out)


@triton.jit
def _sparse_mla_kernel(
    ql_ptr: tl.tensor, qp_ptr: tl.tensor, cache_ptr: tl.tensor, slot_ptr: tl.tensor,
    out_ptr: tl.tensor, qk_scale: tl.tensor, top: tl.tensor,
    stride_lt: tl.tensor, stride_lh: tl.tensor, stride_pt: tl.tensor, stride_ph: tl.tensor,
    stride_cb: tl.tensor, stride_cs: tl.tensor, stride_st: tl.tensor, stride_ot: tl.tensor,
    stride_oh: tl.tensor,
    HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, RANK_P2: tl.constexpr,
    ROPE_P2: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr, FP32_PRECISION: tl.constexpr,
) -> None:
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, RANK_P2)
    offs_p = tl.arange(0, ROPE_P2)
    h_ok = offs_h < HEADS
    ql = tl.load(ql_ptr + tok * stride_lt + offs_h[:, None] * stride_lh + offs_r[None, :],
                 mask=h_ok[:, None] & (offs_r[None, :] < RANK), other=0.0)
    qp = tl.load(qp_ptr + tok * stride_pt + offs_h[:, None] * stride_ph + offs_p[None, :],
                 mask=h_ok[:, None] & (offs_p[None, :] < ROPE), other=0.0)
    if DOT_FP32:
        ql = ql.to(tl.float32)
        qp = qp.to(tl.float32)
    m_i = tl.full((BLOCK_H,), _M_INIT, tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, RANK_P2), tl.float32)
    for start in range(0, top, BLOCK_N):
        offs_k = start + tl.arange(0, BLOCK_N)
        slot = tl.load(slot_ptr + tok * stride_st + offs_k, mask=offs_k < top, other=-1)
        slot = slot.to(tl.int64)
        ok = slot >= 0
        row = (slot // KV_BLOCK_SIZE) * stride_cb + (slot % KV_BLOCK_SIZE) * stride_cs
        row = tl.where(ok, row, 0)
        c = tl.load(cache_ptr + row[:, None] + offs_r[None, :],
                    mask=ok[:, None] & (offs_r[None, :] < RANK), other=0.0)
        pe = tl.load(cache_ptr + row[:, None] + RANK + offs_p[None, :],
                     mask=ok[:, None] & (offs_p[None, :] < ROPE), other=0.0)
        if DOT_FP32:
            c = c.to(tl.float32)
            pe = pe.to(tl.float32)
            s = tl.dot(ql, tl.trans(c), input_precision=FP32_PRECISION)
            s = tl.dot(qp, tl.trans(pe), acc=s, input_precision=FP32_PRECISION)
        else:
            s = tl.dot(ql, tl.trans(c))
            s = tl.dot(qp, tl.trans(pe), acc=s)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = (tl.dot(p, c, input_precision=FP32_PRECISION) if DOT_FP32
              else tl.dot(p.to(c.dtype), c))
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok * stride_ot + offs_h[:, None] * stride_oh + offs_r[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & (offs_r[None, :] < RANK))


def sparse_mla_attention_triton(
    q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
    sm_scale: float, out: torch.Tensor, *, block_h: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """:func:`sparse_mla_attention_ref` as a Triton kernel (a program per token and head
    tile)."""
    _check_sparse(q_latent, q_pe, cache, slots, out)
    num_tokens, heads, rank = q_latent.shape
    rope = q_pe.shape[2]
    if num_tokens == 0:
        return out
    assert q_latent.stride(2) == 1 and q_pe.stride(2) == 1 and cache.stride(2) == 1
    assert slots.stride(1) == 1 and out.stride(2) == 1, "rows must be contiguous"
    on_gpu = q_latent.is_cuda
    block_h = block_h or 16
    block_n = block_n or (32 if on_gpu else 16)
    _sparse_mla_kernel[(num_tokens, cdiv(heads, block_h))](
        q_latent, q_pe, cache, slots, out, float(sm_scale) * _LOG2E, slots.shape[1],
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        cache.stride(0), cache.stride(1), slots.stride(0), out.stride(0), out.stride(1),
        HEADS=heads, RANK=rank, ROPE=rope, RANK_P2=max(16, next_power_of_2(rank)),
        ROPE_P2=max(16, next_power_of_2(rope)), BLOCK_H=block_h, BLOCK_N=block_n,
        KV_BLOCK_SIZE=cache.shape[1],
        DOT_FP32=(not on_gpu) or cache.dtype == torch.float32,
        FP32_PRECISION="tf32x3" if on_gpu else "ieee",
        num_warps=4 if on_gpu else 1,
    )  # fmt: skip
    return out


def sparse_mla_attention(
    q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor,
    sm_scale: float, out: torch.Tensor, **kwargs: Any,
) -> torch.Tensor:
    """Absorbed MLA attention over each token's selected cache slots
    (:func:`sparse_mla_attention_ref`): Triton (see :func:`use_triton`) or the reference."""
    if use_triton(q_latent):
        return sparse_mla_attention_triton(q_latent, q_pe, cache, slots, sm_scale, out,
                                           **kwargs)
    return sparse_mla_attention_ref(q_latent, q_pe, cache, slots, sm_scale, out)
