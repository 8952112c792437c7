"""mrv2 model plugin for OLMo 1, OLMo 2, OLMo 3, OLMoE, FlexOlmo and the OLMo hybrid. Exports
resolve lazily: importing this is cheap."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_olmo.model import Olmo2ForCausalLM, Olmo3ForCausalLM, OlmoForCausalLM
    from mrv2_olmo.olmo_hybrid import OlmoHybridForCausalLM
    from mrv2_olmo.olmoe import FlexOlmoForCausalLM, OlmoeForCausalLM

__all__ = ["FlexOlmoForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "OlmoForCausalLM",
           "OlmoHybridForCausalLM", "OlmoeForCausalLM"]

_MODULES = {"OlmoForCausalLM": "mrv2_olmo.model", "Olmo2ForCausalLM": "mrv2_olmo.model",
            "Olmo3ForCausalLM": "mrv2_olmo.model", "OlmoeForCausalLM": "mrv2_olmo.olmoe",
            "FlexOlmoForCausalLM": "mrv2_olmo.olmoe",
            "OlmoHybridForCausalLM": "mrv2_olmo.olmo_hybrid"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
