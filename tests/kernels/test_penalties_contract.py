"""The penalty kernel refuses strided parameter columns (it reads row r's value at ptr + r)."""

from __future__ import annotations

import pytest
import torch

from mrv2_kernels.penalties import apply_penalties_triton


def test_strided_parameter_columns_are_refused() -> None:
    logits = torch.randn(2, 16)
    idx = torch.tensor([0, 1], dtype=torch.int32)
    counts = torch.zeros(2, 16, dtype=torch.int32)
    mask = torch.zeros(2, 16, dtype=torch.bool)
    params = torch.rand(2, 3)  # one row per request: each column is strided
    with pytest.raises(ValueError, match="contiguous 1-D"):
        apply_penalties_triton(logits, idx, counts, mask, params[:, 0], params[:, 1],
                               params[:, 2])
