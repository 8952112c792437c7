"""mrv2 model plugin for MiniMax-M2 and MiniMax-Text-01 / MiniMax-M1. Exports resolve lazily:
importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_minimax.model import MiniMaxM2ForCausalLM
    from mrv2_minimax.text01 import MiniMaxForCausalLM

__all__ = ["MiniMaxForCausalLM", "MiniMaxM2ForCausalLM"]


def __getattr__(name: str) -> Any:
    if name == "MiniMaxM2ForCausalLM":
        from mrv2_minimax.model import MiniMaxM2ForCausalLM

        return MiniMaxM2ForCausalLM
    if name == "MiniMaxForCausalLM":
        from mrv2_minimax.text01 import MiniMaxForCausalLM

        return MiniMaxForCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
