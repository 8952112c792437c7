"""mrv2 model plugin for StepFun's Step-3.7 (``Step3p7ForConditionalGeneration``,
stepfun-ai/Step-3.7-Flash): its text decoder (gated grouped-query attention, sliding-window
and full layers with a RoPE each, sigmoid-routed experts with a shared expert) and its images
(a 2-D RoPE vision tower over HF's global view and local crops). Exports resolve lazily:
importing this is cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_step.model import Step3p7ForConditionalGeneration

__all__ = ["Step3p7ForConditionalGeneration"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from mrv2_step import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
