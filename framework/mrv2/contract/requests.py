"""What a scheduler hands the runner each step. Bring your own scheduler: build these."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mrv2.contract.lora import LoRARequest
from mrv2.contract.params import SamplingParams
from mrv2.contract.pooling import PoolingParams


@dataclass(frozen=True)
class MultiModalItem:
    """One non-text input of a request (an image, a video, an audio clip).

    Its ``length`` placeholder tokens sit at prompt positions ``offset .. offset + length - 1``;
    the model's ``ModelState`` turns ``data`` into ``length`` embedding rows that replace those
    tokens' embeddings. ``content_hash`` names the content: it keys the prefix cache (two
    prompts with the same tokens but different images never share KV) and encoder caches.
    """

    kind: str
    """``"image"``, ``"video"``, ``"audio"``... (the family's processor decides)."""
    data: Any
    """What the family's encoder reads (pixel values and grid sizes, say)."""
    content_hash: str
    offset: int
    length: int
    bidirectional: bool = False
    """Whether the item's tokens attend to each other both ways (an image's tokens in Gemma
    3): the scheduler then never ends a step inside the item (a step that computes some of
    its tokens computes the rest of them too; vLLM's ``disable_chunked_mm_input``), so the
    item can't be longer than ``max_num_batched_tokens``; the family's model state builds the
    step's :class:`~mrv2.contract.forward_context.BidirectionalSpan` s
    (:meth:`~mrv2.contract.encoder_cache.EncoderCacheModelState.step_spans`)."""

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(
                f"MultiModalItem: offset must be >= 0 and length >= 1, got offset={self.offset},"
                f" length={self.length}"
            )


@dataclass
class MultiModalEmbeddings:
    """Embedding rows that replace some of a step's token embeddings."""

    token_indices: torch.Tensor
    """``[N]`` int64 device tensor: rows of the step's flat token batch to replace."""
    embeddings: torch.Tensor
    """``[N, hidden_size]``: the replacement rows, in the order of ``token_indices``."""


@dataclass
class NewRequest:
    """A request entering the runner (for the first time, or resuming after preemption)."""

    req_id: str
    token_ids: list[int]
    """The prompt; on resumption, the prompt plus every token generated so far."""
    sampling_params: SamplingParams
    seed: int
    """Noise seed of the request's sampling (the engine fills it in for unseeded requests)."""
    block_ids: list[int]
    """KV blocks held by the request, in order."""
    num_computed_tokens: int = 0
    """Tokens whose KV is already in ``block_ids`` (prefix-cache hits)."""
    mm_items: list[MultiModalItem] = field(default_factory=list)
    """Multimodal inputs, ordered by ``offset``; their placeholders lie within the prompt."""
    lora_request: LoRARequest | None = None
    """The request's LoRA adapter (``enable_lora``), or None for the base model. At most
    ``max_loras`` distinct adapters may be live in the runner at once."""
    pooling_params: PoolingParams | None = None
    """An embedding request's pooling: the step that samples its first token also copies its
    last prompt token's final hidden state, pooled (``AsyncStepOutput.pooled()``)."""
    extra_block_ids: list[list[int]] = field(default_factory=list)
    """With sliding-window block tables (:mod:`mrv2.runner.kv_tables`): the request's blocks
    in each table after the first, in order, as ``block_ids``. Entries before a table's window
    name blocks the request no longer holds (any id: attention never reads them)."""
    state_table_row: tuple[int, int, int, int, int, int] | None = None
    """A model with per-request state under prefix caching
    (:mod:`mrv2.engine.state_snapshots`): ``(source slot, its position, snapshot position,
    its slot, snapshot position, its slot)``, slots as snapshot indices and -1 for none: the
    first chunk reads its state from the source slot when it starts at that position, and a
    chunk covering a snapshot position stores the state after it in that slot. None: none of
    it."""

    def __post_init__(self) -> None:
        end = 0
        for item in self.mm_items:
            if item.offset < end or item.offset + item.length > len(self.token_ids):
                raise ValueError(
                    f"request {self.req_id!r}: multimodal placeholders must be ordered, disjoint"
                    f" and within the {len(self.token_ids)} prompt tokens; got offset "
                    f"{item.offset}, length {item.length}"
                )
            end = item.offset + item.length


@dataclass
class SchedulerOutput:
    """One step: who joins, who leaves, and how many tokens each scheduled request computes.

    ``num_scheduled_tokens`` is ordered; the batch puts the longest sequences first and keeps
    this order among equals (``MRV2_LONGEST_FIRST=0``: exactly this order), and
    ``InputBatch.req_ids`` says which request each row holds. A request samples when this
    step takes it to the end of its known tokens (prefill complete, or decode).

    Speculative decoding: ``num_draft_tokens[req] = k`` says the last ``k`` of the request's
    scheduled tokens are the drafts its speculator proposed last step (so it schedules
    ``1 + k``: its last sampled token and the drafts). The step then yields ``1 + a`` tokens for
    it, ``a <= k`` accepted drafts plus the target's own next token, and the request's
    computed tokens advance by ``1 + a``, not ``1 + k``: until the step's result arrives, count
    the ``k - a`` unknown rejected tokens as computed (an upper bound; the KV blocks must cover
    it) and take them back when it does (``AsyncStepOutput.result()`` gives the tokens).
    """

    num_scheduled_tokens: dict[str, int]
    new_requests: list[NewRequest] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    """Blocks appended to running requests this step."""
    new_extra_block_ids: dict[str, list[list[int]]] = field(default_factory=dict)
    """Blocks appended to running requests' other block tables (sliding-window layers'),
    one list per table after the first."""
    finished_req_ids: list[str] = field(default_factory=list)
    """Requests to drop from the state table before this step (finished, aborted, preempted)."""
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    """Drafts among a decode request's scheduled tokens (absent: none)."""
    token_bitmasks: dict[str, np.ndarray] = field(default_factory=dict)
    """The allowed tokens of each structured-output request that samples this step, one row
    a logits row of it (``[1 + drafts, ceil(vocab / 32)]`` int32, bit ``t % 32`` of word
    ``t // 32`` for token ``t``: its token's, then each draft position's), from the engine's
    matchers; every tensor-parallel rank masks with the same."""
    copy_drafts: bool = False
    """Copy the drafts proposed after this step to the host with its tokens
    (``AsyncStepOutput.drafts()``): the next step's structured-output masks need them."""
    fill_token_bitmasks: Callable[[], None] | None = None
    """Set by an engine whose runner is in its process when the masks are not known yet (the
    constrained requests' tokens of the step before are in flight): ``token_bitmasks`` then
    holds the arrays, and the runner calls this after launching the forward and before
    sampling, so the masks are filled while the device runs the forward."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens in the step."""
        return sum(self.num_scheduled_tokens.values())
