"""Fixtures shared by the kernel tests."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch


def _poisoned_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                    ) -> torch.Tensor:
    return torch.full(shape, float("nan") if dtype.is_floating_point else -1, dtype=dtype,
                      device=device)


@pytest.fixture
def poison(monkeypatch: pytest.MonkeyPatch) -> Callable[[ModuleType], None]:
    """``poison(module)``: every buffer ``module._empty`` allocates for the test starts as NaN
    (integers: -1), so an element a kernel leaves unwritten shows."""
    def apply(module: ModuleType) -> None:
        monkeypatch.setattr(module, "_empty", _poisoned_empty)

    return apply
