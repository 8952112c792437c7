"""mrv2 model plugin for the GLM-4.5 / 4.6 / 4.7 family (``Glm4MoeForCausalLM``) and its
multi-token-prediction layers. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_glm.model import Glm4MoeForCausalLM
    from mrv2_glm.mtp import Glm4MoeMTP

__all__ = ["Glm4MoeForCausalLM", "Glm4MoeMTP"]


def __getattr__(name: str) -> Any:
    if name == "Glm4MoeForCausalLM":
        from mrv2_glm.model import Glm4MoeForCausalLM

        return Glm4MoeForCausalLM
    if name == "Glm4MoeMTP":
        from mrv2_glm.mtp import Glm4MoeMTP

        return Glm4MoeMTP
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
