"""The Llama ModelState: the worked example of a private ModelState.

Llama needs nothing beyond the core's decoder-only state, so this subclass only shows where
model-specific behaviour goes; see this package's README for a walk through.
"""

from __future__ import annotations

from typing import Any

from mrv2 import ModelState
from mrv2.contract.batch import InputBatch


class LlamaModelState(ModelState):
    """Token ids and positions in; the default paged attention metadata."""

    def prepare_inputs(self, batch: InputBatch) -> dict[str, Any]:
        """The inputs of ``LlamaForCausalLM.forward``: exactly the default ones."""
        return super().prepare_inputs(batch)
