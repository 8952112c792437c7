"""mrv2 model plugin for LLaVA's vision-language checkpoints (transformers' format).
Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_llava.model import LlavaForConditionalGeneration

__all__ = ["LlavaForConditionalGeneration"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mrv2_llava import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
