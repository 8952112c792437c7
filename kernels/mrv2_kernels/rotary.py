"""Rotary position embedding, neox style, for query and key in one launch.

Each head's first ``rotary_dim`` dims are split into halves ``x1 = x[:r/2]``, ``x2 = x[r/2:r]``
and rotated at the token's position ``p`` with ``cos = cos_sin[p, :r/2]``,
``sin = cos_sin[p, r/2:]``::

    out1 = x1 * cos - x2 * sin          # fp32, then cast back to the input dtype
    out2 = x2 * cos + x1 * sin

Dims ``[rotary_dim, head_dim)`` pass through. ``cos_sin`` is the ``[max_position, rotary_dim]``
fp32 table that :class:`mrv2.layers.rotary.RotaryEmbedding` builds (cos half first).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
import triton
import triton.language as tl

from ._backend import default_block, use_triton
from .norm import rms_norm, rms_norm_ref

__all__ = ["rotary_embedding", "rotary_embedding_ref", "rotary_embedding_triton"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
) -> None:
    heads = head0 + tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads < num_heads)[:, None] & (dims < half)[None, :]
    p1 = base_ptr + heads.to(tl.int64)[:, None] * stride_h + dims[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
    if NORM:  # per-head RMSNorm first (rotary_dim == head_dim), with rms_norm's roundings
        dtype = base_ptr.dtype.element_ty
        variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * half)
        r = tl.rsqrt(variance + eps)[:, None]
        w1 = tl.load(w_ptr + dims, mask=dims < half, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + half + dims, mask=dims < half, other=0.0).to(tl.float32)[None, :]
        x1 = (w1 * (x1 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(p1, out1.to(base_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + half, out2.to(base_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr: tl.tensor,
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    cos_sin_ptr: tl.tensor,
    q_w_ptr: tl.tensor,
    k_w_ptr: tl.tensor,
    eps: float,
    cos_sin_stride: int,
    q_stride_t: int,
    q_stride_h: int,
    k_stride_t: int,
    k_stride_h: int,
    num_q_heads: int,
    num_k_heads: int,
    half: int,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr,
) -> None:
    # Grid (tokens, q head blocks + k head blocks): each program rotates BLOCK_HEADS heads of
    # one token, in place, with the token's cos/sin row loaded once.
    tok = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)
    dmask = dims < half
    row = cos_sin_ptr + pos * cos_sin_stride
    cos = tl.load(row + dims, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(row + half + dims, mask=dmask, other=0.0).to(tl.float32)
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_HEADS)
    if hb < num_q_blocks:
        q_row = q_ptr + tok * q_stride_t
        head0 = hb * BLOCK_HEADS
        _rotate_heads(q_row, q_stride_h, head0, num_q_heads, cos, sin, half, q_w_ptr, eps,
                      BLOCK_HEADS, BLOCK_HALF, NORM)
    else:
        k_row = k_ptr + tok * k_stride_t
        head0 = (hb - num_q_blocks) * BLOCK_HEADS
        _rotate_heads(k_row, k_stride_h, head0, num_k_heads, cos, sin, half, k_w_ptr, eps,
                      BLOCK_HEADS, BLOCK_HALF, NORM)


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


def _head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, head_dim: int,
               norm: Callable[..., Any] = rms_norm) -> torch.Tensor:
    """RMSNorm of every ``head_dim`` head of ``x``, shaped like ``x`` (``norm``: the
    dispatcher, or ``rms_norm_ref`` for the reference path)."""
    normed = norm(x.reshape(x.shape[0], -1, head_dim), weight, eps)
    return cast(torch.Tensor, normed).reshape(x.shape)


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
    qk_norm: QKNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch specification of :func:`rotary_embedding` (returns new tensors)."""
    _check(positions, query, key, cos_sin, head_dim, rotary_dim)
    if qk_norm is not None:
        q_w, k_w, eps = qk_norm
        query = _head_norm(query, q_w, eps, head_dim, rms_norm_ref)
        key = _head_norm(key, k_w, eps, head_dim, rms_norm_ref)
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return (
        _rotate_ref(query, cos, sin, head_dim, rotary_dim),
        _rotate_ref(key, cos, sin, head_dim, rotary_dim),
    )


