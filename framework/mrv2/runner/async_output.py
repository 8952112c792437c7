"""Step outputs that reach the CPU one step late, on their own stream, gated by an event."""

from __future__ import annotations

import numpy as np
import torch


class PinnedRing:
    """A few pinned host buffers reused in turn for device-to-host copies of sampled tokens."""

    def __init__(self, size: int, device: torch.device, count: int = 4) -> None:
        pinned = device.type == "cuda"
        self._buffers = [
            torch.empty(size, dtype=torch.int64, pin_memory=pinned) for _ in range(count)
        ]
        self._events: list[torch.cuda.Event | None] = [None] * count
        self._next = 0

    def take(self) -> tuple[torch.Tensor, int]:
        """The next buffer (after its previous copy has landed) and its slot."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        event = self._events[slot]
        if event is not None:
            event.synchronize()
        return self._buffers[slot], slot

    def set_event(self, slot: int, event: torch.cuda.Event) -> None:
        """Remember the event after which ``slot``'s buffer holds its copy."""
        self._events[slot] = event


class AsyncStepOutput:
    """The sampled tokens of one step; ``result()`` waits for them, nothing else does."""

    def __init__(
        self,
        req_ids: list[str],
        do_sample: np.ndarray,
        host: torch.Tensor,
        event: torch.cuda.Event | None,
    ) -> None:
        self.req_ids = req_ids
        self.do_sample = do_sample
        self._host = host
        self._event = event
        self._result: dict[str, int] | None = None
        self._logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._prompt: list[tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def set_logprobs(self, ids: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor) -> None:
        """Attach the host buffers the step's sample logprobs are copied into."""
        self._logprobs = (ids, values, ranks)

    def add_prompt_logprobs(
        self, req_id: str, first_position: int, ids: torch.Tensor, values: torch.Tensor,
        ranks: torch.Tensor,
    ) -> None:
        """Attach the host buffers of one request's prompt logprobs of this step."""
        self._prompt.append((req_id, first_position, ids, values, ranks))

    def logprobs(self) -> dict[str, tuple[list[int], list[float], int]]:
        """``{req_id: (ids, logprobs, sampled rank)}`` (ids[0] is the sampled token).

        Holds every request of the step (the engine keeps ``k`` of each); empty when no
        request of the step asked for logprobs. Call after :meth:`result`.
        """
        if self._logprobs is None:
            return {}
        self.result()
        ids, values, ranks = (t.tolist() for t in self._logprobs)
        return {
            req_id: (ids[i], values[i], int(ranks[i]))
            for i, (req_id, sampled) in enumerate(zip(self.req_ids, self.do_sample, strict=True))
            if sampled
        }

    def prompt_logprobs(self) -> list[tuple[str, int, list[list[int]], list[list[float]],
                                            list[int]]]:
        """``(req_id, first position, ids, logprobs, ranks)`` per prompt chunk of the step."""
        self.result()
        return [(r, pos, ids.tolist(), vals.tolist(), ranks.tolist())
                for r, pos, ids, vals, ranks in self._prompt]

    def ready(self) -> bool:
        """True when ``result()`` would not wait."""
        return self._event is None or self._event.query()

    def result(self) -> dict[str, int]:
        """``{req_id: token}`` for every request that sampled this step."""
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            tokens = self._host[: len(self.req_ids)].numpy()
            self._result = {
                req_id: int(token)
                for req_id, token, sampled in zip(self.req_ids, tokens, self.do_sample, strict=True)
                if sampled
            }
        return self._result
