"""n-gram speculation ("prompt lookup"): drafts copied from where the sequence's last tokens
appeared before, found on the device.

After each step, for every request that produced tokens, the kernel looks for the longest
earlier occurrence (``prompt_lookup_min .. prompt_lookup_max`` tokens, the most recent among
equally long ones) of the sequence's last tokens in its own prompt and output, and proposes the
``k`` tokens that followed it (continuing the period when the copy runs into the present). With
no match it proposes the last token repeated; the target rejects what does not fit, so the
drafts only decide speed, never output. Nothing reaches the CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mrv2.contract.batch import InputBatch
from mrv2.contract.speculator import Speculator, SpeculatorInputs, StepSamples
from mrv2.contract.state_table import RequestStateTable
from mrv2_kernels.spec_decode import ngram_propose

if TYPE_CHECKING:
    from mrv2.config import EngineConfig
    from mrv2.contract.model_state import ModelState


class NgramSpeculator(Speculator):
    """``speculative_config={"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` (vLLM's names; the defaults, but
    ``prompt_lookup_min`` above 4 alone makes it the longest match too)."""

    cuda_graphs = True  # one kernel, skipping requests that sampled nothing (padding)

    def __init__(self, config: EngineConfig, model_state: ModelState,
                 device: torch.device) -> None:
        super().__init__(config, model_state, device)
        spec = config.speculative
        # (one bound given alone: the other's default moves to meet it, as vLLM's)
        self.max_n = spec.prompt_lookup_max or max(4, spec.prompt_lookup_min or 0)
        self.min_n = spec.prompt_lookup_min or min(2, self.max_n)
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(
                f"prompt_lookup_min={self.min_n} and prompt_lookup_max={self.max_n}: need "
                "1 <= prompt_lookup_min <= prompt_lookup_max"
            )
        self._found = torch.zeros(config.scheduler.max_num_seqs, dtype=torch.int32,
                                  device=device)

    def propose(
        self, batch: InputBatch, samples: StepSamples, inputs: SpeculatorInputs,
        table: RequestStateTable,
    ) -> None:
        ngram_propose(table.token_ids, table.num_tokens, batch.idx_mapping, samples.num_sampled,
                      batch.num_reqs, self.num_speculative_tokens, self.min_n, self.max_n,
                      self._found[: batch.num_reqs])
