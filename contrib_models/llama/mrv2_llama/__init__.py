"""mrv2 model plugin for Llama, Mistral and Mixtral (contrib). Exports resolve lazily:
importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_llama.mixtral import MixtralForCausalLM
    from mrv2_llama.model import LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "MixtralForCausalLM"]


def __getattr__(name: str) -> Any:
    if name == "LlamaForCausalLM":
        from mrv2_llama.model import LlamaForCausalLM

        return LlamaForCausalLM
    if name == "MixtralForCausalLM":
        from mrv2_llama.mixtral import MixtralForCausalLM

        return MixtralForCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
