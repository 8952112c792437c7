"""mrv2 model plugin for DeepSeek-V2 / V2-Lite / V3 / V3.2 (``DeepseekV2ForCausalLM``,
``DeepseekV3ForCausalLM``, ``DeepseekV32ForCausalLM``): the core's multi-head latent attention
(:mod:`mrv2.layers.mla`; V3.2's sparse form: :mod:`mrv2.layers.sparse_mla`) over a latent KV
cache, and MoE; rednote's dots.llm1 (``Dots1ForCausalLM``: V3's MoE under GQA attention),
Arcee's AFMoE (``AfmoeForCausalLM``: V3's router under gated attention) and Tencent's
Youtu-LLM (``YoutuForCausalLM``: MLA with dense MLPs) and Meituan's LongCat-Flash
(``LongcatFlashForCausalLM``: paired MLA sublayers, a shortcut MoE with zero experts).
Exports resolve lazily: importing this is cheap (``MLAAttention`` and ``MLABackend`` are the
core's, re-exported for compatibility)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2.layers.mla import MLAAttention, MLABackend
    from mrv2_deepseek.afmoe import AfmoeForCausalLM
    from mrv2_deepseek.dots1 import Dots1ForCausalLM
    from mrv2_deepseek.longcat import LongcatFlashForCausalLM
    from mrv2_deepseek.model import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    from mrv2_deepseek.v32 import DeepseekV32ForCausalLM
    from mrv2_deepseek.youtu import YoutuForCausalLM

__all__ = ["AfmoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV32ForCausalLM",
           "DeepseekV3ForCausalLM", "Dots1ForCausalLM", "LongcatFlashForCausalLM",
           "MLAAttention", "MLABackend", "YoutuForCausalLM"]


def __getattr__(name: str) -> Any:
    if name in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        from mrv2_deepseek import model

        return getattr(model, name)
    if name == "DeepseekV32ForCausalLM":
        from mrv2_deepseek import v32

        return v32.DeepseekV32ForCausalLM
    if name == "AfmoeForCausalLM":
        from mrv2_deepseek import afmoe

        return afmoe.AfmoeForCausalLM
    if name == "YoutuForCausalLM":
        from mrv2_deepseek import youtu

        return youtu.YoutuForCausalLM
    if name == "Dots1ForCausalLM":
        from mrv2_deepseek import dots1

        return dots1.Dots1ForCausalLM
    if name == "LongcatFlashForCausalLM":
        from mrv2_deepseek import longcat

        return longcat.LongcatFlashForCausalLM
    if name in ("MLAAttention", "MLABackend"):
        from mrv2.layers import mla

        return getattr(mla, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
