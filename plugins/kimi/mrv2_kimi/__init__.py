"""mrv2 model plugin for Kimi-Linear (``KimiLinearForCausalLM``, moonshotai/Kimi-Linear-48B-A3B):
Kimi Delta Attention layers (the gated delta rule with a per-key-channel decay) interleaved with
multi-head latent attention layers without RoPE, and a DeepSeek-V3-style MoE. Exports resolve
lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_kimi.model import KimiDeltaAttention, KimiLinearForCausalLM

__all__ = ["KimiDeltaAttention", "KimiLinearForCausalLM"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mrv2_kimi import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
