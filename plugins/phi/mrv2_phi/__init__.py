"""mrv2 model plugin for the Phi family. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_phi.model import Phi3ForCausalLM

__all__ = ["Phi3ForCausalLM"]


def __getattr__(name: str) -> Any:
    if name == "Phi3ForCausalLM":
        from mrv2_phi.model import Phi3ForCausalLM

        return Phi3ForCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
