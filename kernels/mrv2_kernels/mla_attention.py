"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged latent cache, absorbed form;
references in mla_attention_ref.

Cache layout, one tensor per layer: ``[num_blocks, block_size, kv_lora_rank + rope_dim]``; row
``[c_kv ; k_pe]`` holds the normalised compressed latent ``c_kv`` (``R = kv_lora_rank``) then
the roped key ``k_pe`` (``P = rope_dim``), one "head" shared by every query head. Slot ``s`` is
block ``s // block_size``, offset ``s % block_size``; slot -1 writes nothing.

* :func:`mla_cache_write` stores a step's ``latent [T, R]`` and ``k_pe [T, P]`` at their slots.
  (:func:`mrv2_kernels.kv_cache.write_kv` cannot be reused: it writes equal-shaped K and V
  rows into the two planes of a ``[2, ..., heads, dim]`` cache, not one ``R + P`` row.)
* :func:`mla_decode_attention`: with ``W_UK`` absorbed into the query (``q_latent = q_nope
  W_UK^T`` per head) and ``W_UV`` left for after, attention of token ``t`` (request ``b``,
  position ``p = seq_len - q_len + i``) is ``softmax(sm_scale * (q_latent . c_kv + q_pe .
  k_pe)) @ c_kv`` over cache rows ``0..p``. Causal within the query, so it serves decode steps
  (1 token), verify steps (``1 + k``) and short prefill chunks; long prefills should use the
  decompressed form (standard attention over ``c_kv W_UK``, ``c_kv W_UV``).

Kernel: a program per (head tile x KV split, query tile, request). Its ``BLOCK_M = BLOCK_Q x
BLOCK_H`` rows are (query token, head) pairs, so each ``[BLOCK_N, R + P]`` latent tile is loaded
once and serves every row twice, as the key of ``QK^T`` and as the value of ``PV``: all heads
share it, which is MLA's whole point. Head tiles are the fastest grid axis, so the head groups
of one chunk (H = 128: 8 of them) run side by side and share the chunk through L2. Splits cut
each request's own key range evenly on the device ("flash decoding"): partial (max, sum, acc)
in fp32, then a combine kernel writes ``out`` (and ``lse``). Online softmax in base 2, fp32
accumulation; on the interpreter (and for fp32 caches) everything is fp32 right after loading.

Only rows of real query tokens are written: tokens past ``query_start_loc[num_reqs]`` and
requests with no query are left untouched. No host sync: grids come from CPU-known bounds.

With ``flat_grid`` (the default; ``MRV2_MLA_FLAT_GRID=0`` turns it off) a plan of several
query tiles launches over the step's query tiles instead of (query tile bound, request):
``T // block_q + num_reqs`` programs per head tile and split, each finding its request in
``query_start_loc`` (:func:`~mrv2_kernels._backend.flat_query_tile`). Its grid does not grow
with ``max_query_len``, which a CUDA graph of mixed steps bakes as the padded token count (with
``block_q = 2`` at 16 heads, the (tile, request) grid of an 8,192-token graph of 256 requests
would launch a million programs a head tile, nearly all exiting at once).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ._backend import LOG2E as _LOG2E
from ._backend import M_INIT as _M_INIT
from ._backend import (
    cdiv,
    flat_query_tile,
    next_power_of_2,
    sm_count,
    softmax_rescale,
    use_triton,
)
from .mla_attention_ref import (
    _check_decode,
    _check_write,
    mla_cache_write_ref,
    mla_decode_attention_ref,
)

_LN2 = tl.constexpr(0.6931471805599453)  # a constexpr: compiled kernels read only those
_MAX_SPLITS = 64

__all__ = [
    "FLAT_GRID_ENV_VAR",
    "MLADecodePlan",
    "flat_grid_enabled",
    "mla_cache_write",
    "mla_cache_write_ref",
    "mla_cache_write_triton",
    "mla_decode_attention",
    "mla_decode_attention_ref",
    "mla_decode_attention_triton",
    "mla_decode_plan",
]


# ---- cache write ----------------------------------------------------------------------------


