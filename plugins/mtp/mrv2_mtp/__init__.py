"""MTP speculative decoding for mrv2: drives a target family's multi-token-prediction layers
(GLM-4.x today) as the drafter. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_mtp.speculator import MTPSpeculator

__all__ = ["MTPSpeculator"]


def __getattr__(name: str) -> Any:
    if name == "MTPSpeculator":
        from mrv2_mtp.speculator import MTPSpeculator

        return MTPSpeculator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
