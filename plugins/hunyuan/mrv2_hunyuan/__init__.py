"""mrv2 model plugin for Tencent Hunyuan: the dense models (Hunyuan 0.5B-7B) and the
mixture-of-experts Hunyuan-A13B. Exports resolve lazily: importing this is cheap."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mrv2_hunyuan.model import HunYuanDenseV1ForCausalLM, HunYuanMoEV1ForCausalLM

__all__ = ["HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("mrv2_hunyuan.model"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
