"""A :class:`~mrv2.contract.model_state.ModelState` base for families with an encoder (a
vision tower): the encoder cache and each step's embedding rows.

- **A prefill chunk that reaches an item's placeholders** gets that item's embedding rows
  (:meth:`EncoderCacheModelState.get_mm_embeddings`). They come from the encoder cache, keyed
  by the item's content hash, or from one run of the family's encoder
  (:meth:`EncoderCacheModelState.embed_item`).
- **The encoder cache** keeps an item's embeddings while a request still has to compute the
  item's placeholder rows (reused across chunked-prefill steps and by other requests with the
  same image). A request lets go of an item in the step that computes the item's last row (at
  once, when the prefix cache already holds the rows), as vLLM frees encoder outputs after
  their prefill: decoding requests hold no embeddings, so the device memory they take is
  bounded by the prompts in prefill, not by every request in flight. Released embeddings stay
  in a least-recently-used pool of at most :attr:`EncoderCacheModelState.encoder_cache_bytes`,
  and are freed from it. (A preempted request is added again with its items and holds them
  anew; a miss runs the encoder again.)
- **Steps that compute placeholder rows run eager** (:meth:`mixed_graph_allowed`): their rows
  are spliced in on the host's say-so; the others replay the mixed CUDA graphs.

A family subclasses it with :meth:`~EncoderCacheModelState.embed_item` (and, where it has
them, per-request tables such as Qwen-VL's M-RoPE positions, or the step's
:class:`~mrv2.contract.forward_context.BidirectionalSpan` s).
"""

from __future__ import annotations

from abc import abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import torch

from mrv2.contract.batch import InputBatch
from mrv2.contract.forward_context import BidirectionalSpan
from mrv2.contract.model_state import ModelState, item_span, placeholder_rows
from mrv2.contract.requests import MultiModalEmbeddings, MultiModalItem, NewRequest
from mrv2.contract.staging import to_device

__all__ = ["EncoderCacheModelState"]


