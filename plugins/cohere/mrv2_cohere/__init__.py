"""mrv2 model plugin for Cohere's Command models (Command R / R+, Command R7B / A, the
Cohere2-MoE models), Aya Vision and Command A Vision. Exports resolve lazily: importing this
is cheap."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_cohere.aya_vision import AyaVisionForConditionalGeneration
    from mrv2_cohere.cohere2_moe import Cohere2MoeForCausalLM
    from mrv2_cohere.cohere2_vision import Cohere2VisionForConditionalGeneration
    from mrv2_cohere.model import Cohere2ForCausalLM, CohereForCausalLM

__all__ = ["AyaVisionForConditionalGeneration", "Cohere2ForCausalLM", "Cohere2MoeForCausalLM",
           "Cohere2VisionForConditionalGeneration", "CohereForCausalLM"]


def __getattr__(name: str) -> Any:
    if name == "AyaVisionForConditionalGeneration":
        return getattr(importlib.import_module("mrv2_cohere.aya_vision"), name)
    if name == "Cohere2VisionForConditionalGeneration":
        return getattr(importlib.import_module("mrv2_cohere.cohere2_vision"), name)
    if name == "Cohere2MoeForCausalLM":
        return getattr(importlib.import_module("mrv2_cohere.cohere2_moe"), name)
    if name in __all__:
        return getattr(importlib.import_module("mrv2_cohere.model"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
