"""Argument checks shared by the kernel modules (shapes and layouts the kernels assume)."""

from __future__ import annotations

import torch


def check_1d(name: str, t: torch.Tensor, min_len: int) -> None:
    """``t`` is 1-D with at least ``min_len`` entries."""
    if t.dim() != 1 or t.shape[0] < min_len:
        raise ValueError(f"{name} must be 1-D with >= {min_len} entries, got {tuple(t.shape)}")


def check_rows(name: str, t: torch.Tensor, min_rows: int = 0, min_cols: int = 0) -> None:
    """``t`` is 2-D, at least ``[min_rows, min_cols]``, and each row is contiguous (the kernels
    step rows by ``stride(0)``)."""
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name} must be 2-D with contiguous rows, got {tuple(t.shape)}")
    if t.shape[0] < min_rows or t.shape[1] < min_cols:
        raise ValueError(f"{name} must be [>= {min_rows}, >= {min_cols}], got {tuple(t.shape)}")
