"""mrv2 model plugin for the GLM family: GLM-4.5 / 4.6 / 4.7 (``Glm4MoeForCausalLM``) and its
multi-token-prediction layers, the GLM-4 dense models (``GlmForCausalLM``,
``Glm4ForCausalLM``), GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``), GLM-5
(``GlmMoeDsaForCausalLM``) and the vision-language GLM-4.1V
(``Glm4vForConditionalGeneration``) and GLM-4.5V / 4.6V
(``Glm4vMoeForConditionalGeneration``); and Upstage's Solar Open (``SolarOpenForCausalLM``:
GLM-4.5's MoE under Llama's attention). Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_glm.dense import Glm4ForCausalLM, GlmForCausalLM
    from mrv2_glm.dsa import GlmMoeDsaForCausalLM
    from mrv2_glm.glm4v import Glm4vForConditionalGeneration, Glm4vMoeForConditionalGeneration
    from mrv2_glm.lite import Glm4MoeLiteForCausalLM
    from mrv2_glm.model import Glm4MoeForCausalLM
    from mrv2_glm.mtp import Glm4MoeMTP
    from mrv2_glm.solar_open import SolarOpenForCausalLM

__all__ = ["Glm4ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM", "Glm4MoeMTP",
           "Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration",
           "GlmForCausalLM", "GlmMoeDsaForCausalLM", "SolarOpenForCausalLM"]

#: Export -> the module defining it.
_MODULES = {"Glm4MoeForCausalLM": "model", "Glm4MoeMTP": "mtp", "GlmForCausalLM": "dense",
            "Glm4ForCausalLM": "dense", "Glm4MoeLiteForCausalLM": "lite",
            "GlmMoeDsaForCausalLM": "dsa",
            "Glm4vForConditionalGeneration": "glm4v", "Glm4vMoeForConditionalGeneration": "glm4v",
            "SolarOpenForCausalLM": "solar_open"}


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        import importlib

        return getattr(importlib.import_module(f"mrv2_glm.{_MODULES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
