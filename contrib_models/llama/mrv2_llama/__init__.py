"""mrv2 model plugin for Llama (contrib). Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_llama.model import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]


def __getattr__(name: str) -> Any:
    if name == "LlamaForCausalLM":
        from mrv2_llama.model import LlamaForCausalLM

        return LlamaForCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
