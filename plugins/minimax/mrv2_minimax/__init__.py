"""mrv2 model plugin for MiniMax-M2. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_minimax.model import MiniMaxM2ForCausalLM

__all__ = ["MiniMaxM2ForCausalLM"]


def __getattr__(name: str) -> Any:
    if name == "MiniMaxM2ForCausalLM":
        from mrv2_minimax.model import MiniMaxM2ForCausalLM

        return MiniMaxM2ForCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
