"""Split decode programs that merge their own partials (``fused_combine``: each query tile's
last split program to finish reads every split's partial and writes the output rows; no
combine launch), against the plain reference, on poisoned outputs: decode and spec-decode
sized queries, a request with a query but no key, padding requests and tokens, sinks, several
launches in a row (the arrival counters go back to zero), the combine kernel never launched."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_paged_attention import DEVICE, _check, make_batch

from mrv2_kernels import paged_attention as module
from mrv2_kernels._backend import arrival_counters
from mrv2_kernels.paged_attention import paged_attention, paged_attention_ref


@pytest.mark.parametrize(("reqs", "num_splits", "dtype", "sinks"), [
    ([(1, 77), (1, 1), (1, 40), (0, 0), (1, 0), (1, 17)], 3, torch.float32, False),
    ([(1, 50), (1, 9), (1, 33)], 5, torch.bfloat16, False),
    ([(3, 40), (2, 2), (3, 21), (0, 0)], 4, torch.float32, False),  # drafts: a tile of rows
    ([(1, 63), (1, 12), (1, 30)], 4, torch.float32, True),  # split 0 carries the sink
])
def test_fused_combine_matches_the_reference(reqs: list[tuple[int, int]], num_splits: int,
                                             dtype: torch.dtype, sinks: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    combines: list[int] = []
    kernel = module._combine_splits_kernel

    class Counted:  # the combine kernel, its launches counted
        def __getitem__(self, grid: Any) -> Any:
            combines.append(1)
            return kernel[grid]

    monkeypatch.setattr(module, "_combine_splits_kernel", Counted())
    b = make_batch(reqs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=dtype,
                   pad_tokens=2, seed=len(reqs) + num_splits)
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    extra: dict[str, Any] = {}
    if sinks:
        extra["sinks"] = torch.randn(4, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ref = paged_attention_ref(*args, **b.bounds, **extra)
    counters = arrival_counters(b.query.device, 1)
    assert counters is not None
    for _ in range(2):  # a second launch finds its counters back at zero
        out = paged_attention(*args, **b.bounds, **extra, uniform_decode=True,
                              num_splits=num_splits, fused_combine=True,
                              out=torch.full_like(b.query, float("nan")))
        _check(out, ref, b, dtype)
        assert (out[b.num_real_tokens:] == 0).all()  # padding rows: zeroed by the programs
        assert not counters.any()
    assert combines == []
    # the same batch through the combine kernel: the same values up to rounding
    plain = paged_attention(*args, **b.bounds, **extra, uniform_decode=True,
                            num_splits=num_splits, fused_combine=False)
    assert len(combines) == 1
    torch.testing.assert_close(out.float(), plain.float(), atol=1e-5 if dtype == torch.float32
                               else 1e-2, rtol=1e-5 if dtype == torch.float32 else 1e-2)


def test_fused_combine_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The argument wins; else MRV2_ATTN_FUSED_COMBINE=1 on CUDA only (opt-in until timed)."""
    rule = module.split_combine_fused
    monkeypatch.delenv(module.FUSED_COMBINE_ENV_VAR, raising=False)
    assert not rule(None, True) and not rule(None, False)
    assert rule(True, False) and not rule(False, True)
    monkeypatch.setenv(module.FUSED_COMBINE_ENV_VAR, "1")
    assert rule(None, True) and not rule(None, False) and not rule(False, True)
    monkeypatch.setenv(module.FUSED_COMBINE_ENV_VAR, "0")
    assert not rule(None, True)
