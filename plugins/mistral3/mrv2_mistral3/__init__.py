"""mrv2 model plugin for Mistral 3's vision-language checkpoints (Mistral Small 3.1 / 3.2).
Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_mistral3.model import Mistral3ForConditionalGeneration

__all__ = ["Mistral3ForConditionalGeneration"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mrv2_mistral3 import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
