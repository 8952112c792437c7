"""mrv2 model plugin for EXAONE 4 and K-EXAONE. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_exaone.exaone_moe import ExaoneMoeForCausalLM
    from mrv2_exaone.model import Exaone4ForCausalLM

__all__ = ["Exaone4ForCausalLM", "ExaoneMoeForCausalLM"]


def __getattr__(name: str) -> Any:
    if name == "Exaone4ForCausalLM":
        from mrv2_exaone.model import Exaone4ForCausalLM

        return Exaone4ForCausalLM
    if name == "ExaoneMoeForCausalLM":
        from mrv2_exaone.exaone_moe import ExaoneMoeForCausalLM

        return ExaoneMoeForCausalLM
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
