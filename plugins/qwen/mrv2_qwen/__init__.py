"""mrv2 model plugin for the Qwen family. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_qwen.model import Qwen3ForCausalLM

__all__ = ["Qwen3ForCausalLM"]


def __getattr__(name: str) -> Any:
    if name == "Qwen3ForCausalLM":
        from mrv2_qwen.model import Qwen3ForCausalLM

        return Qwen3ForCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
