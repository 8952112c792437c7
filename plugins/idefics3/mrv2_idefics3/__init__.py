"""mrv2 model plugin for Idefics3's vision-language checkpoints (Idefics3-8B-Llama3, SmolVLM /
SmolVLM2; transformers' format). Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_idefics3.model import (
        Idefics3ForConditionalGeneration,
        SmolVLMForConditionalGeneration,
    )

__all__ = ["Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mrv2_idefics3 import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
