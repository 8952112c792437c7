"""What a scheduler hands the runner each step. Bring your own scheduler: build these."""

from __future__ import annotations

from dataclasses import dataclass, field

from mrv2.sample.params import SamplingParams


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


@dataclass
class SchedulerOutput:
    """One step: who joins, who leaves, and how many tokens each scheduled request computes.

    ``num_scheduled_tokens`` is ordered: its order is the batch order. A request samples a token
    when this step takes it to the end of its known tokens (prefill complete, or decode).
    """

    num_scheduled_tokens: dict[str, int]
    new_requests: list[NewRequest] = field(default_factory=list)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    """Blocks appended to running requests this step."""
    finished_req_ids: list[str] = field(default_factory=list)
    """Requests to drop from the state table before this step (finished, aborted, preempted)."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens in the step."""
        return sum(self.num_scheduled_tokens.values())
