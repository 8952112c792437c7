"""mrv2 model plugin for gpt-oss. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_gpt_oss.model import GptOssForCausalLM

__all__ = ["GptOssForCausalLM"]


def __getattr__(name: str) -> Any:
    if name == "GptOssForCausalLM":
        from mrv2_gpt_oss.model import GptOssForCausalLM

        return GptOssForCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
