"""Caches that are views of shared pages (``mrv2.contract.kv_cache.shared_pages``: a block's
stride is its page, larger than the block when a wider layout shares the slot) give the
kernels exactly what a cache of its own gives: paged attention (prefill and split decode
plans, the decode kernel's own RoPE and KV store), the KV write kernel and the CPU paths.
The rest of every page is NaN: a read past the block shows."""

from __future__ import annotations

import os

import pytest
import torch
from test_paged_attention import _fused_rope, _rope_case, make_batch

from mrv2.attention.cpu_paged import gather_slots, scatter_slots
from mrv2.contract.kv_cache import PagedKVSpec, shared_pages
from mrv2_kernels.kv_cache import write_kv_ref, write_kv_triton
from mrv2_kernels.paged_attention import paged_attention

DEVICE = "cuda" if os.environ.get("MRV2_TEST_GPU") and torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


def _paged_copy(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` ``[2, N, B, Hk, D]`` copied into the narrow view of pages shared with a layout
    three times wider, the rest of each page NaN."""
    _, n, size, heads, dim = cache.shape
    narrow, wide = shared_pages([PagedKVSpec(heads, dim), PagedKVSpec(heads, 3 * dim)], n, size,
                                cache.dtype, cache.device)
    wide.fill_(float("nan"))
    narrow.copy_(cache)
    assert not narrow.is_contiguous() and narrow.stride(1) == 3 * size * heads * dim
    return narrow


@pytest.mark.parametrize("decode", [False, True])
def test_paged_attention_over_a_page_view(decode: bool) -> None:
    reqs = [(1, 37), (1, 5), (1, 20)] if decode else [(9, 37), (3, 3), (5, 20)]
    b = make_batch(reqs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                   dtype=torch.float32, pad_tokens=1, seed=3)
    extra = {"uniform_decode": True, "num_splits": 3} if decode else {}
    want = paged_attention(b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale,
                           **b.bounds, **extra)
    got = paged_attention(b.query, _paged_copy(b.kv_cache), b.qsl, b.seq_lens, b.block_table,
                          b.scale, **b.bounds, **extra)
    assert torch.equal(got, want)


def test_decode_rope_stores_into_a_page_view() -> None:
    """The split decode kernel normalizes, rotates and stores the step's keys and values
    itself: into the page view, where a cache of its own gets them."""
    b, r = _rope_case([(1, 37), (1, 1), (1, 20)], torch.float32, True, seed=5)
    num_tokens = b.query.shape[0]
    caches = [b.kv_cache.clone(), _paged_copy(b.kv_cache)]
    outs = [paged_attention(r["q"].reshape(num_tokens, 4, 16), cache, b.qsl, b.seq_lens,
                            b.block_table, b.scale, **b.bounds, uniform_decode=True,
                            num_splits=3, rope=_fused_rope(r)) for cache in caches]
    assert torch.equal(outs[1], outs[0]) and not outs[0].isnan().any()
    assert torch.equal(caches[1], caches[0])


def test_write_kv_and_cpu_paths_into_a_page_view() -> None:
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 6, 4, 2, 8, generator=gen).to(DEVICE)
    key, value = (torch.randn(5, 2, 8, generator=gen).to(DEVICE) for _ in range(2))
    slots = torch.tensor([3, 17, -1, 22, 8], dtype=torch.int64, device=DEVICE)
    want = cache.clone()
    write_kv_ref(key, value, want, slots)
    paged = _paged_copy(cache)
    write_kv_triton(key, value, paged, slots)
    assert torch.equal(paged, want)
    # the torch paths: read and write slots of a page view as of a cache of its own
    rows = torch.tensor([0, 23, 8, 17], dtype=torch.int64, device=DEVICE)
    assert torch.equal(gather_slots(paged, rows), gather_slots(want, rows))
    new = torch.randn(2, 4, 2, 8, generator=gen).to(DEVICE)
    scatter_slots(paged, rows, new)
    scatter_slots(want, rows, new)
    assert torch.equal(paged, want) and torch.equal(gather_slots(paged, rows), new)
