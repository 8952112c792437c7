"""mrv2 model plugin for the Gemma family. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_gemma.model import Gemma3ForCausalLM

__all__ = ["Gemma3ForCausalLM"]


def __getattr__(name: str) -> Any:
    if name == "Gemma3ForCausalLM":
        from mrv2_gemma.model import Gemma3ForCausalLM

        return Gemma3ForCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