@triton.jit
def _mla_write_kernel(
    latent_ptr: tl.tensor, pe_ptr: tl.tensor, cache_ptr: tl.tensor, slot_ptr: tl.tensor,
    stride_lt: tl.tensor, stride_pt: tl.tensor, stride_cb: tl.tensor, stride_cs: tl.tensor,
    RANK: tl.constexpr, ROPE: tl.constexpr, RANK_P2: tl.constexpr, ROPE_P2: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
) -> None:
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    dst = cache_ptr + (slot // KV_BLOCK_SIZE) * stride_cb + (slot % KV_BLOCK_SIZE) * stride_cs
    offs_r = tl.arange(0, RANK_P2)
    offs_p = tl.arange(0, ROPE_P2)
    c = tl.load(latent_ptr + tok * stride_lt + offs_r, mask=offs_r < RANK)
    pe = tl.load(pe_ptr + tok * stride_pt + offs_p, mask=offs_p < ROPE)
    tl.store(dst + offs_r, c.to(cache_ptr.dtype.element_ty), mask=offs_r < RANK)
    tl.store(dst + RANK + offs_p, pe.to(cache_ptr.dtype.element_ty), mask=offs_p < ROPE)


def mla_cache_write_triton(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``[latent ; k_pe]`` rows at ``slot_mapping`` (skip < 0); a program per token.

    ``latent``/``k_pe`` may be strided views (say, of the ``kv_a_proj`` output) with contiguous
    rows; values are cast to the cache's dtype. No host sync.
    """
    _check_write(latent, k_pe, cache, slot_mapping)
    num_tokens, rank = latent.shape
    rope = k_pe.shape[1]
    if num_tokens == 0:
        return
    assert latent.stride(1) == 1 and k_pe.stride(1) == 1 and cache.stride(2) == 1, (
        "rows must be contiguous"
    )
    _mla_write_kernel[(num_tokens,)](
        latent, k_pe, cache, slot_mapping,
        latent.stride(0), k_pe.stride(0), cache.stride(0), cache.stride(1),
        RANK=rank, ROPE=rope, RANK_P2=next_power_of_2(rank),
        ROPE_P2=next_power_of_2(rope), KV_BLOCK_SIZE=cache.shape[1],
        num_warps=4 if latent.is_cuda else 1,
    )  # fmt: skip


def mla_cache_write(
    latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write a step's latents into the MLA cache: Triton (see :func:`use_triton`) or the ref."""
    if use_triton(latent):
        mla_cache_write_triton(latent, k_pe, cache, slot_mapping)
    else:
        mla_cache_write_ref(latent, k_pe, cache, slot_mapping)


# ---- decode attention: kernels ------------------------------------------------------------


@triton.jit
def _load_rows(
    cache_ptr: tl.tensor, row_off: tl.tensor, n_ok: tl.tensor, offs_r: tl.tensor,
    offs_p: tl.tensor, RANK: tl.constexpr, ROPE: tl.constexpr, RANK_P2: tl.constexpr,
    ROPE_P2: tl.constexpr, MASK_N: tl.constexpr, DOT_FP32: tl.constexpr,
) -> Any:
    """A key tile's ``[BLOCK_N, RANK_P2]`` latents and ``[BLOCK_N, ROPE_P2]`` rope keys."""
    c_ptrs = cache_ptr + row_off[:, None] + offs_r[None, :]
    p_ptrs = cache_ptr + row_off[:, None] + RANK + offs_p[None, :]
    if MASK_N or RANK != RANK_P2:
        c_mask = offs_r[None, :] < RANK
        if MASK_N:
            c_mask = c_mask & n_ok[:, None]
        c = tl.load(c_ptrs, mask=c_mask, other=0.0)
    else:
        c = tl.load(c_ptrs)
    if MASK_N or ROPE != ROPE_P2:
        p_mask = offs_p[None, :] < ROPE
        if MASK_N:
            p_mask = p_mask & n_ok[:, None]
        pe = tl.load(p_ptrs, mask=p_mask, other=0.0)
    else:
        pe = tl.load(p_ptrs)
    if DOT_FP32:
        c = c.to(tl.float32)
        pe = pe.to(tl.float32)
    return c, pe


@triton.jit
def _mla_tile(
    ql: tl.tensor, qp: tl.tensor, c: tl.tensor, pe: tl.tensor, acc: tl.tensor, m_i: tl.tensor,
    l_i: tl.tensor, qk_scale: tl.tensor, visible: tl.tensor, MASKED: tl.constexpr,
    DOT_FP32: tl.constexpr, FP32_PRECISION: tl.constexpr,
) -> Any:
    """One online-softmax step (log2 domain): the latent tile is both the key and the value.
    (The value product is added after the dot, not accumulated inside it as
    :func:`~mrv2_kernels._backend.online_softmax_step` does: not measured for MLA's 512-wide
    accumulator.)"""
    if DOT_FP32:
        s = tl.dot(ql, tl.trans(c), input_precision=FP32_PRECISION)
        s = tl.dot(qp, tl.trans(pe), acc=s, input_precision=FP32_PRECISION)
    else:
        s = tl.dot(ql, tl.trans(c))
        s = tl.dot(qp, tl.trans(pe), acc=s)
    p, alpha, m_new, l_i = softmax_rescale(s, m_i, l_i, qk_scale, visible, MASKED)
    pv = tl.dot(p, c, input_precision=FP32_PRECISION) if DOT_FP32 else tl.dot(p.to(c.dtype), c)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i


#: ``0``: plans of several query tiles launch one program per (query tile bound, request)
#: instead of over the step's query tiles only (:func:`mla_decode_attention_triton`'s
#: ``flat_grid``, on by default).
FLAT_GRID_ENV_VAR = "MRV2_MLA_FLAT_GRID"


def flat_grid_enabled() -> bool:
    """Whether the flat grid is on: unless :data:`FLAT_GRID_ENV_VAR` is ``0`` (read when
    called)."""
    return os.environ.get(FLAT_GRID_ENV_VAR, "1") != "0"


@triton.jit(do_not_specialize=["num_splits", "num_reqs"])
def _mla_decode_kernel(
    ql_ptr: tl.tensor, qp_ptr: tl.tensor, cache_ptr: tl.tensor, out_ptr: tl.tensor,
    lse_ptr: tl.tensor, part_m_ptr: tl.tensor, part_l_ptr: tl.tensor, part_acc_ptr: tl.tensor,
    qsl_ptr: tl.tensor, seq_lens_ptr: tl.tensor, block_table_ptr: tl.tensor, qk_scale: tl.tensor,
    stride_qlt: tl.tensor, stride_qlh: tl.tensor, stride_qpt: tl.tensor, stride_qph: tl.tensor,
    stride_ot: tl.tensor, stride_oh: tl.tensor, stride_lset: tl.tensor, stride_lseh: tl.tensor,
    stride_cb: tl.tensor, stride_cs: tl.tensor, stride_bt: tl.tensor, num_splits: tl.tensor,
    num_reqs: tl.tensor, NUM_HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
    RANK_P2: tl.constexpr,
    ROPE_P2: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr, USE_SPLITS: tl.constexpr, HAS_LSE: tl.constexpr,
    DOT_FP32: tl.constexpr, FP32_PRECISION: tl.constexpr, FLAT: tl.constexpr = False,
    REQ_BLOCK: tl.constexpr = 16,
) -> None:
    NUM_H_TILES: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_H
    h_tile = tl.program_id(0) % NUM_H_TILES
    split = tl.program_id(0) // NUM_H_TILES
    if FLAT:  # program_id(1) counts every request's query tiles (see flat_query_tile)
        req, q_tile = flat_query_tile(qsl_ptr, num_reqs, tl.program_id(1), BLOCK_Q, REQ_BLOCK)
    else:
        q_tile = tl.program_id(1)
        req = tl.program_id(2)

    q_start = tl.load(qsl_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)  # issued before the exit: overlaps the load above
    qlen = tl.load(qsl_ptr + req + 1) - q_start
    tile_start = q_tile * BLOCK_Q
    if tile_start >= qlen:
        return
    ctx_len = seq_len - qlen

    rows = tl.arange(0, BLOCK_M)
    tok = tile_start + rows // BLOCK_H
    head = h_tile * BLOCK_H + rows % BLOCK_H
    row_ok = (tok < qlen) & (head < NUM_HEADS)
    pos = ctx_len + tok
    q_row = (q_start + tok).to(tl.int64)
    offs_r = tl.arange(0, RANK_P2)
    offs_p = tl.arange(0, ROPE_P2)
    r_ok = offs_r < RANK

    ql = tl.load(
        ql_ptr + q_row[:, None] * stride_qlt + head[:, None] * stride_qlh + offs_r[None, :],
        mask=row_ok[:, None] & r_ok[None, :],
        other=0.0,
    )
    qp = tl.load(
        qp_ptr + q_row[:, None] * stride_qpt + head[:, None] * stride_qph + offs_p[None, :],
        mask=row_ok[:, None] & (offs_p[None, :] < ROPE),
        other=0.0,
    )
    if DOT_FP32:
        ql = ql.to(tl.float32)
        qp = qp.to(tl.float32)

    # Keys this tile can see: [0, kv_end); split `split` takes an even, BLOCK_N-aligned chunk.
    kv_end = tl.maximum(tl.minimum(ctx_len + tile_start + BLOCK_Q, seq_len), 0)
    if USE_SPLITS:
        chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, kv_end)
    else:
        lo = kv_end * 0
        hi = kv_end
    # Keys at or below every row's position need no mask (all of a decode step's but the tail).
    full_end = tl.minimum(hi, ctx_len + tile_start + 1)
    mid = lo + (tl.maximum(full_end - lo, 0) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, RANK_P2], dtype=tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)

    for start in range(lo, mid, BLOCK_N):
        n = start + offs_n
        blk = tl.load(bt_row + n // KV_BLOCK_SIZE).to(tl.int64)
        row_off = blk * stride_cb + (n % KV_BLOCK_SIZE) * stride_cs
        c, pe = _load_rows(
            cache_ptr, row_off, n, offs_r, offs_p, RANK, ROPE, RANK_P2, ROPE_P2, False, DOT_FP32
        )
        acc, m_i, l_i = _mla_tile(
            ql, qp, c, pe, acc, m_i, l_i, qk_scale, n, False, DOT_FP32, FP32_PRECISION
        )
    for start in range(mid, hi, BLOCK_N):
        n = start + offs_n
        n_ok = n < hi
        blk = tl.load(bt_row + n // KV_BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row_off = blk * stride_cb + (n % KV_BLOCK_SIZE) * stride_cs
        c, pe = _load_rows(
            cache_ptr, row_off, n_ok, offs_r, offs_p, RANK, ROPE, RANK_P2, ROPE_P2, True, DOT_FP32
        )
        visible = (n[None, :] <= pos[:, None]) & n_ok[None, :]
        acc, m_i, l_i = _mla_tile(
            ql, qp, c, pe, acc, m_i, l_i, qk_scale, visible, True, DOT_FP32, FP32_PRECISION
        )

    if USE_SPLITS:
        part = (q_row * NUM_HEADS + head) * num_splits + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(
            part_acc_ptr + part[:, None] * RANK + offs_r[None, :],
            acc,
            mask=row_ok[:, None] & r_ok[None, :],
        )
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_r[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & r_ok[None, :],
        )
        if HAS_LSE:
            lse = tl.where(l_i > 0.0, (m_i + tl.math.log2(l_safe)) * _LN2, float("-inf"))
            tl.store(lse_ptr + q_row * stride_lset + head * stride_lseh, lse, mask=row_ok)


@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def _mla_combine_kernel(
    part_m_ptr: tl.tensor, part_l_ptr: tl.tensor, part_acc_ptr: tl.tensor, out_ptr: tl.tensor,
    lse_ptr: tl.tensor, qsl_ptr: tl.tensor, num_reqs: tl.tensor, stride_ot: tl.tensor,
    stride_oh: tl.tensor, stride_lset: tl.tensor, stride_lseh: tl.tensor, num_splits: tl.tensor,
    NUM_HEADS: tl.constexpr, RANK: tl.constexpr, SPLITS_P2: tl.constexpr, COMBINE_H: tl.constexpr,
    COMBINE_R: tl.constexpr, HAS_LSE: tl.constexpr,
) -> None:
    """Merge the splits' partials of ``COMBINE_H`` heads x ``COMBINE_R`` latent dims of a token."""
    tok = tl.program_id(0).to(tl.int64)
    if tok >= tl.load(qsl_ptr + num_reqs):
        return  # a padding token: left untouched
    heads = tl.program_id(1) * COMBINE_H + tl.arange(0, COMBINE_H)
    offs_r = tl.program_id(2) * COMBINE_R + tl.arange(0, COMBINE_R)
    offs_s = tl.arange(0, SPLITS_P2)
    h_ok = heads < NUM_HEADS
    r_ok = offs_r < RANK
    hs_ok = h_ok[:, None] & (offs_s[None, :] < num_splits)
    part = (tok * NUM_HEADS + heads[:, None]) * num_splits + offs_s[None, :]  # [CH, S]
    m = tl.load(part_m_ptr + part, mask=hs_ok, other=_M_INIT)
    l_s = tl.load(part_l_ptr + part, mask=hs_ok, other=0.0)
    acc = tl.load(
        part_acc_ptr + part[:, :, None] * RANK + offs_r[None, None, :],
        mask=hs_ok[:, :, None] & r_ok[None, None, :],
        other=0.0,
    )  # [CH, S, CR]
    m_max = tl.max(m, 1)
    w = tl.math.exp2(m - m_max[:, None])
    l_tot = tl.sum(w * l_s, 1)
    l_safe = tl.where(l_tot > 0.0, l_tot, 1.0)
    o = tl.sum(w[:, :, None] * acc, 1) / l_safe[:, None]
    tl.store(
        out_ptr + tok * stride_ot + heads[:, None] * stride_oh + offs_r[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & r_ok[None, :],
    )
    if HAS_LSE:
        lse = tl.where(l_tot > 0.0, (m_max + tl.math.log2(l_safe)) * _LN2, float("-inf"))
        tl.store(lse_ptr + tok * stride_lset + heads * stride_lseh, lse,
                 mask=h_ok & (tl.program_id(2) == 0))  # fmt: skip


# ---- decode attention: plan, launcher ------------------------------------------------------


@dataclass(frozen=True)
class MLADecodePlan:
    """How :func:`mla_decode_attention_triton` launches (host integers only)."""

    block_h: int
    """Query heads per program (they share every latent tile the program loads)."""
    block_q: int
    """Query tokens per program; ``block_q * block_h`` rows per ``tl.dot`` tile."""
    block_n: int
    """Keys per inner-loop step."""
    num_h_tiles: int
    num_q_tiles: int
    num_splits: int
    """KV chunks per (request, head tile, query tile); > 1 adds the combine kernel."""
    combine_h: int
    """Heads per combine program."""
    combine_r: int
    """Latent dims per combine program."""
    num_warps: int
    num_stages: int


def mla_decode_plan(
    *, num_heads: int, kv_lora_rank: int, max_query_len: int, max_seq_len: int, num_reqs: int,
    on_gpu: bool, elem_size: int = 2, num_sms: int = 132,
    block_h: int | None = None, block_q: int | None = None, block_n: int | None = None,
    num_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
) -> MLADecodePlan:
    """Tiles and splits for given CPU-known bounds (defaults per backend, then overrides).

    GPU, bf16/fp16 (compiled for sm_90 at R = 512, P = 64: no spills): 16 heads per program,
    tokens added while the rows stay <= 32 (a verify step of 2 tokens shares one read of the
    cache; 64 rows spill), at least 16 rows (``tl.dot``). From ``bench_mla --sweep`` on an
    H200 (2026-12-01, DeepSeek-V2-Lite's 16 heads, batch 1-64, context 1-4K): 64 keys a step
    (a 72 KiB latent + rope tile), 2 stages, 8 warps while the requests' programs fill under a
    quarter of the SMs, else 4; splits until the programs cover the SMs once, one step of
    keys each at least, at most 64 (``2 x num_sms`` programs and ``4 * block_n`` keys a split
    were 1.4-1.8x slower: at batch 1 the step is latency-bound and wants every SM, at batch 64
    a second partial wave costs more than the split saves). fp32 (tests only): 16 keys, 4
    warps, 16 rows. Interpreter: every head and up to 64 rows of a request per program, 16
    keys (each program costs ~25 ms there), splits for 8 programs, at least ``4 * block_n``
    keys each. Combine: ``[heads, splits, dims]`` tiles of <= 4096 fp32 on the GPU (1 head,
    ``4096 / splits`` dims), everything of a token at once on the interpreter.
    """
    heads_p2 = next_power_of_2(max(num_heads, 1))
    q_p2 = next_power_of_2(max(max_query_len, 1))
    if on_gpu:
        wide = elem_size <= 2
        bh = block_h if block_h is not None else min(heads_p2, 16)
        bq = block_q if block_q is not None else max(1, min(q_p2, (32 if wide else 16) // bh))
        bq = max(bq, cdiv(16, bh))  # tl.dot needs 16 rows
        bn = block_n if block_n is not None else (64 if wide else 16)
        warps, stages = 8 if wide else 4, 2
    else:
        bh = block_h if block_h is not None else heads_p2
        bq = block_q if block_q is not None else max(1, min(q_p2, max(1, 64 // bh)))
        bn = block_n if block_n is not None else 16
        warps, stages = 1, 1
    for name, v in (("block_h", bh), ("block_q", bq), ("block_n", bn)):
        assert v > 0 and v & (v - 1) == 0, f"{name} must be a power of two, got {v}"
    if on_gpu:
        assert bn >= 16 and bq * bh >= 16, "block_n and block_q * block_h must be >= 16 (tl.dot)"
    num_h_tiles = cdiv(num_heads, bh)
    num_q_tiles = cdiv(max(max_query_len, 0), bq)
    if num_splits is not None:
        splits = max(1, min(num_splits, _MAX_SPLITS))
    else:
        target = num_sms if on_gpu else 8
        base = max(num_reqs * num_q_tiles * num_h_tiles, 1)
        by_len = cdiv(max(max_seq_len, 1), bn if on_gpu else 4 * bn)
        splits = max(1, min(cdiv(target, base), by_len, _MAX_SPLITS))
    if on_gpu and num_warps is None and elem_size <= 2:
        warps = 8 if num_reqs * num_q_tiles * num_h_tiles * 4 < num_sms else 4
    rank_p2 = next_power_of_2(kv_lora_rank)
    if on_gpu:
        combine_h, combine_r = 1, min(rank_p2, max(16, 4096 // next_power_of_2(splits)))
    else:
        combine_h, combine_r = heads_p2, rank_p2
    return MLADecodePlan(
        block_h=bh, block_q=bq, block_n=bn, num_h_tiles=num_h_tiles, num_q_tiles=num_q_tiles,
        num_splits=splits, combine_h=combine_h, combine_r=combine_r,
        num_warps=num_warps if num_warps is not None else warps,
        num_stages=num_stages if num_stages is not None else stages,
    )  # fmt: skip


def mla_decode_attention_triton(
    q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, sm_scale: float,
    out: torch.Tensor,
    *,
    lse: torch.Tensor | None = None,
    num_reqs: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    block_h: int | None = None, block_q: int | None = None, block_n: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None,
    flat_grid: bool | None = None,
) -> torch.Tensor:
    """The Triton kernels (see the module doc); returns ``out``.

    ``max_query_len``, ``num_reqs`` (default ``len(query_start_loc) - 1``) and ``max_seq_len``
    (default: what ``block_table`` can address) are CPU-known bounds; only they size the grids.
    ``num_splits`` and the tiles override :func:`mla_decode_plan`'s defaults. ``flat_grid``
    (default: :func:`flat_grid_enabled`): a plan of several query tiles launches over the
    step's query tiles (see the module doc); the same results, bit for bit.
    """
    num_heads, rank, rope = _check_decode(q_latent, q_pe, cache, out, lse)
    assert q_latent.dtype == q_pe.dtype == cache.dtype, "q_latent, q_pe and cache dtypes differ"
    assert q_latent.stride(2) == 1 and q_pe.stride(2) == 1, "q rows must be contiguous"
    assert cache.stride(2) == 1 and out.stride(2) == 1, "cache and out rows must be contiguous"
    assert block_table.dtype in (torch.int32, torch.int64), "block_table must be integer"
    num_reqs = query_start_loc.shape[0] - 1 if num_reqs is None else num_reqs
    assert num_reqs < 65536, "num_reqs is a grid dimension: at most 65535 requests per launch"
    num_tokens, block_size = q_latent.shape[0], cache.shape[1]
    if max_seq_len is None:
        max_seq_len = block_table.shape[1] * block_size
    on_gpu = q_latent.is_cuda
    plan = mla_decode_plan(
        num_heads=num_heads, kv_lora_rank=rank, max_query_len=max_query_len,
        max_seq_len=max_seq_len, num_reqs=num_reqs, on_gpu=on_gpu,
        elem_size=cache.element_size(), num_sms=sm_count(q_latent.device) if on_gpu else 8,
        block_h=block_h, block_q=block_q, block_n=block_n, num_splits=num_splits,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_tokens == 0 or num_reqs == 0 or max_query_len <= 0:
        return out
    splits = plan.num_splits
    dev = q_latent.device
    if splits > 1:
        part_m = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=dev)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((num_tokens, num_heads, splits, rank), dtype=torch.float32,
                               device=dev)  # fmt: skip
    else:
        part_m = part_l = part_acc = out  # unused
    lse_t = lse if lse is not None else out  # unused when HAS_LSE is False
    lse_strides = (lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)
    common = {"NUM_HEADS": num_heads, "RANK": rank, "HAS_LSE": lse is not None}
    flat = plan.num_q_tiles > 1 and (flat_grid if flat_grid is not None
                                     else flat_grid_enabled())
    if flat:
        grid = (plan.num_h_tiles * splits, num_tokens // plan.block_q + num_reqs, 1)
        assert grid[1] < 65536, "the flat grid's tiles are a grid dimension: at most 65535"
    else:
        grid = (plan.num_h_tiles * splits, plan.num_q_tiles, num_reqs)
    _mla_decode_kernel[grid](
        q_latent, q_pe, cache, out, lse_t, part_m, part_l, part_acc,
        query_start_loc, seq_lens, block_table,
        sm_scale * _LOG2E,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1),
        out.stride(0), out.stride(1), *lse_strides,
        cache.stride(0), cache.stride(1), block_table.stride(0), splits, num_reqs,
        ROPE=rope, RANK_P2=max(16, next_power_of_2(rank)),
        ROPE_P2=max(16, next_power_of_2(rope)),
        BLOCK_H=plan.block_h, BLOCK_Q=plan.block_q, BLOCK_N=plan.block_n,
        KV_BLOCK_SIZE=block_size, USE_SPLITS=splits > 1,
        # fp32 caches on GPU: 3xTF32 tensor-core dots (about fp32 accurate); interpreter: exact.
        DOT_FP32=(not on_gpu) or cache.dtype == torch.float32,
        FP32_PRECISION="tf32x3" if on_gpu else "ieee",
        FLAT=flat, REQ_BLOCK=256 if on_gpu else 16,  # requests per load of the flat search
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
        **common,
    )  # fmt: skip
    if splits > 1:
        cgrid = (num_tokens, cdiv(num_heads, plan.combine_h),
                 cdiv(rank, plan.combine_r))  # fmt: skip
        _mla_combine_kernel[cgrid](
            part_m, part_l, part_acc, out, lse_t, query_start_loc, num_reqs,
            out.stride(0), out.stride(1), *lse_strides, splits,
            SPLITS_P2=next_power_of_2(splits),
            COMBINE_H=plan.combine_h, COMBINE_R=plan.combine_r,
            num_warps=4 if on_gpu else 1,
            **common,
        )  # fmt: skip
    return out


def mla_decode_attention(
    q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, sm_scale: float,
    out: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """Absorbed MLA attention over the paged latent cache: Triton (see :func:`use_triton`) or
    the reference; keyword options as :func:`mla_decode_attention_triton`."""
    fn = mla_decode_attention_triton if use_triton(q_latent) else mla_decode_attention_ref
    return fn(q_latent, q_pe, cache, block_table, seq_lens, query_start_loc, max_query_len,
              sm_scale, out, **kwargs)  # fmt: skip
