"""mrv2 model plugin for the Qwen family. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_qwen.model import Qwen3ForCausalLM
    from mrv2_qwen.qwen3_moe import Qwen3MoeForCausalLM

__all__ = ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM"]


def __getattr__(name: str) -> Any:
    if name == "Qwen3ForCausalLM":
        from mrv2_qwen.model import Qwen3ForCausalLM

        return Qwen3ForCausalLM
    if name == "Qwen3MoeForCausalLM":
        from mrv2_qwen.qwen3_moe import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
