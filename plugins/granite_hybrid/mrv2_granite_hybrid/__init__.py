"""mrv2 model plugin for IBM's Granite mixture-of-experts and hybrid Mamba-2 checkpoints:
Granite 3.x MoE (``GraniteMoeForCausalLM``, ``GraniteMoeSharedForCausalLM``,
``GraniteMoeSWAForCausalLM``), Granite 4.0-H
(``GraniteMoeHybridForCausalLM``) and Bamba (``BambaForCausalLM``). Exports resolve lazily:
importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_granite_hybrid.granite_moe import (
        GraniteMoeForCausalLM,
        GraniteMoeSharedForCausalLM,
        GraniteMoeSWAForCausalLM,
    )
    from mrv2_granite_hybrid.model import BambaForCausalLM, GraniteMoeHybridForCausalLM

__all__ = ["BambaForCausalLM", "GraniteMoeForCausalLM", "GraniteMoeHybridForCausalLM",
           "GraniteMoeSWAForCausalLM", "GraniteMoeSharedForCausalLM"]
_MODULES = {"GraniteMoeForCausalLM": "granite_moe", "GraniteMoeSharedForCausalLM": "granite_moe",
            "GraniteMoeSWAForCausalLM": "granite_moe"}


def __getattr__(name: str) -> Any:
    if name in __all__:
        import importlib

        module = importlib.import_module(f"mrv2_granite_hybrid.{_MODULES.get(name, 'model')}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
