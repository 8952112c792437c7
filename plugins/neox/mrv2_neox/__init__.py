"""mrv2 model plugin for EleutherAI's GPT-NeoX family (Pythia, GPT-NeoX-20B) and Stability's
StableLM (StableLM-2, StableLM-3B-4E1T, StableCode). Exports resolve lazily: importing this is
cheap."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_neox.model import GPTNeoXForCausalLM, StableLmForCausalLM

__all__ = ["GPTNeoXForCausalLM", "StableLmForCausalLM"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("mrv2_neox.model"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
