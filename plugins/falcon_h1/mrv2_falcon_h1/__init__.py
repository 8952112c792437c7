"""mrv2 model plugin for TII's Falcon-H1 checkpoints (``FalconH1ForCausalLM``: attention and a
Mamba-2 mixer side by side in every layer). Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_falcon_h1.model import FalconH1ForCausalLM

__all__ = ["FalconH1ForCausalLM"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mrv2_falcon_h1 import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
