"""Draft-model speculation: any registered model with the target's vocabulary drafts for it
(``speculative_config={"method": "draft_model", "model": DIR, "num_speculative_tokens": k}``).

The drafter keeps a KV cache of its own (its layers are cache layers numbered after the
target's, in the same blocks: one block table serves both). After each target step:

1. **Catch-up**: the draft model runs over the step's tokens with the target's own attention
   metadata, so its cache covers every position the target computed (prompt chunks, the
   accepted drafts; a rejected draft's entry is overwritten later, as the target's is).
2. **Drafting**: ``k`` one-token steps per request that sampled. Step ``j`` feeds the token at
   position ``n - 1 + j`` (``n``: the request's token count after this step, so step 0 feeds
   the token just sampled) and writes its draft at position ``n + j`` of the state table's token
   row, where the next step reads it. Drafts are drawn as the target draws its tokens: the
   argmax for greedy requests, else Gumbel-max with the request's seed and the draft's position
   over the draft model's logits divided by the request's temperature (the same noise as the
   target's sample there). A target drafting for itself therefore has every draft accepted.

Everything is device work: positions, slots and sequence lengths come from the state table on
the device; the host only bounds the longest sequence. The scheduler reserves
:attr:`num_lookahead_tokens` slots past each step for the drafting steps' KV.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from mrv2.contract.attention import AttentionMetadata
from mrv2.contract.batch import InputBatch
from mrv2.contract.forward_context import ForwardContext, set_forward_context
from mrv2.contract.kv_cache import KVCacheSpec, layer_specs
from mrv2.contract.request_state import request_state_layers
from mrv2.contract.speculator import Speculator, SpeculatorInputs, StepSamples
from mrv2.contract.state_table import RequestStateTable
from mrv2.layers.rotary import context_limit
from mrv2.model_loader.build import text_config_of
from mrv2.spec_decode.drafting import DraftSteps

if TYPE_CHECKING:
    from mrv2.config import EngineConfig
    from mrv2.contract.model_state import ModelState


class DraftModelSpeculator(Speculator):
    """``{"method": "draft_model", "model": DIR, "num_speculative_tokens": k}``: the checkpoint
    in ``DIR`` (any registered architecture, the target's vocabulary size) drafts ``k`` tokens
    per step. The draft model is loaded by :meth:`build` (it needs the model registry)."""

    cuda_graphs = True

    def __init__(self, config: EngineConfig, model_state: ModelState,
                 device: torch.device) -> None:
        super().__init__(config, model_state, device)
        if not config.speculative.model:
            raise ValueError("speculative_config.model: method 'draft_model' needs the draft "
                             "checkpoint directory")
        self.num_lookahead_tokens = self.num_speculative_tokens
        # Probabilistic rejection needs drafts independent of the target's noise, with a known
        # q: argmax drafts are deterministic, a one-hot q (what the verifier assumes).
        self.argmax_drafts = config.speculative.rejection_sample_method == "probabilistic"
        self.model: Any = None
        self.first_layer = 0
        self.block_size = model_state.block_size

    def build(self, registries: Any) -> None:
        """Load the draft model (the target's dtype and device, the engine's load format) and
        check it can draft for the target."""
        from mrv2.model_loader.build import build_model, load_hf_config

        path = cast(str, self.config.speculative.model)
        hf_config = load_hf_config(path)
        target = text_config_of(self.model_state.hf_config)
        target_vocab = int(target.vocab_size)
        if int(getattr(hf_config, "vocab_size", -1)) != target_vocab:
            raise ValueError(
                f"speculative_config.model: the draft model's vocab_size "
                f"({getattr(hf_config, 'vocab_size', None)}) must equal the target's "
                f"({target_vocab}): drafts are token ids of the target's vocabulary"
            )
        # (the draft runs at every position the target does: its rotary table must reach them;
        # both lengths are max_position_embeddings, or longer by RoPE scaling: context_limit)
        draft_len, why = context_limit(text_config_of(hf_config))
        max_model_len = self.config.model.fixed_max_model_len or context_limit(target)[0]
        if draft_len is not None and max_model_len is not None and draft_len < max_model_len:
            raise ValueError(
                f"speculative_config.model: the draft model's max_position_embeddings "
                f"({text_config_of(hf_config).max_position_embeddings}) is below max_model_len "
                f"({max_model_len}): it must reach every position the target does (its "
                f"limit: {why}); set max_model_len to at most {draft_len}"
            )
        dtype = next(self.model_state.model.parameters()).dtype
        self.model, _ = build_model(self.config, path, hf_config, registries, self.device, dtype)
        if request_state_layers(self.model):
            raise ValueError(
                f"speculative_config.model: the draft model ({type(self.model).__name__}) keeps "
                "per-request recurrent state (linear-attention or Mamba layers); a draft model "
                "must be attention-only (the target may keep such state)")

    def kv_cache_specs(self, first_layer_idx: int) -> dict[int, KVCacheSpec]:
        """The draft model's cache layers, renumbered from ``first_layer_idx``."""
        assert self.model is not None, "build() first"
        self.first_layer = first_layer_idx
        return {first_layer_idx + i: spec
                for i, spec in sorted(layer_specs(self.model).items())}

    def _context(self, metadata: AttentionMetadata) -> ForwardContext:
        first = self.first_layer
        return ForwardContext(metadata, self.kv_caches[first:], self.kv_backends[first:])

    def propose(
        self, batch: InputBatch, samples: StepSamples, inputs: SpeculatorInputs,
        table: RequestStateTable,
    ) -> None:
        model = self.model
        num_tokens = batch.num_tokens_padded
        with set_forward_context(self._context(self.model_state.prepare_attn(batch))):
            model(batch.input_ids[:num_tokens], batch.positions[:num_tokens])  # catch-up

        steps = DraftSteps(batch, table, samples.num_sampled, self.block_size,
                           self.num_speculative_tokens)
        for j in range(self.num_speculative_tokens):
            pos, valid = steps.positions(j)  # j = 0: the token just sampled
            with set_forward_context(self._context(steps.metadata(pos, valid))):
                hidden = model(steps.tokens_at(pos), pos)
            drafts = steps.draw(model.compute_logits(hidden), pos + 1, self.sampling,
                                self.argmax_drafts)
            steps.write(pos + 1, drafts, valid)
