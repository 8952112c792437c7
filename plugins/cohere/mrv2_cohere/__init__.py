"""mrv2 model plugin for Cohere's Command models (Command R / R+, Command R7B / A). Exports
resolve lazily: importing this is cheap."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_cohere.model import Cohere2ForCausalLM, CohereForCausalLM

__all__ = ["Cohere2ForCausalLM", "CohereForCausalLM"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("mrv2_cohere.model"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