def _heads_view(t: torch.Tensor, head_dim: int, inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(result, view)``: ``view`` is ``result`` as ``[T, H, head_dim]`` with a unit last stride.

    ``result`` is ``t`` itself when rotating in place is asked for and ``t`` has such a view,
    else a contiguous copy of ``t``.
    """
    if inplace and (t.shape[-1] <= 1 or t.stride(-1) == 1):
        try:
            return t, t.view(t.shape[0], -1, head_dim)
        except RuntimeError:
            pass
    copy = t.clone(memory_format=torch.contiguous_format)
    return copy, copy.view(t.shape[0], -1, head_dim)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of :func:`rotary_embedding`: one launch for query and key
    (and their per-head RMSNorm, which needs ``rotary_dim == head_dim``).

    Grid ``(T, cdiv(Hq, block_heads) + cdiv(Hk, block_heads))``; a program rotates
    ``block_heads`` heads of one token. With ``inplace`` (the default) ``query``/``key`` are
    rotated in their own storage and returned as they are (strided views, e.g. slices of a
    fused QKV output, are fine as long as ``head_dim`` is contiguous); a tensor that cannot be
    viewed as ``[T, H, head_dim]`` that way, or every tensor with ``inplace=False``, is copied
    first and the rotated copy returned. Positions must lie in ``[0, cos_sin.shape[0])``
    (not checked on the device).
    """
    _check(positions, query, key, cos_sin, head_dim, rotary_dim)
    if qk_norm is not None and rotary_dim != head_dim:
        raise ValueError("the fused query/key RMSNorm needs rotary_dim == head_dim")
    for t in (query, key, cos_sin):
        if t.dtype not in _KERNEL_DTYPES:
            raise TypeError(f"rotary_embedding_triton takes fp32/bf16/fp16, got {t.dtype}")
    q_out, q3 = _heads_view(query, head_dim, inplace)
    k_out, k3 = _heads_view(key, head_dim, inplace)
    num_tokens, num_q_heads, num_k_heads = q3.shape[0], q3.shape[1], k3.shape[1]
    if num_tokens == 0 or num_q_heads + num_k_heads == 0:
        return q_out, k_out
    if cos_sin.stride(-1) != 1:
        cos_sin = cos_sin.contiguous()
    positions = positions.contiguous()
    half = rotary_dim // 2
    block_half = triton.next_power_of_2(half)
    max_heads = triton.next_power_of_2(max(num_q_heads, num_k_heads))
    bh = default_block(
        q3,
        cuda=min(max_heads, max(1, 1024 // block_half)),
        cpu=max_heads,
        block=block_heads,
    )
    grid = (num_tokens, triton.cdiv(num_q_heads, bh) + triton.cdiv(num_k_heads, bh))
    q_w, k_w, eps = qk_norm if qk_norm is not None else (cos_sin, cos_sin, 0.0)
    _rotary_kernel[grid](
        positions,
        q3,
        k3,
        cos_sin,
        q_w,
        k_w,
        eps,
        cos_sin.stride(0),
        q3.stride(0),
        q3.stride(1),
        k3.stride(0),
        k3.stride(1),
        num_q_heads,
        num_k_heads,
        half,
        BLOCK_HEADS=bh,
        BLOCK_HALF=block_half,
        NORM=qk_norm is not None,
        num_warps=min(4, max(1, bh * block_half // 256)) if q3.is_cuda else 1,
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

    Returns ``(query, key)`` rotated, shaped like the inputs. Runs
    :func:`rotary_embedding_triton` when :func:`use_triton` says so, else
    :func:`rotary_embedding_ref`. **Aliasing**: the Triton path rotates ``query`` and ``key``
    in place (and returns them), the reference path returns new tensors; callers must use the
    returned tensors and treat the inputs as consumed.
    """
    if use_triton(query) and all(t.dtype in _KERNEL_DTYPES for t in (query, key, cos_sin)):
        if qk_norm is not None and (rotary_dim != head_dim or any(
                w.dtype not in _KERNEL_DTYPES or w.dtype != query.dtype for w in qk_norm[:2])):
            q_w, k_w, eps = qk_norm  # not fusable: the norm kernel, then the rotation
            query = _head_norm(query, q_w, eps, head_dim)
            key = _head_norm(key, k_w, eps, head_dim)
            qk_norm = None
        return rotary_embedding_triton(positions, query, key, cos_sin, head_dim, rotary_dim,
                                       qk_norm)
    return rotary_embedding_ref(positions, query, key, cos_sin, head_dim, rotary_dim, qk_norm)
