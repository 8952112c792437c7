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
