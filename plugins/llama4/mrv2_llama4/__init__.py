"""mrv2 model plugin for Llama 4: its text model, and the images of its multimodal
checkpoints. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_llama4.model import Llama4ForCausalLM, Llama4ForConditionalGeneration

__all__ = ["Llama4ForCausalLM", "Llama4ForConditionalGeneration"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mrv2_llama4 import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
