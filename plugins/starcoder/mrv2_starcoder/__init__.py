"""mrv2 model plugin for BigCode's code models (StarCoder2; StarCoder, StarCoderBase,
SantaCoder and their fine-tunes). Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_starcoder.gpt_bigcode import GPTBigCodeForCausalLM
    from mrv2_starcoder.model import Starcoder2ForCausalLM

__all__ = ["GPTBigCodeForCausalLM", "Starcoder2ForCausalLM"]

_MODULES = {"GPTBigCodeForCausalLM": "mrv2_starcoder.gpt_bigcode",
            "Starcoder2ForCausalLM": "mrv2_starcoder.model"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
