"""Rotary position embedding, neox style, for query and key in one launch.

Each head's first ``rotary_dim`` dims are split into halves ``x1 = x[:r/2]``, ``x2 = x[r/2:r]``
and rotated at the token's position ``p`` with ``cos = cos_sin[p, :r/2]``,
``sin = cos_sin[p, r/2:]``::

    out1 = x1 * cos - x2 * sin          # fp32, then cast back to the input dtype
    out2 = x2 * cos + x1 * sin

Dims ``[rotary_dim, head_dim)`` pass through. ``cos_sin`` is the ``[max_position, rotary_dim]``
fp32 table that :class:`mrv2.layers.rotary.RotaryEmbedding` builds (cos half first).

Optional extras, fused into the same launch: a per-head RMSNorm of query and key before the
rotation (``qk_norm``), and the paged KV-cache write of the step (``kv_write = (value,
kv_cache, slot_mapping)``, the layout of :mod:`mrv2_kernels.kv_cache`): the programs that
rotate key heads also store them, and the same heads of ``value``, at the token's slot, so a
decode layer needs one launch instead of RoPE + :func:`~mrv2_kernels.kv_cache.write_kv_triton`.
The fused write needs ``rotary_dim == head_dim``; otherwise the rotation is followed by the
separate write (same result).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
import triton
import triton.language as tl

from ._backend import (
    cdiv,
    default_block,
    kv_store_cast,
    next_power_of_2,
    pdl,
    pdl_early_meta,
    pdl_prologue,
    pdl_release,
    pdl_wait,
    use_triton,
)
from .kv_cache import FP8_KV_DTYPE, write_kv_ref, write_kv_triton
from .norm import rms_norm, rms_norm_cpu, rms_norm_ref

__all__ = ["KVWrite", "QKNorm", "rotary_embedding", "rotary_embedding_cpu",
           "rotary_embedding_ref", "rotary_embedding_triton"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CACHE_DTYPES = (*_KERNEL_DTYPES, FP8_KV_DTYPE)


@triton.jit
def _norm_rotate(
    p1: tl.tensor,
    mask: tl.tensor,
    half: tl.tensor,
    cos: tl.tensor,
    sin: tl.tensor,
    w1: tl.tensor,
    w2: tl.tensor,
    eps: tl.tensor,
    NORM: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """The rotation of one tile of heads (rows): ``x1`` at ``p1``, ``x2`` at ``p1 + half``
    (``mask``ed), per-head RMS-normalized with the weight halves ``w1``/``w2`` first
    (``NORM``; ``rotary_dim == head_dim``, rms_norm's roundings), then ``x1 cos - x2 sin`` and
    ``x2 cos + x1 sin`` in fp32: the two halves in ``p1``'s dtype. ``cos``/``sin`` broadcast
    over the tile. Shared by the RoPE kernel and the paged-attention kernel's RoPE path, so
    both give the same bits."""
    dtype = p1.dtype.element_ty
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half)
        r = tl.rsqrt(variance + eps)[:, None]
        x1 = (w1 * (x1 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)


@triton.jit
def _rotate_heads(
    base_ptr: tl.tensor,
    stride_h: tl.tensor,
    head0: tl.tensor,
    num_heads: tl.tensor,
    cos: tl.tensor,
    sin: tl.tensor,
    half: tl.tensor,
    w_ptr: tl.tensor,
    eps: tl.tensor,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    heads = head0 + tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (dims < half)[None, :]
    p1 = base_ptr + heads.to(tl.int64)[:, None] * stride_h + dims[None, :]
    if NORM:  # per-head RMSNorm first (rotary_dim == head_dim)
        w1 = tl.load(w_ptr + dims, mask=dims < half, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + dims, mask=dims < half, other=0.0).to(tl.float32)[None, :]
    else:  # unused
        w1 = cos[None, :]
        w2 = w1
    out1, out2 = _norm_rotate(p1, mask, half, cos[None, :], sin[None, :], w1, w2, eps, NORM)
    tl.store(p1, out1, mask=mask)
    tl.store(p1 + half, out2, mask=mask)
    return out1, out2


@triton.jit
def _cache_heads(
    k1: tl.tensor,
    k2: tl.tensor,
    v_row: tl.tensor,
    v_stride_h: tl.tensor,
    k_dst: tl.tensor,
    v_dst: tl.tensor,
    c_stride_h: tl.tensor,
    head0: tl.tensor,
    num_heads: tl.tensor,
    half: tl.tensor,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
) -> None:
    # Store the rotated key halves (as rotated in place, then cast to the cache dtype) and the
    # same heads of value at one slot; k_dst/v_dst point at the slot's row of each cache.
    heads = (head0 + tl.arange(0, BLOCK_HEADS)).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (dims < half)[None, :]
    dst = heads[:, None] * c_stride_h + dims[None, :]
    tl.store(k_dst + dst, kv_store_cast(k1, k_dst), mask=mask)
    tl.store(k_dst + dst + half, kv_store_cast(k2, k_dst), mask=mask)
    pv = v_row + heads[:, None] * v_stride_h + dims[None, :]
    tl.store(v_dst + dst, kv_store_cast(tl.load(pv, mask=mask), v_dst), mask=mask)
    tl.store(v_dst + dst + half, kv_store_cast(tl.load(pv + half, mask=mask), v_dst),
             mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr: tl.tensor,
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    cos_sin_ptr: tl.tensor,
    q_w_ptr: tl.tensor,
    k_w_ptr: tl.tensor,
    v_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    eps: float,
    cos_sin_stride: int,
    q_stride_t: int,
    q_stride_h: int,
    k_stride_t: int,
    k_stride_h: int,
    num_q_heads: int,
    num_k_heads: int,
    half: int,
    v_stride_t: int,
    v_stride_h: int,
    c_stride_b: int,
    c_stride_s: int,
    c_stride_h: int,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr,
    KV_WRITE: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr,
    EARLY_META: tl.constexpr,
) -> None:
    # Grid (tokens, q head blocks + k head blocks): each program rotates BLOCK_HEADS heads of
    # one token, in place, with the token's cos/sin row loaded once. With KV_WRITE a key
    # program also stores its heads of key (rotated) and value at the token's cache slot,
    # unless the slot is negative (padding). EARLY_META (pdl_early_meta): the position, its
    # cos/sin row and the slot are loaded before the wait for the previous kernel.
    if EARLY_META:
        pdl_release(PDL)
    else:
        pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dmask = dims < half
    row = cos_sin_ptr + pos * cos_sin_stride
    cos = tl.load(row + dims, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(row + half + dims, mask=dmask, other=0.0).to(tl.float32)
    if EARLY_META:
        if KV_WRITE:
            early_slot = tl.load(slot_ptr + tok).to(tl.int64)
        pdl_wait(PDL)
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_HEADS)
    if hb < num_q_blocks:
        q_row = q_ptr + tok * q_stride_t
        head0 = hb * BLOCK_HEADS
        _rotate_heads(q_row, q_stride_h, head0, num_q_heads, cos, sin, half, q_w_ptr, eps,
                      BLOCK_HEADS, BLOCK_HALF, NORM)
    else:
        k_row = k_ptr + tok * k_stride_t
        head0 = (hb - num_q_blocks) * BLOCK_HEADS
        k1, k2 = _rotate_heads(k_row, k_stride_h, head0, num_k_heads, cos, sin, half, k_w_ptr,
                               eps, BLOCK_HEADS, BLOCK_HALF, NORM)
        if KV_WRITE:
            if EARLY_META:  # noqa: SIM108  (a static branch: early_slot exists only here)
                slot = early_slot
            else:
                slot = tl.load(slot_ptr + tok).to(tl.int64)
            if slot >= 0:
                off = (slot // KV_BLOCK_SIZE) * c_stride_b + (slot % KV_BLOCK_SIZE) * c_stride_s
                _cache_heads(k1, k2, v_ptr + tok * v_stride_t, v_stride_h, k_cache_ptr + off,
                             v_cache_ptr + off, c_stride_h, head0, num_k_heads, half,
                             BLOCK_HEADS, BLOCK_HALF)


def _rotate_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, rotary_dim: int
) -> torch.Tensor:
    shape = x.shape
    x = x.reshape(shape[0], -1, head_dim)
    half = rotary_dim // 2
    x1 = x[..., :half].float()
    x2 = x[..., half:rotary_dim].float()
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    if rotary_dim < head_dim:
        rotated = torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
    return rotated.reshape(shape)


def _check(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
) -> None:
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even, in (0, head_dim={head_dim}], got {rotary_dim}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != rotary_dim:
        raise ValueError(
            f"cos_sin must be [max_position, {rotary_dim}], got {tuple(cos_sin.shape)}"
        )
    num_tokens = query.shape[0]
    if positions.shape != (num_tokens,) or key.shape[0] != num_tokens:
        raise ValueError(
            f"positions {tuple(positions.shape)}, query {tuple(query.shape)} and key "
            f"{tuple(key.shape)} must share the token count"
        )
    for name, t in (("query", query), ("key", key)):
        if t.dim() not in (2, 3) or math.prod(t.shape[1:]) % head_dim:
            raise ValueError(f"{name} must be [T, H*D] or [T, H, D], got {tuple(t.shape)}")


#: Optional per-head RMSNorm of query and key before the rotation: (q weight, k weight, eps).
QKNorm = tuple[torch.Tensor, torch.Tensor, float]

#: Optional paged KV-cache write of the rotated key and of ``value``: ``(value, kv_cache,
#: slot_mapping)`` as for :func:`mrv2_kernels.kv_cache.write_kv_triton`, with ``value``
#: ``[T, Hk*D]`` or ``[T, Hk, D]``.
KVWrite = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, head_dim: int,
               norm: Callable[..., Any] = rms_norm) -> torch.Tensor:
    """RMSNorm of every ``head_dim`` head of ``x``, shaped like ``x`` (``norm``: the
    dispatcher, or ``rms_norm_ref`` for the reference path)."""
    normed = norm(x.reshape(x.shape[0], -1, head_dim), weight, eps)
    return cast(torch.Tensor, normed).reshape(x.shape)


def _check_kv_write(key: torch.Tensor, kv_write: KVWrite, head_dim: int) -> None:
    value, kv_cache, slot_mapping = kv_write
    num_tokens, num_kv_heads = key.shape[0], math.prod(key.shape[1:]) // head_dim
    if (value.dim() not in (2, 3) or value.shape[0] != num_tokens
            or math.prod(value.shape[1:]) != num_kv_heads * head_dim
            or (value.dim() == 3 and value.shape[2] != head_dim)):
        raise ValueError(
            f"kv_write value must be [T, Hk*D] or [T, Hk, D] like key (T={num_tokens}, "
            f"Hk={num_kv_heads}, D={head_dim}), got {tuple(value.shape)}"
        )
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[3:]) != (
            num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, {num_kv_heads}, {head_dim}] "
            f"(key's heads and head_dim), got {tuple(kv_cache.shape)}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] < num_tokens:
        raise ValueError(
            f"slot_mapping must be 1-D with >= {num_tokens} entries, "
            f"got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")


def _write_kv(key: torch.Tensor, kv_write: KVWrite, head_dim: int,
              write: Callable[..., None]) -> None:
    """The unfused cache write of the (already rotated) ``key``: ``write`` is
    :func:`write_kv_triton` or :func:`write_kv_ref`."""
    value, kv_cache, slot_mapping = kv_write
    write(_heads_view(key, head_dim, True)[1], _heads_view(value, head_dim, True)[1], kv_cache,
          slot_mapping[: key.shape[0]].contiguous())


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
    qk_norm: QKNorm | None = None,
    kv_write: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch specification of :func:`rotary_embedding` (returns new tensors; the
    ``kv_write`` is the rotation followed by :func:`write_kv_ref`)."""
    _check(positions, query, key, cos_sin, head_dim, rotary_dim)
    if kv_write is not None:
        _check_kv_write(key, kv_write, head_dim)
    if qk_norm is not None:
        q_w, k_w, eps = qk_norm
        query = _head_norm(query, q_w, eps, head_dim, rms_norm_ref)
        key = _head_norm(key, k_w, eps, head_dim, rms_norm_ref)
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    query = _rotate_ref(query, cos, sin, head_dim, rotary_dim)
    key = _rotate_ref(key, cos, sin, head_dim, rotary_dim)
    if kv_write is not None:
        _write_kv(key, kv_write, head_dim, write_kv_ref)
    return query, key


def _rotate_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`_rotate_ref` for ``rotary_dim == head_dim``: ``cos``/``sin`` ``[T, 1, 1, D/2]``."""
    shape, dtype = x.shape, x.dtype
    half = cos.shape[-1]
    x4 = x.reshape(shape[0], -1, 2, half)
    if dtype != torch.float32:
        x4 = x4.float()
    out = x4 * cos  # [x1 cos, x2 cos]
    swapped = x4.flip(2).mul_(sin)  # [x2 sin, x1 sin]
    swapped[:, :, 0].neg_()  # a + (-b) is a - b, exactly
    out.add_(swapped)
    return (out if dtype == torch.float32 else out.to(dtype)).view(shape)


def _side_by_side(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """``[query | key]`` as one ``[T, Wq + Wk]`` view when ``key``'s columns directly follow
    ``query``'s in one buffer (the q and k slices of a fused QKV output), else None."""
    if (query.dim() != 2 or key.dim() != 2 or query.dtype != key.dtype
            or query.stride(1) != 1 or key.stride(1) != 1):
        return None
    rows, width = query.shape[0], query.shape[1] + key.shape[1]
    if rows > 1 and (query.stride(0) != key.stride(0) or query.stride(0) < width):
        return None
    if (key.data_ptr() != query.data_ptr() + query.shape[1] * query.element_size()
            or key.untyped_storage().data_ptr() != query.untyped_storage().data_ptr()):
        return None
    return query.as_strided((rows, width), (query.stride(0), 1))


def rotary_embedding_cpu(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
    qk_norm: QKNorm | None = None,
    kv_write: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path of :func:`rotary_embedding` (CPU): :func:`rotary_embedding_ref`'s
    results, bit for bit, in a few ops (one cos/sin gather, no concatenation; one rotation
    for both when ``key`` directly follows ``query`` in a fused QKV output); the reference
    itself for a partial rotation. Returns new tensors (then views of one)."""
    if rotary_dim != head_dim or query.shape[0] == 0:
        return rotary_embedding_ref(positions, query, key, cos_sin, head_dim, rotary_dim,
                                    qk_norm, kv_write)
    _check(positions, query, key, cos_sin, head_dim, rotary_dim)
    if kv_write is not None:
        _check_kv_write(key, kv_write, head_dim)
    if qk_norm is not None:
        q_w, k_w, eps = qk_norm
        query = _head_norm(query, q_w, eps, head_dim, rms_norm_cpu)
        key = _head_norm(key, k_w, eps, head_dim, rms_norm_cpu)
    table = cos_sin.index_select(0, positions).view(-1, 1, 2, rotary_dim // 2)
    cos, sin = table[:, :, :1], table[:, :, 1:]
    both = _side_by_side(query, key) if qk_norm is None else None
    if both is not None:
        rotated = _rotate_cpu(both, cos, sin)
        query, key = rotated[:, : query.shape[1]], rotated[:, query.shape[1] :]
    else:
        query, key = _rotate_cpu(query, cos, sin), _rotate_cpu(key, cos, sin)
    if kv_write is not None:
        _write_kv(key, kv_write, head_dim, write_kv_ref)
    return query, key


def _heads_view(t: torch.Tensor, head_dim: int, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(result, view)``: ``view`` is ``result`` as ``[T, H, head_dim]`` with a unit last stride.

    ``result`` is ``t`` itself when rotating in place is asked for and ``t`` has such a view,
    else a contiguous copy of ``t``.
    """
    shape = (t.shape[0], math.prod(t.shape[1:]) // head_dim, head_dim)  # no -1: T may be 0
    if inplace and (t.shape[-1] <= 1 or t.stride(-1) == 1):
        try:
            return t, t.view(shape)
        except RuntimeError:
            pass
    copy = t.clone(memory_format=torch.contiguous_format)
    return copy, copy.view(shape)


def rotary_embedding_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
    qk_norm: QKNorm | None = None,
    *,
    inplace: bool = True,
    block_heads: int | None = None,
    kv_write: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of :func:`rotary_embedding`: one launch for query and key
    (and their per-head RMSNorm, and the KV-cache write; both need ``rotary_dim == head_dim``).

    Grid ``(T, cdiv(Hq, block_heads) + cdiv(Hk, block_heads))``; a program rotates
    ``block_heads`` heads of one token. With ``inplace`` (the default) ``query``/``key`` are
    rotated in their own storage and returned as they are (strided views, e.g. slices of a
    fused QKV output, are fine as long as ``head_dim`` is contiguous); a tensor that cannot be
    viewed as ``[T, H, head_dim]`` that way, or every tensor with ``inplace=False``, is copied
    first and the rotated copy returned. Positions must lie in ``[0, cos_sin.shape[0])``
    (not checked on the device).

    ``kv_write = (value, kv_cache, slot_mapping)``: a key program also stores its rotated
    heads (exactly the values written back to ``key``, cast to the cache dtype) and the same
    heads of ``value`` at the token's slot of ``kv_cache``; tokens with a negative slot are not
    written. ``value`` must be fp32/bf16/fp16, ``kv_cache`` that or fp8 (e4m3, stored as
    :func:`~mrv2_kernels.kv_cache.to_cache_dtype` does), both with a contiguous ``head_dim``.
    With ``rotary_dim < head_dim`` the rotation is followed by :func:`write_kv_triton`.
    """
    _check(positions, query, key, cos_sin, head_dim, rotary_dim)
    if qk_norm is not None and rotary_dim != head_dim:
        raise ValueError("the fused query/key RMSNorm needs rotary_dim == head_dim")
    if kv_write is not None:
        _check_kv_write(key, kv_write, head_dim)
    for t in (query, key, cos_sin, *(kv_write or ())[:1]):
        if t.dtype not in _KERNEL_DTYPES:
            raise TypeError(f"rotary_embedding_triton takes fp32/bf16/fp16, got {t.dtype}")
    if kv_write is not None and kv_write[1].dtype not in _CACHE_DTYPES:
        raise TypeError(f"rotary_embedding_triton writes fp32/bf16/fp16/fp8 (e4m3) caches, got "
                        f"{kv_write[1].dtype}")
    if kv_write is not None:
        if kv_write[1].stride(-1) != 1:
            raise ValueError("kv_cache must have a contiguous head_dim")
        if rotary_dim != head_dim:  # dims past rotary_dim are not loaded: write separately
            q_out, k_out = rotary_embedding_triton(positions, query, key, cos_sin, head_dim,
                                                   rotary_dim, qk_norm, inplace=inplace,
                                                   block_heads=block_heads)
            _write_kv(k_out, kv_write, head_dim, write_kv_triton)
            return q_out, k_out
    q_out, q3 = _heads_view(query, head_dim, inplace)
    k_out, k3 = _heads_view(key, head_dim, inplace)
    num_tokens, num_q_heads, num_k_heads = q3.shape[0], q3.shape[1], k3.shape[1]
    if num_tokens == 0 or num_q_heads + num_k_heads == 0:
        return q_out, k_out
    if cos_sin.stride(-1) != 1:
        cos_sin = cos_sin.contiguous()
    positions = positions.contiguous()
    half = rotary_dim // 2
    block_half = next_power_of_2(half)
    max_heads = next_power_of_2(max(num_q_heads, num_k_heads))
    bh = default_block(
        q3,
        cuda=min(max_heads, max(1, 1024 // block_half)),
        cpu=max_heads,
        block=block_heads,
    )
    grid = (num_tokens, cdiv(num_q_heads, bh) + cdiv(num_k_heads, bh))
    q_w, k_w, eps = qk_norm if qk_norm is not None else (cos_sin, cos_sin, 0.0)
    if kv_write is not None:
        v3 = _heads_view(kv_write[0], head_dim, True)[1]
        kv_cache, slots = kv_write[1], kv_write[2][:num_tokens].contiguous()
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        v_strides, c_strides = v3.stride()[:2], k_cache.stride()[:3]
        kv_block_size = kv_cache.shape[2]
    else:  # unused placeholders
        v3, k_cache, v_cache, slots = k3, k3, k3, positions
        v_strides, c_strides, kv_block_size = (0, 0), (0, 0, 0), 1
    _rotary_kernel[grid](
        positions,
        q3,
        k3,
        cos_sin,
        q_w,
        k_w,
        v3,
        k_cache,
        v_cache,
        slots,
        eps,
        cos_sin.stride(0),
        q3.stride(0),
        q3.stride(1),
        k3.stride(0),
        k3.stride(1),
        num_q_heads,
        num_k_heads,
        half,
        *v_strides,
        *c_strides,
        BLOCK_HEADS=bh,
        BLOCK_HALF=block_half,
        NORM=qk_norm is not None,
        KV_WRITE=kv_write is not None,
        KV_BLOCK_SIZE=kv_block_size,
        num_warps=min(4, max(1, bh * block_half // 256)) if q3.is_cuda else 1,
        EARLY_META=pdl_early_meta(q3),
        **pdl(q3),
    )
    return q_out, k_out


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
    qk_norm: QKNorm | None = None,
    kv_write: KVWrite | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE of ``query`` ``[T, Hq*D]`` (or ``[T, Hq, D]``) and ``key`` at ``positions``.

    Args:
        positions: ``[T]`` int (int64 or int32), rows of ``cos_sin``.
        query, key: ``[T, H*head_dim]`` or ``[T, H, head_dim]``, fp32/bf16/fp16; the rotation is
            computed in fp32 and cast back to each tensor's dtype.
        cos_sin: ``[max_position, rotary_dim]`` fp32, ``[cos | sin]`` per position.
        head_dim: size of one head.
        rotary_dim: even, ``<= head_dim``; the dims past it are passed through.
        qk_norm: optional ``(q_weight, k_weight, eps)``: RMSNorm each head of ``query`` /
            ``key`` first (Qwen3's q_norm / k_norm), exactly as
            :func:`mrv2_kernels.norm.rms_norm` would, in the same launch when
            ``rotary_dim == head_dim``.
        kv_write: optional ``(value, kv_cache, slot_mapping)``: also store the rotated ``key``
            and ``value`` (``[T, Hk*D]`` or ``[T, Hk, D]``, may be a strided view with a
            contiguous ``head_dim``) into the paged ``kv_cache``
            ``[2, num_blocks, block_size, Hk, head_dim]`` at ``slot_mapping[:T]`` (negative:
            padding, not written), cast to the cache dtype, exactly as
            :func:`mrv2_kernels.kv_cache.write_kv_triton` after the rotation would; in the
            same launch when ``rotary_dim == head_dim`` and the cache is fp32/bf16/fp16.

    Returns ``(query, key)`` rotated, shaped like the inputs. Runs
    :func:`rotary_embedding_triton` when :func:`use_triton` says so, else
    :func:`rotary_embedding_cpu` (the reference's results). **Aliasing**: the Triton path
    rotates ``query`` and ``key`` in place (and returns them), the torch paths return new
    tensors; callers must use the returned tensors and treat the inputs as consumed.
    """
    if use_triton(query) and all(t.dtype in _KERNEL_DTYPES for t in (query, key, cos_sin)):
        if qk_norm is not None and (rotary_dim != head_dim or any(
                w.dtype not in _KERNEL_DTYPES or w.dtype != query.dtype for w in qk_norm[:2])):
            q_w, k_w, eps = qk_norm  # not fusable: the norm kernel, then the rotation
            query = _head_norm(query, q_w, eps, head_dim)
            key = _head_norm(key, k_w, eps, head_dim)
            qk_norm = None
        if kv_write is not None and (kv_write[0].dtype not in _KERNEL_DTYPES
                                     or kv_write[1].dtype not in _CACHE_DTYPES):
            _check_kv_write(key, kv_write, head_dim)  # not fusable: rotate, then write
            query, key = rotary_embedding_triton(positions, query, key, cos_sin, head_dim,
                                                 rotary_dim, qk_norm)
            _write_kv(key, kv_write, head_dim, write_kv_triton)
            return query, key
        return rotary_embedding_triton(positions, query, key, cos_sin, head_dim, rotary_dim,
                                       qk_norm, kv_write=kv_write)
    return rotary_embedding_cpu(positions, query, key, cos_sin, head_dim, rotary_dim, qk_norm,
                                kv_write)
