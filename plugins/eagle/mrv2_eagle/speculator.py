"""EAGLE speculation: a small head trained on the target's hidden states drafts for it.

``speculative_config={"method": "eagle" | "eagle3", "model": HEAD_DIR,
"num_speculative_tokens": k}`` (vLLM's names). ``HEAD_DIR`` holds the head as published:
``config.json`` and its tensors (:mod:`mrv2_eagle.heads` says which). The head caches its
attention in layers numbered after the target's, in the same blocks. After each target step:

1. **Catch-up** over the step's tokens (the target's attention metadata,
   :func:`mrv2.spec_decode.drafting.catch_up_inputs`): each token's hidden state beside the
   token after it. EAGLE takes the target's final hidden states; EAGLE-3 the residual stream
   at the input of three target layers (kept by the target's ``DecoderModel``,
   :meth:`keep_aux_hidden_states`), fused by the head's ``fc``. This fills the head's cache;
   the row at position ``n - 2`` (``n``: the request's tokens now) predicts the first draft,
   at ``n``.
2. **Draft steps** ``j = 1 .. k - 1``, one token per request: the previous draft, the head's
   own previous output as the hidden state (EAGLE-3: un-normed, without ``fc``), position
   ``n - 2 + j``; the draft goes to ``n + j``.

Drafts are drawn as the target draws (:class:`mrv2.spec_decode.drafting.DraftSteps`): the
argmax for greedy requests, else the target's own noise at the draft's position over the
head's logits on the target's vocabulary (EAGLE-3's reduced vocabulary scattered through
``d2t``); the argmax everywhere under probabilistic rejection (a one-hot ``q``). ``propose``
is device work of fixed shapes only, so the runner may capture it in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from mrv2.contract.attention import AttentionMetadata
from mrv2.contract.batch import InputBatch
from mrv2.contract.forward_context import ForwardContext, set_forward_context
from mrv2.contract.kv_cache import KVCacheSpec
from mrv2.contract.speculator import Speculator, SpeculatorInputs, StepSamples
from mrv2.contract.state_table import RequestStateTable
from mrv2.layers.rotary import RotaryEmbedding, context_limit
from mrv2.spec_decode.drafting import DraftSteps, catch_up_inputs, first_draft_rows

if TYPE_CHECKING:
    from mrv2.config import EngineConfig
    from mrv2.contract.model_state import ModelState


def _field(config: Any, name: str) -> Any:
    return getattr(config, name, None)


class _EagleBase(Speculator):
    """What EAGLE and EAGLE-3 share: the checks, building and loading the head, ``propose``."""

    needs_hidden_states = True
    cuda_graphs = True
    method: ClassVar[str]
    kind: ClassVar[str]

    def __init__(self, config: EngineConfig, model_state: ModelState,
                 device: torch.device) -> None:
        super().__init__(config, model_state, device)
        if not config.speculative.model:
            raise ValueError(
                f"speculative_config.model: method {self.method!r} needs the directory of the "
                f"{self.kind} head's checkpoint (config.json and its weights)"
            )
        self.num_lookahead_tokens = self.num_speculative_tokens
        self.argmax_drafts = config.speculative.rejection_sample_method == "probabilistic"
        self.block_size = model_state.block_size
        self.head: Any = None
        self.first_layer = 0
        self._caches: Sequence[torch.Tensor] = ()
        self._backends: Sequence[Any] = ()

    # -- start-up ----------------------------------------------------------------------------

    def build(self, registries: Any) -> None:
        """Read the head's config, check it fits the target, build the head (the target's
        dtype and device) and load its weights (or draw them, ``load_format="dummy"``)."""
        from mrv2.model_loader import init_dummy_weights, load_model_weights
        from mrv2.model_loader.build import (
            load_hf_config,
            process_weights_after_loading,
            text_config_of,
        )
        from mrv2_eagle.heads import read_checkpoint

        path = cast(str, self.config.speculative.model)
        head_config = load_hf_config(path)
        target = text_config_of(self.model_state.hf_config)  # (a VL target's text decoder)
        self._check_vocab_and_hidden(head_config, target)
        model = self.model_state.model
        for name in ("embed_input_ids", "compute_logits"):
            if not callable(getattr(model, name, None)):
                raise ValueError(f"speculative_config.method {self.method!r}: the target model "
                                 f"({type(model).__name__}) has no {name}()")
        dummy = self.config.model.load_format == "dummy"
        tensors = {} if dummy else read_checkpoint(path)
        dtype = next(model.parameters()).dtype
        max_position = max(int(_field(head_config, "max_position_embeddings") or 0),
                           int(_field(target, "max_position_embeddings") or 0), 1)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(self.device):
                head = self._make_head(head_config, max_position, set(tensors), dummy)
        finally:
            torch.set_default_dtype(previous)
        # The head drafts at the target's positions, which RoPE scaling may take past both
        # max_position_embeddings: its tables reach them (rows as they were below).
        reach = max(max_position, context_limit(target)[0] or 0,
                    self.config.model.fixed_max_model_len or 0)
        for module in head.modules():
            if isinstance(module, RotaryEmbedding):
                module.positions = max(module.positions, reach)
        if dummy:
            init_dummy_weights(head, seed=self.config.model.seed)
        else:
            load_model_weights(head, tensors.items())
        head.to(device=self.device, dtype=dtype)
        head.eval()
        process_weights_after_loading(head)
        self.head = head

    def _check_vocab_and_hidden(self, head: Any, target: Any) -> None:
        vocab, hidden = int(target.vocab_size), int(target.hidden_size)
        if int(_field(head, "vocab_size") or vocab) != vocab:
            raise ValueError(
                f"speculative_config.model: the {self.kind} head's vocab_size "
                f"({head.vocab_size}) must equal the target's ({vocab}): drafts are token ids "
                f"of the target's vocabulary"
            )
        if int(head.hidden_size) != hidden:
            raise ValueError(
                f"speculative_config.model: the {self.kind} head's hidden_size "
                f"({head.hidden_size}) must equal the target's ({hidden})"
            )

    def _make_head(self, head_config: Any, max_position: int, names: set[str],
                   dummy: bool) -> nn.Module:
        raise NotImplementedError

    def kv_cache_specs(self, first_layer_idx: int) -> dict[int, KVCacheSpec]:
        """The head's attention layers, numbered from ``first_layer_idx``."""
        assert self.head is not None, "build() first"
        self.first_layer = first_layer_idx
        return cast(dict[int, KVCacheSpec], self.head.kv_cache_specs(first_layer_idx))

    def bind_kv_caches(self, kv_caches: Sequence[torch.Tensor], backends: Sequence[Any]) -> None:
        super().bind_kv_caches(kv_caches, backends)
        self._caches = list(kv_caches[self.first_layer:])
        self._backends = list(backends[self.first_layer:])

    def _context(self, metadata: AttentionMetadata) -> ForwardContext:
        return ForwardContext(metadata, self._caches, self._backends)

    # -- per step ----------------------------------------------------------------------------

    def _catch_up_hidden(self, inputs: SpeculatorInputs, num_tokens: int) -> torch.Tensor:
        raise NotImplementedError

    def propose(
        self, batch: InputBatch, samples: StepSamples, inputs: SpeculatorInputs,
        table: RequestStateTable,
    ) -> None:
        head, k = self.head, self.num_speculative_tokens
        positions, following = catch_up_inputs(batch, table)
        hidden = self._catch_up_hidden(inputs, batch.num_tokens_padded)
        with set_forward_context(self._context(self.model_state.prepare_attn(batch))):
            out = head(following, positions, hidden)

        steps = DraftSteps(batch, table, samples.num_sampled, self.block_size, k)
        hidden = out[first_draft_rows(batch, positions, steps.num_tokens)]
        pos, valid = steps.positions(0)  # pos = n - 1: the draft goes to n
        drafts = steps.draw(head.compute_logits(hidden), pos + 1, self.sampling,
                            self.argmax_drafts)
        steps.write(pos + 1, drafts, valid)
        for j in range(1, k):
            pos, valid = steps.positions(j)  # the previous draft sits at pos
            with set_forward_context(self._context(steps.metadata(pos - 1, valid))):
                hidden = head(steps.tokens_at(pos), pos - 1, hidden)
            drafts = steps.draw(head.compute_logits(hidden), pos + 1, self.sampling,
                                self.argmax_drafts)
            steps.write(pos + 1, drafts, valid)


