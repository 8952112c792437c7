"""Reshape-and-cache: store a step's keys/values into the paged KV cache at flat slots.

KV cache layout: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 keys, 1 values).
Token ``t`` goes to block ``slot_mapping[t] // block_size``, offset ``slot_mapping[t] %
block_size``; a negative slot marks a padding token, which is not written. Values are cast to
the cache's dtype (a plain copy when the dtypes agree; :func:`to_cache_dtype`).

**fp8 caches** (``torch.float8_e4m3fn``, ``kv_cache_dtype="fp8"``): a value is saturated to
+-448 and rounded to the nearest e4m3 value, ties to even, with a per-tensor scale of 1.0 (what
vLLM does for ``--kv-cache-dtype fp8`` without calibrated scales); the attention kernels read
it back as the query's dtype. Half the bytes a token, so twice the tokens in the same memory and
half the KV bytes a decode step reads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import FP8_DTYPE, FP8_MAX, cdiv, kv_store_cast, next_power_of_2

#: The cache dtype the writes and the attention kernels take besides the model's own.
FP8_KV_DTYPE = FP8_DTYPE


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a KV cache of ``dtype`` stores it: for an fp8 cache saturated to +-448 and
    rounded to nearest even (the kernels' :func:`~mrv2_kernels._backend.kv_store_cast`, bit
    for bit), else a plain cast."""
    if dtype == FP8_KV_DTYPE:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x if x.dtype == dtype else x.to(dtype)


@triton.jit
def _write_kv_kernel(
    key_ptr: tl.tensor,
    value_ptr: tl.tensor,
    k_cache_ptr: tl.tensor,
    v_cache_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    stride_kt: tl.tensor,
    stride_kh: tl.tensor,
    stride_vt: tl.tensor,
    stride_vh: tl.tensor,
    stride_cb: tl.tensor,
    stride_cs: tl.tensor,
    stride_ch: tl.tensor,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    BLOCK: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
) -> None:
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < ROW
    head = offs // HEAD_DIM
    dim = offs % HEAD_DIM
    blk = slot // KV_BLOCK_SIZE
    dst = blk * stride_cb + (slot % KV_BLOCK_SIZE) * stride_cs + head * stride_ch + dim
    k = tl.load(key_ptr + tok * stride_kt + head * stride_kh + dim, mask=ok)
    v = tl.load(value_ptr + tok * stride_vt + head * stride_vh + dim, mask=ok)
    tl.store(k_cache_ptr + dst, kv_store_cast(k, k_cache_ptr), mask=ok)
    tl.store(v_cache_ptr + dst, kv_store_cast(v, v_cache_ptr), mask=ok)


def _check(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    assert key.dim() == 3 and key.shape == value.shape, (
        f"key/value must both be [T, num_kv_heads, head_dim], got {tuple(key.shape)} and "
        f"{tuple(value.shape)}"
    )
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, (
        "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
        f"got shape {tuple(kv_cache.shape)}"
    )
    assert tuple(kv_cache.shape[3:]) == tuple(key.shape[1:]), (
        f"key heads/dim {tuple(key.shape[1:])} do not match kv_cache {tuple(kv_cache.shape[3:])}"
    )
    assert slot_mapping.dim() == 1 and slot_mapping.shape[0] >= key.shape[0], (
        "slot_mapping must be [T]"
    )


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch reference of :func:`write_kv_triton` (boolean indexing: syncs on GPU)."""
    _check(key, value, kv_cache, slot_mapping)
    num_tokens = key.shape[0]
    block_size = kv_cache.shape[2]
    slots = slot_mapping[:num_tokens].long()
    keep = slots >= 0
    slots = slots[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = to_cache_dtype(key[keep], kv_cache.dtype)
    kv_cache[1, blocks, offsets] = to_cache_dtype(value[keep], kv_cache.dtype)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    block: int | None = None,
) -> None:
    """Store ``key``/``value`` ``[T, num_kv_heads, head_dim]`` at ``slot_mapping`` (skip < 0).

    A program per (token, ``block`` elements of its ``num_kv_heads * head_dim`` row); no host
    sync. ``key``/``value`` may be strided views (e.g. slices of a fused QKV output) as long as
    ``head_dim`` is contiguous.
    """
    _check(key, value, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1, (
        "head_dim must be contiguous"
    )
    row = num_kv_heads * head_dim
    if block is None:
        block = min(next_power_of_2(row), 2048 if key.is_cuda else 4096)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    grid = (num_tokens, cdiv(row, block))
    _write_kv_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        HEAD_DIM=head_dim,
        ROW=row,
        BLOCK=block,
        KV_BLOCK_SIZE=kv_cache.shape[2],
        num_warps=4 if key.is_cuda else 1,
    )


__all__ = ["FP8_KV_DTYPE", "to_cache_dtype", "write_kv_ref", "write_kv_triton"]