class EncoderCacheModelState(ModelState):
    """A model state whose requests' multimodal items are embedded by an encoder, cached by
    content (module doc). Subclasses implement :meth:`embed_item` and may check each item in
    :meth:`check_item`."""

    #: Bytes of embeddings kept after their last request left (least recently used first out);
    #: embeddings of items that live requests hold are never evicted.
    encoder_cache_bytes = 256 << 20

    #: The item kinds the family's encoder takes.
    item_kinds: tuple[str, ...] = ("image",)

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        super().__init__(model, hf_config, config, buffers, block_size, device)
        self._items: dict[int, list[MultiModalItem]] = {}
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._refs: Counter[str] = Counter()
        self.encoder_runs = 0  # encoder calls (the tests count cache hits with it)
        #: The last step's key and rows: a second call for the same step gives the same rows
        #: (the first one let go of the items it finished).
        self._last_step: tuple[tuple[bytes, bytes, bytes], MultiModalEmbeddings | None,
                               list[BidirectionalSpan]] | None = None

    def upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor of an item (its pixels) on the device: pinned and copied without
        blocking on CUDA (no host sync), as it is elsewhere."""
        if self.device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    @abstractmethod
    def embed_item(self, item: MultiModalItem) -> torch.Tensor:
        """The encoder's output for ``item``: ``[item.length, ...]`` rows on the device, row
        ``j`` for placeholder ``item.offset + j`` (what :meth:`get_mm_embeddings` slices)."""

    def splice_features(self, token_ids: Sequence[int], features: torch.Tensor,
                        token: int) -> torch.Tensor:
        """An item's rows where its span mixes layout tokens with encoder features (tiled
        images): the model's text embeddings of ``token_ids``, in ``features``' dtype, with
        ``features`` in order at the rows holding ``token``."""
        ids = np.asarray(token_ids, dtype=np.int64)
        rows = cast(torch.Tensor, cast(Any, self.model).embed_input_ids(
            to_device(ids, torch.int64, self.device))).to(features.dtype)
        where = to_device(np.flatnonzero(ids == token), torch.int64, self.device)
        rows[where] = features  # (staged indices: no host sync)
        return rows

    def check_item(self, request: NewRequest, item: MultiModalItem) -> None:
        """Raise a ValueError naming the request for an item the family can't embed (called
        for every item when a request is added; the default checks the kind)."""
        if item.kind not in self.item_kinds:
            allowed = ", ".join(repr(kind) for kind in self.item_kinds)
            raise ValueError(f"request {request.req_id!r}: unsupported multimodal kind "
                             f"{item.kind!r}; allowed: {allowed}")

    # -- per request -------------------------------------------------------------------------

    def check_request(self, request: NewRequest) -> None:
        """Every item through :meth:`check_item` (before the request is queued)."""
        for item in request.mm_items:
            self.check_item(request, item)

    def add_request(self, request: NewRequest, row: int) -> None:
        """Check the request's items and hold the cache entries of those it still has to
        compute."""
        self.check_request(request)
        self._release(row)
        pending = [item for item in request.mm_items  # (rows the prefix cache had: done)
                   if item.offset + item.length > request.num_computed_tokens]
        if pending:
            self._items[row] = pending
            self._refs.update(item.content_hash for item in pending)

    def remove_request(self, req_id: str, row: int) -> None:
        """Drop the row's hold on its items' cache entries."""
        self._release(row)

    def pending_items(self, row: int) -> Sequence[MultiModalItem]:
        """The items of the request in ``row`` whose placeholder rows are not all computed."""
        return self._items.get(row, ())

    def _release(self, row: int, done: list[MultiModalItem] | None = None) -> None:
        """Drop the row's hold on ``done`` (default: all of its items); evict after."""
        items = self._items.get(row, [])
        finished = {id(item) for item in (items if done is None else done)}
        released = [item for item in items if id(item) in finished]
        kept = [item for item in items if id(item) not in finished]
        if kept:
            self._items[row] = kept
        else:
            self._items.pop(row, None)
        for item in released:
            self._refs[item.content_hash] -= 1
            if self._refs[item.content_hash] <= 0:
                del self._refs[item.content_hash]
        self._evict()

    def _evict(self) -> None:
        """Free unheld entries, least recently used first, beyond the byte budget."""
        unheld = [h for h in self._cache if h not in self._refs]
        size = sum(self._cache[h].numel() * self._cache[h].element_size() for h in unheld)
        for content_hash in unheld:
            if size <= self.encoder_cache_bytes:
                break
            entry = self._cache.pop(content_hash)
            size -= entry.numel() * entry.element_size()

    # -- per step ----------------------------------------------------------------------------

    def _embeddings(self, item: MultiModalItem) -> torch.Tensor:
        cached = self._cache.get(item.content_hash)
        if cached is None:
            cached = self.embed_item(item)
            self.encoder_runs += 1
            self._cache[item.content_hash] = cached
            self._evict()
        self._cache.move_to_end(item.content_hash)
        return cached

    def step_rows(self, batch: InputBatch) -> MultiModalEmbeddings | None:
        """The encoder-cache rows (whatever :meth:`embed_item` gives per placeholder) of the
        placeholders this step computes, with their token rows in the flat step batch
        (host-side bookkeeping over the step's CPU arrays; None for a step without any)."""
        n = batch.num_reqs
        key = (batch.idx_mapping_cpu[:n].tobytes(), batch.num_computed_cpu[:n].tobytes(),
               batch.query_start_loc_cpu[: n + 1].tobytes())
        if self._last_step is None or self._last_step[0] != key:
            # (the same step asked again gets the same rows: the first call let go of the
            # items it finished)
            spans: list[BidirectionalSpan] = []
            result = self._compute_step_rows(batch, spans) if self._items else None
            self._last_step = (key, result, spans)
        return self._last_step[1]

    def step_spans(self, batch: InputBatch) -> list[BidirectionalSpan]:
        """The step's :class:`~mrv2.contract.forward_context.BidirectionalSpan` s: the rows
        of its ``bidirectional`` items (computed with :meth:`step_rows`, any order)."""
        self.step_rows(batch)
        assert self._last_step is not None
        return self._last_step[2]

    def _compute_step_rows(self, batch: InputBatch, spans: list[BidirectionalSpan]
                           ) -> MultiModalEmbeddings | None:
        indices: list[np.ndarray] = []
        parts: list[torch.Tensor] = []
        for i in range(batch.num_reqs):
            row = int(batch.idx_mapping_cpu[i])
            done: list[MultiModalItem] = []
            for item in self._items.get(row, ()):
                rows, within = placeholder_rows(batch, i, item.offset, item.length)
                if not len(rows):
                    continue
                # a contiguous run of the item's rows
                parts.append(self._embeddings(item)[int(within[0]): int(within[-1]) + 1])
                indices.append(rows)
                if int(within[-1]) == item.length - 1:
                    done.append(item)  # its last row: this request lets go (module doc)
                if item.bidirectional:
                    spans.append(item_span(item, i, rows, within))
            if done:  # (the slices above keep their rows alive for this step)
                self._release(row, done)
        if not parts:
            return None
        return MultiModalEmbeddings(to_device(np.concatenate(indices), torch.int64, self.device),
                                    parts[0] if len(parts) == 1 else torch.cat(parts))

    def mixed_graph_allowed(self, rows: list[int], num_computed: list[int],
                            query_lens: list[int]) -> bool:
        """Steps that compute no placeholder replay the mixed graphs; the others run eager:
        their rows are spliced in on the host's say-so (:meth:`get_mm_embeddings`)."""
        for row, first, count in zip(rows, num_computed, query_lens, strict=True):
            for item in self._items.get(row, ()):
                if first < item.offset + item.length and item.offset < first + count:
                    return False
        return True

    def get_mm_embeddings(self, batch: InputBatch) -> MultiModalEmbeddings | None:
        """The embedding rows of the placeholders this step computes (None for a step without
        any)."""
        return self.step_rows(batch)
