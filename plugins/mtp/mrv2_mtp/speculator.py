"""MTP speculation: the target checkpoint's multi-token-prediction layers draft for it.

A family with MTP layers (GLM-4.x: ``mrv2_glm.Glm4MoeForCausalLM``; DeepSeek-V3:
``mrv2_deepseek.DeepseekV3ForCausalLM``) gives its model a
``build_mtp(first_layer_idx)`` method returning a module with ``forward(input_ids, positions,
previous_hidden_states, step)``, ``compute_logits(hidden, step)``, ``kv_cache_specs()`` and
``load_weights`` (the checkpoint's MTP tensors), its attention caching in layers numbered from
``first_layer_idx``. The contract it expects (``mrv2.layers.mtp``): row ``j`` takes the target's
final hidden state at position ``p``, the token at ``p + 1`` and position ``p``, and predicts
the token at ``p + 2``. After each target step:

1. **Catch-up** over the step's tokens (the target's attention metadata): each token's hidden
   state beside the token that follows it in the state table (the next prompt token, an
   accepted draft, the token just sampled). This fills the MTP cache; the row at position
   ``n - 2`` (``n``: the request's tokens now) predicts the first draft, at ``n``.
2. **Draft steps** ``j = 1 .. k - 1``, one token per request: the previous draft, the previous
   MTP output as the hidden state, position ``n - 2 + j``; its draft goes to ``n + j``.

Drafts are drawn as the target draws (:class:`mrv2.spec_decode.drafting.DraftSteps`): the
argmax for greedy requests, else the target's own noise at the draft's position; the argmax
everywhere under probabilistic rejection (a one-hot ``q``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mrv2.contract.attention import AttentionMetadata
from mrv2.contract.batch import InputBatch
from mrv2.contract.forward_context import ForwardContext, set_forward_context
from mrv2.contract.kv_cache import KVCacheSpec
from mrv2.contract.speculator import Speculator, SpeculatorInputs, StepSamples
from mrv2.contract.state_table import RequestStateTable
from mrv2.spec_decode.drafting import DraftSteps, catch_up_inputs, first_draft_rows

if TYPE_CHECKING:
    from mrv2.config import EngineConfig
    from mrv2.contract.model_state import ModelState


class MTPSpeculator(Speculator):
    """``speculative_config={"method": "mtp", "num_speculative_tokens": k}``: the target's own
    MTP layers draft ``k`` tokens per step (a checkpoint with one MTP layer reuses it for every
    draft, as GLM-4.x and DeepSeek-V3 are run)."""

    needs_hidden_states = True
    cuda_graphs = True

    def __init__(self, config: EngineConfig, model_state: ModelState,
                 device: torch.device) -> None:
        super().__init__(config, model_state, device)
        if not callable(getattr(model_state.model, "build_mtp", None)):
            raise ValueError(
                f"speculative_config.method 'mtp': the target model "
                f"({type(model_state.model).__name__}) has no MTP layers (no build_mtp())"
            )
        self.num_lookahead_tokens = self.num_speculative_tokens
        self.argmax_drafts = config.speculative.rejection_sample_method == "probabilistic"
        self.block_size = model_state.block_size
        self.mtp: Any = None

    def kv_cache_specs(self, first_layer_idx: int) -> dict[int, KVCacheSpec]:
        """Build the MTP module (caching from ``first_layer_idx``), load its weights from the
        target's checkpoint (or draw them, with ``load_format="dummy"``), declare its cache."""
        from mrv2.layers.fp8 import fp8_config_of
        from mrv2.model_loader.build import (
            apply_checkpoint_fp8,
            load_or_draw_weights,
            process_weights_after_loading,
        )

        build_mtp: Any = getattr(self.model_state.model, "build_mtp")  # noqa: B009 (typed Any)
        mtp = build_mtp(first_layer_idx=first_layer_idx)
        model_dir = str(self.config.model.model)
        fp8 = fp8_config_of(self.model_state.hf_config, self.config.model.quantization)
        if fp8 is not None:  # the MTP layers are quantized as the target's layers are
            dtype = next(self.model_state.model.parameters()).dtype
            apply_checkpoint_fp8(mtp, fp8, model_dir, self.config.model.load_format == "dummy",
                                 dtype)
        load_or_draw_weights(mtp, self.config, model_dir)
        mtp.eval()
        process_weights_after_loading(mtp)
        self.mtp = mtp
        return dict(mtp.kv_cache_specs())

    def _context(self, metadata: AttentionMetadata) -> ForwardContext:
        return ForwardContext(metadata, self.kv_caches, self.kv_backends)

    def propose(
        self, batch: InputBatch, samples: StepSamples, inputs: SpeculatorInputs,
        table: RequestStateTable,
    ) -> None:
        mtp, k = self.mtp, self.num_speculative_tokens
        assert inputs.hidden_states is not None, "the MTP drafter reads the target's hidden states"
        positions, following = catch_up_inputs(batch, table)
        with set_forward_context(self._context(self.model_state.prepare_attn(batch))):
            out = mtp(following, positions, inputs.hidden_states[: batch.num_tokens_padded],
                      step=0)

        steps = DraftSteps(batch, table, samples.num_sampled, self.block_size, k)
        hidden = out[first_draft_rows(batch, positions, steps.num_tokens)]
        pos, valid = steps.positions(0)  # pos = n - 1: the draft goes to n
        drafts = steps.draw(mtp.compute_logits(hidden, step=0), pos + 1, self.sampling,
                            self.argmax_drafts)
        steps.write(pos + 1, drafts, valid)
        for j in range(1, k):
            pos, valid = steps.positions(j)  # the previous draft sits at pos
            with set_forward_context(self._context(steps.metadata(pos - 1, valid))):
                hidden = mtp(steps.tokens_at(pos), pos - 1, hidden, step=j)
            drafts = steps.draw(mtp.compute_logits(hidden, step=j), pos + 1, self.sampling,
                                self.argmax_drafts)
            steps.write(pos + 1, drafts, valid)
