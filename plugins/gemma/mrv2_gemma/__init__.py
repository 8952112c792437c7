"""mrv2 model plugin for the Gemma family. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_gemma.gemma3n import Gemma3nForCausalLM, Gemma3nForConditionalGeneration
    from mrv2_gemma.gemma4 import Gemma4ForCausalLM
    from mrv2_gemma.gemma4_vl import Gemma4ForConditionalGeneration
    from mrv2_gemma.model import Gemma2ForCausalLM, Gemma3ForCausalLM
    from mrv2_gemma.vl import Gemma3ForConditionalGeneration

__all__ = ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
           "Gemma3nForCausalLM", "Gemma3nForConditionalGeneration", "Gemma4ForCausalLM",
           "Gemma4ForConditionalGeneration"]


def __getattr__(name: str) -> Any:
    if name.startswith("Gemma3n"):
        from mrv2_gemma import gemma3n

        return getattr(gemma3n, name)
    if name == "Gemma4ForCausalLM":
        from mrv2_gemma import gemma4

        return gemma4.Gemma4ForCausalLM
    if name == "Gemma4ForConditionalGeneration":
        from mrv2_gemma import gemma4_vl

        return gemma4_vl.Gemma4ForConditionalGeneration
    if name == "Gemma3ForConditionalGeneration":
        from mrv2_gemma import vl

        return vl.Gemma3ForConditionalGeneration
    if name in __all__:
        from mrv2_gemma import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
