"""A request as the engine sees it: tokens, counts, status, blocks."""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from mrv2.contract.lora import LoRARequest
from mrv2.contract.params import SamplingParams
from mrv2.contract.pooling import PoolingParams
from mrv2.contract.prompt_embeds import PROMPT_EMBEDS_KIND, rows_digest
from mrv2.contract.requests import MultiModalItem
from mrv2.engine.block_manager import BlockHash, hash_block
from mrv2.engine.state_snapshots import StateSave


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request.

    Counts, not values, drive scheduling: ``num_pending`` tokens were sampled on the device but
    have not reached the CPU yet; the scheduler plans with them already counted.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int]
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_pending: int = 0
    block_ids: list[int] = field(default_factory=list)
    extra_block_ids: list[list[int]] = field(default_factory=list)
    """Blocks in each block table after the first (sliding-window tables:
    :mod:`mrv2.engine.block_tables`)."""
    held_from: list[int] = field(default_factory=list)
    """Per block table, the first entry the request still holds (entries before it fell out
    of a sliding window and were freed); empty: all held."""
    free_at: int = 0
    """The computed token count from which a block of a sliding table falls out of its window
    (the scheduler frees nothing before it)."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sampled_last_step: bool = False
    """Whether the request's last scheduled step samples a token: only then has the drafter
    written drafts after it for the next step to verify (a prompt whose last token is alone
    in a step, after a chunk that did not sample, verifies none)."""
    waits_for_item: bool = False
    """Whether its last step skipped it: its next chunk starts a bidirectional multimodal
    item that did not fit the budget the decodes left (the scheduler then orders it with
    the decodes)."""
    num_preemptions: int = 0
    first_token_time: float | None = None
    scheduled_time: float | None = None
    """When the scheduler first gave it a step (``time.monotonic()``; None until then): its
    time in queue is this less ``arrival_time`` (a traced request's span reports it)."""
    priority: int = 0
    """Scheduling priority under the "priority" policy: lower values run first."""
    arrival_index: int = 0
    """Order of arrival at the scheduler (ties of ``arrival_time``)."""
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Chain hashes of the request's full blocks whose tokens are all known on the CPU."""
    num_cached_blocks: int = 0
    """Leading blocks of ``block_ids`` already registered in (or found in) the prefix cache."""
    kv_stale: bool = False
    """Its KV predates a weight update (or a reset of the prefix cache) that it kept running
    through (``pause_generation("keep")``): none of its blocks is registered in the prefix
    cache (a later request would read the old weights' KV) until it is recomputed."""
    num_cached_tokens: int = 0
    """Prompt tokens the prefix cache held at the request's first admission (usage's
    ``prompt_tokens_details.cached_tokens``)."""
    mm_items: list[MultiModalItem] = field(default_factory=list)
    """Multimodal inputs (their placeholders lie in the prompt)."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter the request runs through (None: the base model)."""
    cache_salt: str | None = None
    """vLLM's ``cache_salt``: mixed into its first block's hash (every later hash chains from
    it), so only requests of the same salt share cached blocks (None: unsalted)."""
    pooling_params: PoolingParams | None = None
    """An embedding request's pooling (None: a generation request)."""
    state_saves: list[StateSave] = field(default_factory=list)
    """Snapshots of its per-request state this request stores as it runs (a model with
    per-request state under prefix caching: :mod:`mrv2.engine.state_snapshots`)."""

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens, counting those still on their way to the CPU."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, counting those still on their way."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and received output tokens."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def finished(self) -> bool:
        """True once stopped, aborted or out of room."""
        return self.status is RequestStatus.FINISHED

    def chunk_size(self, start: int, n: int) -> int:
        """How many of the ``n`` tokens from position ``start`` a step may compute: ``n`` cut
        back to the start of a bidirectional multimodal item it would end inside of, or 0 when
        ``start`` lies inside such an item whose rest does not fit (the step may not split it:
        :attr:`~mrv2.contract.requests.MultiModalItem.bidirectional`)."""
        end = start + n
        for item in self.mm_items:
            if item.bidirectional and item.offset < end < item.offset + item.length:
                end = item.offset if item.offset > start else start
        return end - start

    def block_extra_keys(self, block_index: int, block_size: int) -> tuple[Hashable, ...] | None:
        """Extra hash keys of a block: the content hashes of the multimodal items whose
        placeholders overlap it (with where the overlap starts in the item; a prompt given as
        embeddings: the digest of the block's rows, so prompts sharing leading rows share
        blocks, as vLLM's), the request's
        LoRA adapter (a prompt's KV under one adapter is not another's) and, for the first
        block only, its cache salt (as vLLM's); none for plain text."""
        start, end = block_index * block_size, (block_index + 1) * block_size
        keys: tuple[Hashable, ...] = tuple(
            rows_digest(item, start, end) if item.kind == PROMPT_EMBEDS_KIND
            else (item.content_hash, max(start - item.offset, 0)) for item in self.mm_items
            if item.offset < end and item.offset + item.length > start)
        if self.lora_request is not None:  # an adapter's KV is its own
            keys += (("lora", self.lora_request.lora_int_id),)
        if block_index == 0 and self.cache_salt is not None:  # (later hashes chain from it)
            keys += (("cache_salt", self.cache_salt),)
        return keys or None

    def update_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Extend ``block_hashes`` over every full block of known tokens; returns them."""
        known = len(self.prompt_token_ids) + len(self.output_token_ids)
        start = len(self.block_hashes)
        if (start + 1) * block_size <= known:
            tokens = self.all_token_ids
            parent = self.block_hashes[-1] if self.block_hashes else None
            for i in range(start, known // block_size):
                parent = hash_block(
                    parent, tokens[i * block_size : (i + 1) * block_size],
                    self.block_extra_keys(i, block_size),
                )
                self.block_hashes.append(parent)
        return self.block_hashes
