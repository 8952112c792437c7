"""write_kv: the Triton reshape-and-cache kernel against the torch reference, bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

from mrv2_kernels.kv_cache import write_kv_ref, write_kv_triton

DEVICE = "cuda" if os.environ.get("MRV2_TEST_GPU") and torch.cuda.is_available() else "cpu"


def _case(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 100
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].long()
    slots[torch.rand(num_tokens, generator=gen) < 0.3] = -1  # padding tokens: not written
    slots[-1] = -1
    return key.to(DEVICE), value.to(DEVICE), cache.to(DEVICE, dtype), slots.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(2, 16, 4), (3, 8, 16)])
def test_write_kv_matches_ref(
    dtype: torch.dtype, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    key, value, cache, slots = _case(11, num_kv_heads, head_dim, block_size, 6, dtype)
    expected = cache.clone()
    write_kv_ref(key, value, expected, slots)
    got = cache.clone()
    write_kv_triton(key, value, got, slots)
    assert got.dtype == dtype
    assert torch.equal(got, expected)
    # Something was written, and skipped slots kept their old contents.
    assert not torch.equal(got, cache)
    flat = got.view(2, -1, num_kv_heads, head_dim)
    kept = slots[slots >= 0]
    assert torch.equal(flat[0, kept], key[slots >= 0])
    assert torch.equal(flat[1, kept], value[slots >= 0])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[kept] = False
    assert torch.equal(flat[:, untouched], cache.view(2, -1, num_kv_heads, head_dim)[:, untouched])


def test_write_kv_row_split_and_strided_inputs() -> None:
    """Rows split over several programs (block < heads*dim) and K/V as views of a fused QKV."""
    gen = torch.Generator().manual_seed(3)
    num_tokens, num_heads, num_kv_heads, head_dim = 7, 4, 3, 16
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    qkv = qkv.to(DEVICE, torch.bfloat16)
    key = qkv[:, num_heads : num_heads + num_kv_heads]
    value = qkv[:, num_heads + num_kv_heads :]
    assert not key.is_contiguous()
    cache = torch.randn(2, 5, 4, num_kv_heads, head_dim, generator=gen).to(DEVICE, torch.bfloat16)
    slots = torch.tensor([3, -1, 17, 0, 19, -1, 8], dtype=torch.int32, device=DEVICE)
    expected = cache.clone()
    write_kv_ref(key, value, expected, slots)
    got = cache.clone()
    write_kv_triton(key, value, got, slots, block=16)  # 48-element rows: 3 programs per token
    assert torch.equal(got, expected)


def test_write_kv_casts_to_cache_dtype() -> None:
    key, value, _, slots = _case(5, 2, 16, 4, 3, torch.float16, seed=4)
    cache = torch.randn(2, 3, 4, 2, 16).to(DEVICE, torch.float32)
    expected = cache.clone()
    write_kv_ref(key, value, expected, slots)
    got = cache.clone()
    write_kv_triton(key, value, got, slots)
    assert torch.equal(got, expected)


def test_write_kv_all_padding_and_empty() -> None:
    key, value, cache, _ = _case(4, 2, 16, 4, 2, torch.float32)
    got = cache.clone()
    write_kv_triton(key, value, got, torch.full((4,), -1, dtype=torch.int64, device=DEVICE))
    assert torch.equal(got, cache)
    write_kv_triton(key[:0], value[:0], got, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(got, cache)
