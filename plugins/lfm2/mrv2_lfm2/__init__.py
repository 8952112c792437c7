"""mrv2 model plugin for Liquid AI's LFM2 (``Lfm2ForCausalLM``: LFM2-350M, 700M, 1.2B, 2.6B),
LFM2-MoE (``Lfm2MoeForCausalLM``: LFM2-8B-A1B) and LFM2-VL (``Lfm2VlForConditionalGeneration``:
LFM2-VL-450M, 1.6B, 3B). Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_lfm2.model import Lfm2ForCausalLM
    from mrv2_lfm2.moe import Lfm2MoeForCausalLM
    from mrv2_lfm2.vl import Lfm2VlForConditionalGeneration

__all__ = ["Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Lfm2VlForConditionalGeneration"]


def __getattr__(name: str) -> Any:
    if name == "Lfm2MoeForCausalLM":
        from mrv2_lfm2 import moe

        return moe.Lfm2MoeForCausalLM
    if name == "Lfm2VlForConditionalGeneration":
        from mrv2_lfm2 import vl

        return vl.Lfm2VlForConditionalGeneration
    if name in __all__:
        from mrv2_lfm2 import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
