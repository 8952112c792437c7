"""mrv2 model plugin for the Phi family (phi-1 / 1.5 / 2, Phi-3 / Phi-4, Phi-3.5-MoE). Exports
resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_phi.model import Phi3ForCausalLM
    from mrv2_phi.phi import PhiForCausalLM
    from mrv2_phi.phimoe import PhiMoEForCausalLM, PhimoeForCausalLM

__all__ = ["PhiForCausalLM", "Phi3ForCausalLM", "PhiMoEForCausalLM", "PhimoeForCausalLM"]


def __getattr__(name: str) -> Any:
    if name == "PhiForCausalLM":
        from mrv2_phi.phi import PhiForCausalLM

        return PhiForCausalLM
    if name == "Phi3ForCausalLM":
        from mrv2_phi.model import Phi3ForCausalLM

        return Phi3ForCausalLM
    if name in ("PhiMoEForCausalLM", "PhimoeForCausalLM"):
        from mrv2_phi import phimoe

        return getattr(phimoe, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
