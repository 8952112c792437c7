"""mrv2 model plugin for the Gemma family. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_gemma.model import Gemma2ForCausalLM, Gemma3ForCausalLM

__all__ = ["Gemma2ForCausalLM", "Gemma3ForCausalLM"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mrv2_gemma import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