class EagleSpeculator(_EagleBase):
    """``{"method": "eagle", "model": DIR, "num_speculative_tokens": k}``: an EAGLE-1/2 head
    (``fc`` over ``[embedding, final hidden state]``, decoder layers, the target's LM head)
    drafts ``k`` tokens per step."""

    method = "eagle"
    kind = "EAGLE"

    def _make_head(self, head_config: Any, max_position: int, names: set[str],
                   dummy: bool) -> nn.Module:
        from mrv2_eagle.heads import EagleHead, eagle_head_options

        model: Any = self.model_state.model
        options = eagle_head_options(names)
        return EagleHead(head_config, model.embed_input_ids, model.compute_logits,
                         max_position=max_position, **options)

    def _catch_up_hidden(self, inputs: SpeculatorInputs, num_tokens: int) -> torch.Tensor:
        assert inputs.hidden_states is not None, "EAGLE reads the target's hidden states"
        return inputs.hidden_states[:num_tokens]


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """vLLM's (and EAGLE-3's training code's) default target layers of an ``L``-layer model:
    ``(2, L // 2, L - 3)`` (the residual stream at their inputs)."""
    return 2, num_layers // 2, num_layers - 3


def aux_layer_ids(head_config: Any, num_layers: int) -> list[int]:
    """The target layers an EAGLE-3 head reads, in layer order (the order they are
    concatenated in): ``eagle_aux_hidden_state_layer_ids`` of the head's config (top level, or
    in ``eagle_config``), else :func:`default_aux_layer_ids`. Ids outside ``0 .. L - 1``, or
    repeated, are a ``ValueError``."""
    ids = _field(head_config, "eagle_aux_hidden_state_layer_ids")
    eagle_config = _field(head_config, "eagle_config")
    if not ids and isinstance(eagle_config, dict):
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    field = "eagle_aux_hidden_state_layer_ids"
    if not ids:
        ids = default_aux_layer_ids(num_layers)
        field = "the default aux layer ids (2, L // 2, L - 3)"
    ids = [int(i) for i in ids]
    if any(not 0 <= i < num_layers for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(
            f"speculative_config.model: {field} of the EAGLE-3 head are {ids}: they must be "
            f"distinct layers of the target, in 0..{num_layers - 1} (it has {num_layers})"
        )
    return sorted(ids)


class Eagle3Speculator(_EagleBase):
    """``{"method": "eagle3", "model": DIR, "num_speculative_tokens": k}``: an EAGLE-3 head
    (``fc`` fusing three target layers, one ``midlayer``, its own norm and LM head over a
    reduced vocabulary mapped by ``d2t``) drafts ``k`` tokens per step. The target must be
    built on :class:`mrv2.layers.DecoderModel` (it keeps the layers' hidden states)."""

    method = "eagle3"
    kind = "EAGLE-3"

    def _check_vocab_and_hidden(self, head: Any, target: Any) -> None:
        vocab, hidden = int(target.vocab_size), int(target.hidden_size)
        if int(_field(head, "vocab_size") or vocab) != vocab:
            raise ValueError(
                f"speculative_config.model: the EAGLE-3 head's vocab_size ({head.vocab_size}) "
                f"must equal the target's ({vocab}): drafts are token ids of the target's "
                f"vocabulary"
            )
        fused = int(_field(head, "target_hidden_size") or head.hidden_size)
        if fused != hidden:
            name = "target_hidden_size" if _field(head, "target_hidden_size") else "hidden_size"
            raise ValueError(
                f"speculative_config.model: the EAGLE-3 head's {name} ({fused}) must equal "
                f"the target's hidden_size ({hidden})"
            )
        if int(_field(head, "num_hidden_layers") or 1) != 1:
            raise ValueError(
                f"speculative_config.model: the EAGLE-3 head has num_hidden_layers "
                f"{head.num_hidden_layers}; one (the midlayer) is supported"
            )

    def _make_head(self, head_config: Any, max_position: int, names: set[str],
                   dummy: bool) -> nn.Module:
        from mrv2.model_loader.build import text_config_of
        from mrv2_eagle.heads import Eagle3Head, eagle3_head_options

        target: Any = text_config_of(self.model_state.hf_config)
        model: Any = self.model_state.model
        keep = getattr(model, "keep_aux_hidden_states", None)
        if not callable(keep):
            raise ValueError(
                f"speculative_config.method 'eagle3': the target model "
                f"({type(model).__name__}) cannot hand over its intermediate hidden states (no "
                f"keep_aux_hidden_states(); models built on mrv2.layers.DecoderModel have it)"
            )
        layers = int(_field(target, "num_hidden_layers") or len(model.model.layers))
        ids = aux_layer_ids(head_config, layers)
        vocab = int(target.vocab_size)
        names = {n.removeprefix("model.") for n in names}
        options = eagle3_head_options(names)
        if dummy:  # drawn weights: the head's own LM head over its draft vocabulary
            options = {"own_embedding": False, "own_lm_head": True,
                       "qkv_bias": bool(_field(head_config, "attention_bias")),
                       "o_bias": bool(_field(head_config, "attention_bias"))}
        elif "t2d" not in names and "d2t" not in names:
            draft_vocab = int(_field(head_config, "draft_vocab_size") or vocab)
            if draft_vocab != vocab:
                raise ValueError(
                    f"speculative_config.model: the EAGLE-3 head's draft_vocab_size "
                    f"({draft_vocab}) differs from the target's vocab_size ({vocab}) but its "
                    f"checkpoint has no d2t mapping"
                )
        if not options["own_lm_head"] and int(_field(head_config, "draft_vocab_size")
                                                or vocab) != vocab:
            raise ValueError("speculative_config.model: the EAGLE-3 head has no lm_head and a "
                             "draft vocabulary other than the target's")
        if int(head_config.hidden_size) != int(target.hidden_size) and not (
                options["own_embedding"] and options["own_lm_head"]):
            raise ValueError(
                f"speculative_config.model: the EAGLE-3 head's hidden_size "
                f"({head_config.hidden_size}) differs from the target's ({target.hidden_size}): "
                f"it needs embed_tokens and lm_head of its own"
            )
        head = Eagle3Head(head_config, model.embed_input_ids, model.compute_logits,
                          max_position=max_position, num_aux=len(ids),
                          target_hidden=int(target.hidden_size), vocab_size=vocab, **options)
        keep(ids, self.model_state.buffers.max_num_tokens)
        return head

    def _catch_up_hidden(self, inputs: SpeculatorInputs, num_tokens: int) -> torch.Tensor:
        aux = inputs.aux_hidden_states
        if aux is None:  # a ModelState that builds its own inputs: the buffer itself
            aux = getattr(self.model_state.model, "aux_hidden_states", None)
        assert aux is not None, "EAGLE-3 reads the target's kept layers (aux_hidden_states)"
        return cast(torch.Tensor, self.head.combine(aux[:num_tokens]))
