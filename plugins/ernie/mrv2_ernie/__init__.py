"""mrv2 model plugin for ERNIE 4.5. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_ernie.model import Ernie4_5_MoeForCausalLM, Ernie4_5ForCausalLM

__all__ = ["Ernie4_5ForCausalLM", "Ernie4_5_MoeForCausalLM"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mrv2_ernie import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
