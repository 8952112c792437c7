"""mrv2 model plugin for NVIDIA's Nemotron-H hybrid checkpoints (Mamba-2 mixers, attention and
MLP layers). Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_nemotron_h.model import NemotronHForCausalLM
    from mrv2_nemotron_h.nemotron import NemotronForCausalLM

__all__ = ["NemotronForCausalLM", "NemotronHForCausalLM"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        import importlib

        module = "nemotron" if name == "NemotronForCausalLM" else "model"
        return getattr(importlib.import_module(f"mrv2_nemotron_h.{module}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
