"""Continuous batching with a token budget, chunked prefill and recompute preemption.

The scheduler needs only counts: a request that sampled a token on the device in a step whose
result has not reached the CPU yet counts that token as pending, so the next step is planned
without waiting for it.
"""

from __future__ import annotations

from collections import deque

from mrv2.config import SchedulerConfig
from mrv2.engine.block_manager import BlockManager
from mrv2.engine.request import Request, RequestStatus
from mrv2.runner.scheduler_output import NewRequest, SchedulerOutput


class Scheduler:
    """FCFS continuous batching over a :class:`BlockManager`.

    Each step: running requests first (decodes, then unfinished prefill chunks), in arrival
    order, then waiting requests while budget, batch slots and KV blocks last. When a running
    request needs a block and none is free, the latest-arrived running request is preempted:
    its blocks are freed and it waits to be recomputed from its tokens so far.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._in_runner: set[str] = set()
        self._to_remove: list[str] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        """Queue a request (already validated by the engine)."""
        if len(self.waiting) >= self.config.max_waiting:
            raise RuntimeError(
                f"waiting queue full ({self.config.max_waiting} requests); retry later"
            )
        self.waiting.append(request)

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request (stopped, length, abort): free its blocks and, next step, its row."""
        if request.finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self._release(request)

    def take_finished_ids(self) -> list[str]:
        """Ids whose runner rows are to be freed (each returned once)."""
        ids, self._to_remove = self._to_remove, []
        return ids

    def _release(self, request: Request) -> None:
        self.blocks.free(request.block_ids)
        request.block_ids = []
        if request.req_id in self._in_runner:
            self._in_runner.discard(request.req_id)
            self._to_remove.append(request.req_id)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> SchedulerOutput:
        """Plan one step. An empty ``num_scheduled_tokens`` means nothing to run now."""
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput(num_scheduled_tokens={}, finished_req_ids=self.take_finished_ids())

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.num_output_tokens >= request.max_tokens:
                index += 1  # every token it needs is sampled; it ends when they arrive
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if n <= 0:
                index += 1
                continue
            needed = self.blocks.blocks_needed(
                request.num_computed_tokens + n, len(request.block_ids)
            )
            if needed:
                while not self.blocks.can_allocate(needed) and self.running[-1] is not request:
                    self._preempt(self.running[-1])
                if not self.blocks.can_allocate(needed):
                    self._preempt(request)
                    break
                new_blocks = self.blocks.allocate(needed)
                request.block_ids.extend(new_blocks)
                out.new_block_ids[request.req_id] = new_blocks
            self._schedule(request, n, out)
            budget -= n
            index += 1

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending:
                break  # preempted with a token still in flight: resume once it lands
            n = request.num_tokens - request.num_computed_tokens
            if n > budget:
                if not self.config.enable_chunked_prefill and not request.num_preemptions:
                    break  # (a resumed request may exceed the budget: it recomputes in chunks)
                n = budget
            needed = self.blocks.blocks_needed(request.num_computed_tokens + n, 0)
            if not self.blocks.can_allocate(needed):
                break
            self.waiting.popleft()
            request.block_ids = self.blocks.allocate(needed)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._in_runner.add(request.req_id)
            out.new_requests.append(NewRequest(
                req_id=request.req_id,
                token_ids=request.all_token_ids,
                sampling_params=request.sampling_params,
                seed=request.seed,
                block_ids=list(request.block_ids),
                num_computed_tokens=request.num_computed_tokens,
            ))
            self._schedule(request, n, out)
            budget -= n
        return out

    @staticmethod
    def _schedule(request: Request, n: int, out: SchedulerOutput) -> None:
        out.num_scheduled_tokens[request.req_id] = n
        request.num_computed_tokens += n
        if request.num_computed_tokens == request.num_tokens:
            request.num_pending += 1
