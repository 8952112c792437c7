"""Step outputs that reach the CPU one step late, on their own stream, gated by an event."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mrv2.contract.state_table import RowInfo


class PinnedRing:
    """A few pinned host buffers reused in turn for device-to-host copies of sampled tokens."""

    def __init__(self, numel: int, device: torch.device, count: int = 4) -> None:
        pinned = device.type == "cuda"
        self._tokens = [torch.empty(numel, dtype=torch.int64, pin_memory=pinned)
                        for _ in range(count)]
        self._counts = [torch.empty(numel, dtype=torch.int32, pin_memory=pinned)
                        for _ in range(count)]
        self._events: list[torch.cuda.Event | None] = [None] * count
        self._next = 0

    def take(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The next (tokens, counts) buffers (after their previous copy landed) and the slot."""
        slot = self._next
        self._next = (slot + 1) % len(self._tokens)
        event = self._events[slot]
        if event is not None:
            event.synchronize()
        return self._tokens[slot], self._counts[slot], slot

    def set_event(self, slot: int, event: torch.cuda.Event) -> None:
        """Remember the event after which ``slot``'s buffers hold their copy."""
        self._events[slot] = event


@dataclass
class Drafted:
    """A request of the step that verified drafts: its CPU counts, corrected on arrival."""

    info: RowInfo
    num_drafts: int


class AsyncStepOutput:
    """The tokens of one step; ``result()`` waits for them, nothing else does.

    ``tokens`` is ``[num_reqs, S]`` on the host once the event fires; ``num_sampled`` (host,
    steps with drafts only) says how many of a row's ``S`` are real, else ``do_sample`` does.
    """

    def __init__(
        self,
        req_ids: list[str],
        do_sample: np.ndarray,
        tokens: torch.Tensor,
        num_sampled: torch.Tensor | None,
        event: torch.cuda.Event | None,
        cu_num_logits: np.ndarray,
        drafted: dict[str, Drafted] | None = None,
    ) -> None:
        self.req_ids = req_ids
        self.do_sample = do_sample
        self._tokens = tokens
        self._num_sampled = num_sampled
        self._event = event
        self._cu_num_logits = cu_num_logits
        self.drafted = drafted or {}
        """Requests that verified drafts this step, with how many."""
        self._result: dict[str, list[int]] | None = None
        self._logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._drafts: torch.Tensor | None = None
        self._pooled: tuple[list[str], list[torch.Tensor]] | None = None
        self._drafts_of: dict[str, list[int]] | None = None
        self._prompt: list[tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def set_logprobs(self, ids: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor) -> None:
        """Attach the host buffers the step's sample logprobs are copied into."""
        self._logprobs = (ids, values, ranks)

    def set_pooled(self, req_ids: list[str], vectors: list[torch.Tensor]) -> None:
        """Embedding requests' pooled states (host tensors, filled by the step's copy)."""
        self._pooled = (req_ids, vectors)

    def pooled(self) -> dict[str, list[float]]:
        """The pooled state of each embedding request that completed its prompt in this step
        (waits for the step, as :meth:`result`)."""
        if self._pooled is None:
            return {}
        if self._event is not None:
            self._event.synchronize()
        req_ids, vectors = self._pooled
        return {req_id: v.tolist() for req_id, v in zip(req_ids, vectors, strict=True)}

    def set_drafts(self, drafts: torch.Tensor) -> None:
        """Attach the host buffer the drafts proposed after the step are copied into
        (``[num_reqs, k]``; ``SchedulerOutput.copy_drafts``)."""
        self._drafts = drafts

    def drafts(self) -> dict[str, list[int]]:
        """``{req_id: k drafts}`` proposed after this step, for every request that produced
        tokens in it; empty when the step did not copy them. Waits as :meth:`result`."""
        if self._drafts is None:
            return {}
        if self._drafts_of is None:
            result = self.result()
            rows = self._drafts.tolist()
            self._drafts_of = {req_id: rows[i] for i, req_id in enumerate(self.req_ids)
                               if req_id in result}
        return self._drafts_of

    def add_prompt_logprobs(
        self, req_id: str, first_position: int, ids: torch.Tensor, values: torch.Tensor,
        ranks: torch.Tensor,
    ) -> None:
        """Attach the host buffers of one request's prompt logprobs of this step."""
        self._prompt.append((req_id, first_position, ids, values, ranks))

    def logprobs(self) -> dict[str, list[tuple[list[int], list[float], int]]]:
        """``{req_id: [(ids, logprobs, sampled rank)] a token}`` (ids[0] is the row's sampled
        token): one entry per token of the request's :meth:`result`, from its logits rows in
        order (a request that verified drafts strictly: its output token ``j`` is row ``j``'s
        own sample, so row ``j``'s logprobs are that token's).

        Holds every request of the step that produced tokens (the engine keeps ``k`` of
        each); empty when no request of the step asked for logprobs. Waits as :meth:`result`.
        """
        if self._logprobs is None:
            return {}
        result = self.result()
        ids, values, ranks = (t.tolist() for t in self._logprobs)
        out = {}
        for i, req_id in enumerate(self.req_ids):
            tokens = result.get(req_id)
            if tokens:
                r = int(self._cu_num_logits[i])
                out[req_id] = [(ids[r + j], values[r + j], int(ranks[r + j]))
                               for j in range(len(tokens))]
        return out

    def prompt_logprobs(self) -> list[tuple[str, int, list[list[int]], list[list[float]],
                                            list[int]]]:
        """``(req_id, first position, ids, logprobs, ranks)`` per prompt chunk of the step."""
        self.result()
        return [(r, pos, ids.tolist(), vals.tolist(), ranks.tolist())
                for r, pos, ids, vals, ranks in self._prompt]

    def ready(self) -> bool:
        """True when ``result()`` would not wait."""
        return self._event is None or self._event.query()

    def result(self) -> dict[str, list[int]]:
        """``{req_id: tokens}`` for every request that produced tokens this step (one token, or
        the accepted drafts and the bonus token while verifying drafts)."""
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            if self._num_sampled is None:  # one token per request that sampled
                firsts = self._tokens[:, 0].tolist()
                self._result = {req_id: [token] for req_id, token, sampled in
                                zip(self.req_ids, firsts, self.do_sample.tolist(), strict=True)
                                if sampled}
            else:
                rows = self._tokens.tolist()
                counts = self._num_sampled.tolist()
                self._result = {req_id: rows[i][: counts[i]]
                                for i, req_id in enumerate(self.req_ids) if counts[i] > 0}
            for req_id, d in self.drafted.items():  # the CPU counts assumed every draft kept
                accepted = len(self._result.get(req_id, ())) - 1
                d.info.take_back(d.num_drafts - max(accepted, 0))
        return self._result
