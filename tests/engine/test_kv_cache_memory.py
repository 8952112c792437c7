"""The KV cache's tensors: zero-filled, each its own memory; on the CPU they take memory only for
the blocks that get used (an anonymous mapping), so a tiny engine with the default 2 GiB CPU
budget starts without writing 2 GiB."""

from __future__ import annotations

import os

import pytest
import torch

from mrv2.contract.kv_cache import LatentKVSpec, PagedKVSpec, zeroed_cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_zeroed_cache_is_zero_writable_and_unshared(dtype: torch.dtype) -> None:
    a = zeroed_cache((2, 5, 4, 3, 8), dtype, torch.device("cpu"))
    b = zeroed_cache((2, 5, 4, 3, 8), dtype, torch.device("cpu"))
    assert a.shape == (2, 5, 4, 3, 8) and a.dtype == dtype and a.is_contiguous()
    assert (a.float() == 0).all() and (b.float() == 0).all()
    a[1, 2] = 1.5
    assert (a[1, 2].float() == 1.5).all() and (b.float() == 0).all()
    assert a.float().sum() == 1.5 * 4 * 3 * 8
    assert zeroed_cache((0, 4), dtype, torch.device("cpu")).numel() == 0


def test_specs_allocate_zeroed_caches() -> None:
    paged = PagedKVSpec(num_kv_heads=2, head_dim=8).allocate(6, 4, torch.float32,
                                                              torch.device("cpu"))
    latent = LatentKVSpec(latent_dim=12).allocate(6, 4, torch.bfloat16, torch.device("cpu"))
    assert paged.shape == (2, 6, 4, 2, 8) and (paged == 0).all()
    assert latent.shape == (6, 4, 12) and (latent.float() == 0).all()


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_a_large_cpu_cache_takes_memory_only_where_written() -> None:
    """1 GiB allocated, one block written: the process's resident memory grows by far less
    than the cache (``torch.zeros`` would have written all of it: +1,024 MiB)."""
    def resident_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)

    before = resident_mib()
    cache = zeroed_cache((2, 1 << 14, 16, 8, 64), torch.float32, torch.device("cpu"))  # 1 GiB
    cache[:, 7] = 1.0
    assert float(cache[:, 7].sum()) == 2 * 16 * 8 * 64
    assert resident_mib() - before < 256
    del cache
