"""``ModelState``: everything model-specific the runner needs, behind one lifecycle.

The runner owns the state table, the persistent buffers and the step; a ``ModelState`` declares
the model's KV cache, turns a prepared :class:`InputBatch` into the model's inputs and attention
metadata, keeps per-request extras (multimodal inputs, M-RoPE positions...), hands the
speculator what it needs after sampling, and knows how to capture its forward.

This class is the default for decoder-only text models. A family subclasses it and registers
the subclass with its architecture (``register(arch, model, model_state="pkg.mod:MyState")``);
the runner calls only the methods of the model's own state, so a family's code never runs for
another family's model. Methods called per step must only launch device work, never read it
back (no ``.item()``, ``.tolist()``, ``.cpu()``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from mrv2.config import EngineConfig
from mrv2.contract.attention import AttentionMetadata
from mrv2.contract.batch import InputBatch, InputBuffers, last_token_indices
from mrv2.contract.forward_context import BidirectionalSpan
from mrv2.contract.kv_cache import KVCacheSpec, layer_specs
from mrv2.contract.prompt_embeds import PromptEmbedsRows
from mrv2.contract.request_state import (
    allocate_request_states,
    request_state_layers,
    snapshot_slots,
    state_row_slots,
)
from mrv2.contract.requests import MultiModalEmbeddings, MultiModalItem, NewRequest
from mrv2.contract.samples import SpeculatorInputs


class ModelState:
    """Default decoder-only ModelState: token ids and positions in, paged attention metadata."""

    mixed_step_graphs: bool = True
    """Whether steps with prompt tokens may replay CUDA graphs (the runner's mixed graphs), as
    decode steps do: then :meth:`prepare_inputs` and :meth:`prepare_attn` must launch the same
    work for any step of a padded size, reading only the persistent buffers and the batch's
    CPU-known bounds, at least for the steps :meth:`mixed_graph_allowed` accepts. ``False``:
    every step with prompt tokens runs eager (nothing captured for them)."""

    prompt_embeds_supported: bool = True
    """Whether prompts given as embeddings (``enable_prompt_embeds``) may reach this model: the
    default :meth:`prepare_inputs` splices them over ``model.embed_input_ids``' rows. A state
    whose model reads more than ``inputs_embeds`` from the prompt's token ids says ``False``:
    the runner then refuses the flag at start-up, naming the architecture."""

    def __init__(
        self,
        model: nn.Module,
        hf_config: Any,
        config: EngineConfig,
        buffers: InputBuffers,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.hf_config = hf_config
        self.config = config
        self.buffers = buffers
        self.block_size = block_size
        self.device = device
        self._graph_pool: Any = None
        #: The model's layers with per-request state (linear attention, state-space mixers:
        #: :mod:`mrv2.contract.request_state`), their tensors allocated here, ``row_slots``
        #: rows per state-table row (1, or ``1 + k`` with speculative decoding) and one per
        #: prefix-caching snapshot slot after them, before the KV cache is sized (the KV
        #: budget is what they leave).
        self.request_state_layers = request_state_layers(model)
        dtype = next((p.dtype for p in model.parameters() if p.dtype.is_floating_point),
                     torch.float32)
        #: State rows per request (:func:`~mrv2.contract.request_state.state_row_slots`).
        self.request_state_row_slots = state_row_slots(config)
        #: Snapshot slots (rows ``max_num_seqs * row_slots + i``); 0 for a model without such
        #: layers.
        self.request_state_slots = snapshot_slots(config) if self.request_state_layers else 0
        rows = (config.scheduler.max_num_seqs * self.request_state_row_slots
                + self.request_state_slots)
        self.request_state_bytes = allocate_request_states(
            self.request_state_layers, rows, dtype, device,
            f"max_num_seqs {config.scheduler.max_num_seqs} x {self.request_state_row_slots} "
            f"(1 + speculative tokens) + {self.request_state_slots} snapshot slots")
        #: One row's bytes across every layer (what one request reads and writes a step).
        self.request_state_row_bytes = self.request_state_bytes // rows
        #: The prompt embeddings of requests given as embeddings (the runner fills it; the
        #: default :meth:`prepare_inputs` splices a step's rows).
        self.prompt_embeds = PromptEmbedsRows(device, dtype)

    @property
    def keeps_request_state(self) -> bool:
        """Whether the model keeps per-request state beside its KV cache: prefix caching then
        needs snapshot slots, and speculative decoding a row per query token."""
        return bool(self.request_state_layers)

    # -- start-up ----------------------------------------------------------------------------

    def kv_cache_specs(self) -> dict[int, KVCacheSpec]:
        """``{layer_idx: spec}`` of the model's cache layers (default: every
        :class:`~mrv2.contract.kv_cache.KVCacheLayer` module's own spec)."""
        return layer_specs(self.model)

    # -- per request -------------------------------------------------------------------------

    def check_request(self, request: NewRequest) -> None:
        """Raise ``ValueError`` naming the request and the field for a request this model
        cannot take (a multimodal item it can't embed), before the request is queued: the
        engine's ``add_request`` calls it, so a bad request is refused alone instead of
        failing a step for every request in it. :meth:`add_request` must accept what this
        accepts. Text models: nothing to check."""

    def add_request(self, request: NewRequest, row: int) -> None:
        """A request took ``row`` (``request.mm_items``: its multimodal inputs). Text models
        keep nothing beyond the state table. Called before the step that first computes it."""

    def remove_request(self, req_id: str, row: int) -> None:
        """A request left ``row`` (finished, aborted or preempted): free what it held."""

    # -- per step ----------------------------------------------------------------------------

    def mixed_graph_allowed(self, rows: list[int], num_computed: list[int],
                            query_lens: list[int]) -> bool:
        """Whether a step with prompt tokens may replay a mixed graph: request ``i`` of the step
        (state-table row ``rows[i]``) computes positions ``num_computed[i]`` to
        ``num_computed[i] + query_lens[i] - 1``. Called on the host while the step is built,
        before :meth:`prepare_inputs`; must not touch the device. ``False`` runs this step
        eager (a multimodal state: a step that computes placeholder tokens, whose embeddings
        are spliced in by host work). Default: every step."""
        return True

    def get_mm_embeddings(self, batch: InputBatch) -> MultiModalEmbeddings | None:
        """Embeddings of this step's multimodal placeholder tokens; text models have none."""
        return None

    def prepare_inputs(self, batch: InputBatch) -> dict[str, Any]:
        """``model.forward`` keyword arguments: token ids and positions of the padded step.

        When :meth:`get_mm_embeddings` returns rows, or the step computes rows of a prompt
        given as embeddings (:attr:`prompt_embeds`), the token embeddings
        (``model.embed_input_ids``) come with them spliced in, as ``inputs_embeds``.
        """
        inputs: dict[str, Any] = {"input_ids": batch.input_ids, "positions": batch.positions}
        mm = self.get_mm_embeddings(batch)
        given = self.prompt_embeds.step_rows(batch)
        if mm is not None or given is not None:
            embeds: torch.Tensor = cast(Any, self.model).embed_input_ids(batch.input_ids)
            for rows in (mm, given):
                if rows is not None:
                    embeds.index_copy_(0, rows.token_indices, rows.embeddings.to(embeds.dtype))
            inputs["inputs_embeds"] = embeds
        return inputs

    def prepare_attn(self, batch: InputBatch) -> AttentionMetadata:
        """Paged-attention metadata over the batch's device tensors (no host reads)."""
        return AttentionMetadata(
            num_reqs=batch.num_reqs_padded,
            num_tokens=batch.num_tokens_padded,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            block_table=batch.block_table,
            slot_mapping=batch.slot_mapping,
            block_size=self.block_size,
            uniform_decode=batch.uniform_decode,
        )

    def speculator_inputs(self, batch: InputBatch, hidden_states: torch.Tensor) -> SpeculatorInputs:
        """What the speculator reads after this step: the last layer's hidden states, and the
        rows of this step in the model's ``aux_hidden_states`` buffer when it keeps one (a
        ``DecoderModel`` asked to by an Eagle3 drafter: ``keep_aux_hidden_states``)."""
        aux = getattr(self.model, "aux_hidden_states", None)
        if aux is None:
            return SpeculatorInputs(hidden_states=hidden_states)
        return SpeculatorInputs(hidden_states, aux[: batch.num_tokens_padded])

    # -- start-up ----------------------------------------------------------------------------

    def profile_encoder(self, max_prompt_tokens: int) -> int:
        """Run the family's encoder (a vision tower) once on the largest input one prompt of
        ``max_prompt_tokens`` tokens may carry, its output dropped: the runner calls it inside
        the memory profile it takes before sizing the KV cache, so the encoder's activations
        are counted. Returns the bytes the family keeps on the device beyond that while
        serving (an encoder cache's budget), which the runner reserves too. Default (text
        models): nothing to run, 0."""
        return 0

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> InputBatch:
        """A harmless batch over the persistent buffers: ``num_tokens`` split over requests.

        Its tokens write no KV (slot -1) and read block 0 only (positions, which feed only the
        rotary embedding, stay below one block). Each request's last ``1 + k`` tokens are logits
        rows (``k``: the speculative tokens configured), as in the largest real step. Used for
        the profiling forward and for CUDA-graph capture (``num_tokens = num_reqs * (1 + k)``).
        """
        buffers = self.buffers
        if not 1 <= num_reqs <= min(num_tokens, buffers.max_num_reqs):
            raise ValueError(f"dummy batch of {num_reqs} requests and {num_tokens} tokens")
        lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
        lens[: num_tokens % num_reqs] += 1
        room = buffers.block_table.shape[1] * self.block_size
        if lens[0] > room:  # attention would read past the request's block-table row
            raise ValueError(f"dummy batch of {num_reqs} requests and {num_tokens} tokens: "
                             f"{int(lens[0])} tokens per request, a block-table row holds "
                             f"{room}")
        starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        positions = np.concatenate([np.arange(n) for n in lens])
        positions = np.minimum(positions, self.block_size - 1)
        buffers.input_ids[:num_tokens].fill_(1)
        buffers.positions[:num_tokens].copy_(torch.from_numpy(positions))
        buffers.slot_mapping[:num_tokens].fill_(-1)
        buffers.idx_mapping[:num_reqs].zero_()
        buffers.query_start_loc[: num_reqs + 1].copy_(torch.from_numpy(starts))
        seq_lens = lens.astype(np.int32)
        buffers.seq_lens[:num_reqs].copy_(torch.from_numpy(seq_lens))
        buffers.block_table[:num_reqs].zero_()
        drafts = np.minimum(lens - 1, self.config.speculative.num_speculative_tokens)
        cu_logits = np.concatenate([[0], np.cumsum(drafts + 1)]).astype(np.int32)
        rows = last_token_indices(starts, drafts + 1)
        num_logits = len(rows)
        buffers.logits_indices[:num_logits].copy_(torch.from_numpy(rows))
        buffers.logits_idx_mapping[:num_logits].zero_()
        buffers.logits_positions[:num_logits].copy_(torch.from_numpy(positions[rows] + 1))
        return InputBatch(
            req_ids=[f"dummy-{i}" for i in range(num_reqs)],
            num_reqs=num_reqs,
            num_reqs_padded=num_reqs,
            num_tokens=num_tokens,
            num_tokens_padded=num_tokens,
            max_query_len=int(lens.max()),
            max_seq_len=int(seq_lens.max()),
            uniform_decode=bool((lens == lens[0]).all() and drafts[0] == lens[0] - 1),
            do_sample=np.ones(num_reqs, dtype=bool),
            idx_mapping=buffers.idx_mapping[:num_reqs],
            query_start_loc=buffers.query_start_loc[: num_reqs + 1],
            input_ids=buffers.input_ids[:num_tokens],
            positions=buffers.positions[:num_tokens],
            slot_mapping=buffers.slot_mapping[:num_tokens],
            seq_lens=buffers.seq_lens[:num_reqs],
            block_table=buffers.block_table[:num_reqs],
            logits_indices=buffers.logits_indices[:num_logits],
            idx_mapping_cpu=np.zeros(num_reqs, dtype=np.int32),
            query_start_loc_cpu=starts,
            num_computed_cpu=np.zeros(num_reqs, dtype=np.int32),
            num_draft_tokens=drafts.astype(np.int32),
            cu_num_logits=cu_logits,
            logits_idx_mapping=buffers.logits_idx_mapping[:num_logits],
            logits_positions=buffers.logits_positions[:num_logits],
        )

    def capture_cuda_graph(
        self, batch: InputBatch, forward: Callable[[], Any]
    ) -> torch.cuda.CUDAGraph | None:
        """Capture ``forward`` (which reads only persistent buffers) into a CUDA graph, or
        return ``None`` to run this batch shape eager.

        All graphs of this state share one memory pool: only one replays at a time.
        """
        if self.device.type != "cuda":
            return None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            forward()
        self._graph_pool = graph.pool()
        return graph


def placeholder_rows(
    batch: InputBatch, index: int, offset: int, length: int
) -> tuple[np.ndarray, np.ndarray]:
    """Where placeholder positions ``offset .. offset + length - 1`` of request ``index`` of the
    batch fall in this step: ``(token rows of the flat step batch, positions within the item)``,
    both possibly empty (chunked prefill computes a placeholder run over several steps)."""
    first = int(batch.num_computed_cpu[index])
    start = int(batch.query_start_loc_cpu[index])
    count = int(batch.query_start_loc_cpu[index + 1]) - start
    lo, hi = max(first, offset), min(first + count, offset + length)
    if lo >= hi:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    return np.arange(lo, hi) - first + start, np.arange(lo, hi) - offset


def item_span(item: MultiModalItem, index: int, rows: np.ndarray, within: np.ndarray
              ) -> BidirectionalSpan:
    """The :class:`~mrv2.contract.forward_context.BidirectionalSpan` of a ``bidirectional``
    item of request ``index`` whose rows this step computes (:func:`placeholder_rows`'
    ``rows`` and ``within``, not empty). A ValueError where the step does not compute the
    item's end (the scheduler never cuts one: :meth:`mrv2.engine.request.Request.chunk_size`)."""
    if int(within[-1]) != item.length - 1:
        raise ValueError(f"a step computes {len(rows)} of the {item.length} tokens of a "
                         f"bidirectional {item.kind} from position "
                         f"{item.offset + int(within[0])} but not its end")
    return BidirectionalSpan(index, int(rows[0]), item.offset + int(within[0]),
                             item.offset + item.length)
