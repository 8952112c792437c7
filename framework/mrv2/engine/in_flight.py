"""The engine's requests and steps in flight, and which request each id names
(:class:`InFlight`).

With async scheduling (:mod:`mrv2.engine.engine`) step N+1 is launched before step N's
results are read, so a request can end (finish or abort) while a step holding its token is
still in flight, and a caller may give its id to a new request at once. That step's results
for the id are the ended request's: :attr:`InFlight.ended` keeps, for each id that ended with
steps in flight, the newest of them; while it is there, step results for the id are dropped
(:meth:`InFlight.live`) and a new request of the id reads only the steps after it
(:meth:`InFlight.steps_of`). The entry goes when that step is processed, or fails
(:meth:`InFlight.processed`): the id is then the new request's alone.

An ``n > 1`` request is a parent whose samples run under the ids ``child_id(parent, i)``
(:class:`~mrv2.engine.sampling_outputs.FanOut` merges their outputs). A parent holds its
samples' ids, and a sample's id stays held while its parent is in flight (that finished
sample's output would be merged into the parent's).

Memory: an entry per request in flight and per ended id with a step in flight (the requests
that ended within the last one or two steps); nothing grows with a request's length.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator

from mrv2.engine.sampling_outputs import FanOut, TrackedRequest, child_id
from mrv2.runner.async_output import AsyncStepOutput

__all__ = ["InFlight"]


class InFlight:
    """The requests running or waiting by id, the steps launched and not yet processed, the
    ids that ended with steps in flight, the ``n > 1`` parents, and the numbers the engine
    gives requests whose caller named none. See the module's docstring for the rules."""

    def __init__(self) -> None:
        #: The requests running or waiting, by id (an ``n > 1`` request's samples each).
        self.requests: dict[str, TrackedRequest] = {}
        #: Steps launched and not yet processed, oldest first.
        self.steps: deque[AsyncStepOutput] = deque()
        #: Ids whose request ended while steps were in flight, each with the newest of them:
        #: its results for the id, and those of the steps before it, are the ended
        #: request's, never those of a new request given the same id since.
        self.ended: dict[str, AsyncStepOutput] = {}
        #: The ``n > 1`` parents, their samples' ids, and their outputs merged so far.
        self.fanout = FanOut()
        #: The numbers of the ids the engine chooses (:meth:`new_id`).
        self.numbers: Iterator[int] = itertools.count()

    # -- ids ---------------------------------------------------------------------------------

    def ids_in_use(self, req_id: str, n: int) -> list[str]:
        """Which of ``req_id`` and, for ``n > 1``, its samples' ids a request in flight holds:
        a request's, a parent's, or a sample's of a parent in flight."""
        ids = [req_id, *(child_id(req_id, i) for i in range(n if n > 1 else 0))]
        fanout = self.fanout
        return [i for i in ids
                if i in self.requests or i in fanout.parents or i in fanout.child_parent]

    def new_id(self, n: int) -> str:
        """The engine's next numbered id that is free, with its samples' ids for ``n > 1``
        (numbers a caller took as its own ids are passed over)."""
        while True:
            req_id = str(next(self.numbers))
            if not self.ids_in_use(req_id, n):
                return req_id

    def check_free(self, req_id: str, n: int) -> None:
        """``ValueError`` when ``req_id`` or, for ``n > 1``, one of its samples' ids is in
        use (:meth:`ids_in_use`)."""
        in_use = self.ids_in_use(req_id, n)
        if in_use:
            whose = "" if in_use == [req_id] else f" (by its samples' ids {in_use})"
            raise ValueError(f"request id {req_id!r} is already in use{whose}")

    def is_sample(self, req_id: str) -> bool:
        """Whether ``req_id`` is a sample's of an ``n > 1`` parent in flight."""
        return req_id in self.fanout.child_parent

    # -- requests ----------------------------------------------------------------------------

    def remove(self, req_id: str) -> TrackedRequest | None:
        """Forget the request ``req_id`` (it finished or was aborted; None: no such request):
        its id is free again, and the steps in flight keep their results for it as its."""
        tracked = self.requests.pop(req_id, None)
        if tracked is not None and self.steps:
            self.ended[req_id] = self.steps[-1]
        return tracked

    def remove_for_abort(self, req_id: str) -> list[TrackedRequest]:
        """:meth:`remove` the requests an abort of ``req_id`` ends: an ``n > 1`` parent's
        samples (the parent forgotten, its output never merged), else the request of that
        id (a sample alone stays its parent's, to merge)."""
        removed = (self.remove(one) for one in self.fanout.discard(req_id) or [req_id])
        return [tracked for tracked in removed if tracked is not None]

    def remove_all(self) -> list[TrackedRequest]:
        """:meth:`remove` every request, oldest first."""
        return [tracked for tracked in map(self.remove, list(self.requests))
                if tracked is not None]

    # -- steps -------------------------------------------------------------------------------

    def live(self, req_id: str) -> TrackedRequest | None:
        """The request whose results the step being processed (the oldest) holds for
        ``req_id``: None where that request ended (:attr:`ended`) or is unknown."""
        return None if req_id in self.ended else self.requests.get(req_id)

    def steps_of(self, req_id: str) -> list[AsyncStepOutput]:
        """The steps in flight that may hold results of the live request ``req_id`` (none of
        those of an ended request of the same id)."""
        steps = list(self.steps)
        last = self.ended.get(req_id)
        if last is not None:
            steps = steps[next(i for i, s in enumerate(steps) if s is last) + 1:]
        return steps

    def processed(self, step: AsyncStepOutput) -> None:
        """``step`` (taken from :attr:`steps`) was processed, or failed: the ids that ended
        with it as their newest step in flight are free of it."""
        if self.ended:
            self.ended = {i: last for i, last in self.ended.items() if last is not step}

    def clear_steps(self) -> None:
        """Drop the steps in flight and what they held (the engine shut down)."""
        self.steps.clear()
        self.ended.clear()
