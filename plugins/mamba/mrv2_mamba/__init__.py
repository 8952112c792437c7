"""mrv2 model plugin for pure Mamba-2 checkpoints (``Mamba2ForCausalLM``: Mamba-Codestral-7B,
state-spaces mamba2-130m .. 2.7b in transformers format): state-space layers only, no KV
cache layer. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_mamba.model import Mamba2ForCausalLM

__all__ = ["Mamba2ForCausalLM"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mrv2_mamba import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
