"""mrv2 model plugin for the Mamba families: pure Mamba-2 checkpoints (``Mamba2ForCausalLM``:
Mamba-Codestral-7B, state-spaces mamba2-130m .. 2.7b in transformers format), pure Mamba-1
ones (``MambaForCausalLM``: state-spaces mamba-*-hf; ``FalconMambaForCausalLM``:
Falcon-Mamba-7B), state-space layers only with no KV cache layer, and the Mamba-1 hybrid
``JambaForCausalLM`` (AI21 Jamba: Mamba-1 and attention layers, MoE) and the Mamba-2 hybrid
``Zamba2ForCausalLM`` (Zyphra Zamba2: Mamba-2 layers and shared attention blocks). Exports
resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_mamba.jamba import JambaForCausalLM
    from mrv2_mamba.mamba1 import FalconMambaForCausalLM, MambaForCausalLM
    from mrv2_mamba.model import Mamba2ForCausalLM
    from mrv2_mamba.zamba2 import Zamba2ForCausalLM

__all__ = ["FalconMambaForCausalLM", "JambaForCausalLM", "Mamba2ForCausalLM",
           "MambaForCausalLM", "Zamba2ForCausalLM"]
_MODULES = {"Mamba2ForCausalLM": "model", "MambaForCausalLM": "mamba1",
            "FalconMambaForCausalLM": "mamba1", "JambaForCausalLM": "jamba",
            "Zamba2ForCausalLM": "zamba2"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        import importlib

        return getattr(importlib.import_module(f"mrv2_mamba.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
