"""mrv2 model plugin for EleutherAI's GPT-NeoX family (Pythia, GPT-NeoX-20B) and GPT-J, and
Stability's StableLM (StableLM-2, StableLM-3B-4E1T, StableCode). Exports resolve lazily:
importing this is cheap."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_neox.gptj import GPTJForCausalLM
    from mrv2_neox.model import GPTNeoXForCausalLM, StableLmForCausalLM

__all__ = ["GPTJForCausalLM", "GPTNeoXForCausalLM", "StableLmForCausalLM"]

_MODULES = {"GPTJForCausalLM": "mrv2_neox.gptj", "GPTNeoXForCausalLM": "mrv2_neox.model",
            "StableLmForCausalLM": "mrv2_neox.model"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return getattr(importlib.import_module(_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
