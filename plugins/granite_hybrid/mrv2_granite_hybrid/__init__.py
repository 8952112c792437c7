"""mrv2 model plugin for IBM's hybrid Mamba-2 checkpoints: Granite 4.0-H
(``GraniteMoeHybridForCausalLM``) and Bamba (``BambaForCausalLM``). Exports resolve lazily:
importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_granite_hybrid.model import BambaForCausalLM, GraniteMoeHybridForCausalLM

__all__ = ["BambaForCausalLM", "GraniteMoeHybridForCausalLM"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mrv2_granite_hybrid import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
