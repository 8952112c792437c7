"""EAGLE speculative decoding for mrv2: EAGLE-1/2 and EAGLE-3 draft heads, as published, draft
for their target. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_eagle.heads import Eagle3Head, EagleHead
    from mrv2_eagle.speculator import Eagle3Speculator, EagleSpeculator

__all__ = ["Eagle3Head", "Eagle3Speculator", "EagleHead", "EagleSpeculator"]

_WHERE = {"EagleHead": "heads", "Eagle3Head": "heads", "EagleSpeculator": "speculator",
          "Eagle3Speculator": "speculator"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"mrv2_eagle.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
