"""mrv2 model plugin for OLMo 2. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_olmo.model import Olmo2ForCausalLM

__all__ = ["Olmo2ForCausalLM"]


def __getattr__(name: str) -> Any:
    if name == "Olmo2ForCausalLM":
        from mrv2_olmo.model import Olmo2ForCausalLM

        return Olmo2ForCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
