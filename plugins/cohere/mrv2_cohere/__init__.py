"""mrv2 model plugin for Cohere's Command models (Command R / R+, Command R7B / A) and Aya
Vision. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_cohere.aya_vision import AyaVisionForConditionalGeneration
    from mrv2_cohere.model import Cohere2ForCausalLM, CohereForCausalLM

__all__ = ["AyaVisionForConditionalGeneration", "Cohere2ForCausalLM", "CohereForCausalLM"]


def __getattr__(name: str) -> Any:
    if name == "AyaVisionForConditionalGeneration":
        return getattr(importlib.import_module("mrv2_cohere.aya_vision"), name)
    if name in __all__:
        return getattr(importlib.import_module("mrv2_cohere.model"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
