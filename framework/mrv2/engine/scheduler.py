"""Continuous batching with a token budget, chunked prefill, recompute preemption, a policy
("fcfs" or "priority") and automatic prefix caching.

The scheduler needs only counts: a request that sampled a token on the device in a step whose
result has not reached the CPU yet counts that token as pending, so the next step is planned
without waiting for it. With speculation a decode request is scheduled ``1 + k`` tokens (its last
token and ``k`` drafts proposed on the device); until the result arrives every draft counts as
kept (computed, and pending as output), an upper bound that keeps block allocation safe, and
:meth:`Scheduler.correct` takes back the rejected ones.

Prefix caching: at admission a request takes the longest run of cached full blocks matching its
tokens (never all of them: its last token is always computed, so it samples) and starts with
``num_computed_tokens`` past them. A block of a request is registered in the cache once it is
full, its KV is computed (or scheduled in a step already launched) and all of its token ids are
known on the CPU. With async scheduling the last sampled token arrives one step late, so a
block ending in it is registered a step later; a block holding a position whose token never
reaches the CPU (the one wasted token of a request that stopped) is never registered.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence

from mrv2.config import SchedulerConfig
from mrv2.contract.kv_cache import longest_fitting
from mrv2.contract.requests import NewRequest, SchedulerOutput
from mrv2.engine.block_manager import BlockManager
from mrv2.engine.block_tables import BlockTables
from mrv2.engine.request import Request, RequestStatus
from mrv2.engine.state_snapshots import StateSave, StateSnapshots


class Scheduler:
    """Continuous batching over a :class:`BlockManager`.

    Each step: running requests first (decodes, then unfinished prefill chunks; by priority
    under the "priority" policy, else in admission order), then waiting requests (in arrival
    order, or by ``(priority, arrival)``) while budget, batch slots and KV blocks last. When a
    running request needs a block and none is free, a victim is preempted: the last admitted
    running request ("fcfs") or the one of largest ``(priority, arrival)`` ("priority"). Its
    blocks are freed (full ones stay cached) and it waits to be recomputed from its tokens.
    """

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager,
        num_speculative_tokens: int = 0, max_model_len: int | None = None,
        num_lookahead_tokens: int = 0, table_windows: Sequence[int | None] = (None,),
    ) -> None:
        self.config = config
        self.blocks = block_manager
        #: The request's blocks in each block table (``table_windows``: the runner's
        #: ``kv_table_windows``; sliding tables free what falls out of their window).
        self.tables = BlockTables(block_manager, table_windows, num_speculative_tokens)
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        #: KV slots held past each step's tokens for a drafter that runs ahead of the target.
        self.num_lookahead_tokens = num_lookahead_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._in_runner: set[str] = set()
        self._to_remove: list[str] = []
        self._arrivals = itertools.count()
        self._preempted_now: set[str] = set()
        #: False: no waiting request starts but one preempted earlier (the engine drains:
        #: ``pause_generation("wait")``).
        self.admitting = True
        self._sampled_now: set[str] = set()
        self.num_preemptions = 0
        #: The engine fills structured outputs' masks late (during the step's forward, once the
        #: token in flight has arrived), so a constrained request runs every step; when False
        #: (a runner that cannot take them, or ``MRV2_LATE_TOKEN_MASKS=0``) it waits for its
        #: token in flight, every other step.
        self.late_token_masks = False
        #: The most LoRA adapters live in the runner at once (``max_loras``; None: no
        #: adapters served). A waiting request whose adapter would exceed it waits.
        self.max_loras: int | None = None
        self._lora_users: dict[int, int] = {}
        #: A model with per-request state under prefix caching: the snapshots of its state at
        #: block boundaries (:mod:`mrv2.engine.state_snapshots`); None otherwise.
        self.snapshots: StateSnapshots | None = None
        self._published_now: dict[str, list[StateSave]] = {}
        #: Waiting requests by adapter name (the stats read it every step: no queue walk).
        self._waiting_loras: Counter[str] = Counter()

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self.waiting) + len(self.running)

    @property
    def _by_priority(self) -> bool:
        return self.config.policy == "priority"

    def check_room(self, num_requests: int = 1) -> None:
        """RuntimeError unless the waiting queue takes ``num_requests`` more (the ``n``
        samples of one request are queued all or none)."""
        if len(self.waiting) + num_requests > self.config.max_waiting:
            raise RuntimeError(
                f"waiting queue full ({self.config.max_waiting} requests); retry later"
            )

    def add(self, request: Request) -> None:
        """Queue a request (already validated by the engine)."""
        self.check_room()
        request.arrival_index = next(self._arrivals)
        self._enqueue(request, front=False)

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """End a request (stopped, length, abort): free its blocks and, next step, its row."""
        if request.finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
            self._count_waiting_lora(request, -1)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self._release(request)

    def take_finished_ids(self) -> list[str]:
        """Ids whose runner rows are to be freed (each returned once)."""
        ids, self._to_remove = self._to_remove, []
        return ids

    # -- queues ------------------------------------------------------------------------------

    @staticmethod
    def _rank(request: Request) -> tuple[int, int]:
        return request.priority, request.arrival_index

    def _enqueue(self, request: Request, front: bool) -> None:
        self._count_waiting_lora(request, 1)
        if self._by_priority:
            bisect.insort(self.waiting, request, key=self._rank)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _running_order(self) -> list[Request]:
        """Decodes (one token left to compute) before prefill chunks, so a flood of prefills
        never starves them; within each group by priority or admission order. A prefill
        whose next bidirectional item did not fit what the decodes left of the budget goes
        with the decodes, in their order: decodes of requests admitted after it would
        otherwise take that room every step, forever under a steady load."""
        if self._by_priority:
            return sorted(self.running, key=lambda r: (
                r.num_tokens - r.num_computed_tokens > 1 and not r.waits_for_item,
                r.priority, r.arrival_index))
        return sorted(self.running, key=lambda r: (
            r.num_tokens - r.num_computed_tokens > 1 and not r.waits_for_item))

    def _pick_victim(self) -> Request:
        if self._by_priority:
            return max(self.running, key=self._rank)
        return self.running[-1]

    # -- blocks ------------------------------------------------------------------------------

    def _cache_blocks(self, request: Request) -> None:
        """Register the request's full, computed blocks whose tokens are all known."""
        if not self.blocks.enable_caching or request.kv_stale:
            return
        size = self.blocks.block_size
        known = len(request.prompt_token_ids) + len(request.output_token_ids)
        limit = min(request.num_computed_tokens, known) // size
        limit = min(limit, len(request.block_ids))
        if limit <= request.num_cached_blocks:
            return
        hashes = request.update_block_hashes(size)
        for i in range(request.num_cached_blocks, limit):
            self.tables.cache(request, i, hashes[i])
        request.num_cached_blocks = limit

    def _release(self, request: Request) -> None:
        if self.snapshots is not None:
            self.snapshots.release_all(request.state_saves)
        self._cache_blocks(request)
        self.tables.release(request)
        request.num_cached_blocks = 0
        request.kv_stale = False  # (it recomputes every token when it runs again)
        if request.req_id in self._in_runner:
            self._in_runner.discard(request.req_id)
            self._count_lora(request, -1)
            self._to_remove.append(request.req_id)

    def _unschedule(self, request: Request, out: SchedulerOutput) -> int:
        """Take back a request's tokens scheduled earlier in this step; returns their count."""
        n = out.num_scheduled_tokens.pop(request.req_id, 0)
        published = self._published_now.pop(request.req_id, None)
        if published and self.snapshots is not None:
            self.snapshots.unpublish_all(published)
        if n:
            out.new_block_ids.pop(request.req_id, None)
            out.new_extra_block_ids.pop(request.req_id, None)
            drafts = out.num_draft_tokens.pop(request.req_id, 0)
            request.num_computed_tokens -= n
            if request.req_id in self._sampled_now:
                self._sampled_now.discard(request.req_id)
                request.num_pending -= 1 + drafts
        return n

    def _num_drafts(self, request: Request, budget: int) -> int:
        """Drafts to verify for a decode request: ``k``, fewer near ``max_tokens`` or
        ``max_model_len`` or the end of the budget. Every kind of request verifies drafts:
        the sampler's stages that depend on the output so far see a draft row's drafts
        before it (``min_tokens`` and bad words from the row's position, penalties by
        :mod:`mrv2.sample.draft_penalties`), a structured output's masks cover each draft
        position, and logprobs are each kept token's
        (:func:`mrv2.sample.rejection.kept_token_logprobs` after probabilistic or synthetic
        verification)."""
        k = self.num_speculative_tokens
        if not k:
            return 0
        k = min(k, request.max_tokens - request.num_output_tokens - 1, budget - 1)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - request.num_tokens - 1)
        return max(k, 0)

    def _capped(self, num_tokens: int) -> int:
        """``num_tokens``, at most ``long_prefill_token_threshold`` (where set): the most of
        one request's tokens (a prompt's chunk, a decode and its drafts) one step computes,
        as vLLM's V1 scheduler caps them."""
        threshold = self.config.long_prefill_token_threshold
        return min(num_tokens, threshold) if threshold > 0 else num_tokens

    @staticmethod
    def _item_chunk(request: Request, start: int, n: int, budget: int) -> int:
        """:meth:`Request.chunk_size` of the ``n`` tokens from ``start``; where
        ``long_prefill_token_threshold`` cut ``n`` below the budget and a bidirectional item
        longer than the threshold starts there, that whole item (within the budget): else
        the request would never run (its item can't be split)."""
        chunk = request.chunk_size(start, n)
        if chunk <= 0 and n < budget:
            rest = next((item.offset + item.length - start for item in request.mm_items
                         if item.bidirectional and item.offset <= start < item.offset
                         + item.length), 0)
            if rest <= budget:
                chunk = rest
        return chunk

    @property
    def max_step_tokens(self) -> int:
        """The most tokens of one request a step holds KV slots for: the token budget and the
        drafter's lookahead."""
        return self.config.max_num_batched_tokens + self.num_lookahead_tokens

    def most_blocks(self, num_tokens: int) -> int:
        """The most KV blocks, over all tables, a request of ``num_tokens`` tokens (prompt
        and outputs) ever holds at once: its steps hold slots for the drafter's lookahead too
        (:meth:`_with_lookahead`). The engine refuses a request that needs more than the pool:
        it could never be scheduled, and it would wait forever, never preempted."""
        return self.tables.most_held(self._with_lookahead(num_tokens), self.max_step_tokens)

    def check_capacity(self, max_model_len: int, knob: str) -> None:
        """ValueError unless the pool holds one request of ``max_model_len`` tokens, counted
        as :meth:`most_blocks` counts it (sliding tables hold their window and a step's
        tokens; the drafter's lookahead): else every request that leaves ``max_tokens`` unset
        would be refused. The message names the blocks needed and held, the largest
        ``max_model_len`` that fits (:func:`~mrv2.contract.kv_cache.longest_fitting`, what
        ``max_model_len="auto"`` takes), and ``knob`` (the setting that sizes the pool)."""
        num_blocks, size = self.blocks.num_blocks, self.blocks.block_size
        needed = self.most_blocks(max_model_len)
        if needed <= num_blocks:
            return
        low = longest_fitting(num_blocks, self.tables.windows, size, self.max_step_tokens,
                              self.tables.margin, max_model_len)
        lookahead = self.num_lookahead_tokens
        slots = f" (with the drafter's {lookahead} lookahead slots)" if lookahead else ""
        fits = (f"the largest max_model_len that fits is about {low}" if low
                else "no max_model_len fits")
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {size} tokens ({num_blocks * size} "
            f"tokens), but one request of max_model_len {max_model_len} tokens needs "
            f"{needed} blocks{slots}: no request could reach the model's max_model_len; "
            f"{fits}. Raise {knob}, or lower max_model_len (max_model_len='auto' takes the "
            "longest that fits)")

    def _with_lookahead(self, num_tokens: int) -> int:
        """Tokens whose KV slots a step must hold: its own plus the drafter's lookahead,
        within the context."""
        total = num_tokens + self.num_lookahead_tokens
        return total if self.max_model_len is None else min(total, self.max_model_len)

    def correct(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A step's result: ``num_accepted`` of the request's ``num_drafts`` drafts were kept.
        The counts had assumed all of them (and as many tokens pending)."""
        request.num_pending -= num_drafts - num_accepted
        if request.status is RequestStatus.RUNNING:
            request.num_computed_tokens -= num_drafts - num_accepted

    def samples_now(self, req_id: str) -> bool:
        """Whether the step just scheduled samples a token for ``req_id``."""
        return req_id in self._sampled_now

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.sampled_last_step = request.waits_for_item = False
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_now.add(request.req_id)
        self._enqueue(request, front=True)

    def forget_cached(self) -> None:
        """Forget the prefix cache's blocks and the state snapshots (a weight update, or
        ``reset_prefix_cache``). A running request keeps its blocks, but what it computed so
        far (and, through attention, all it computes after) is the old weights': none of its
        blocks or snapshots is registered from now on, or a later request would find them."""
        self.blocks.reset_prefix_cache()
        if self.snapshots is not None:
            self.snapshots.reset()
        for request in self.running:
            request.kv_stale = True
            for save in request.state_saves:
                save.stale = True

    @property
    def num_started(self) -> int:
        """Requests that started and have not finished: running, or preempted and waiting
        to resume."""
        return len(self.running) + sum(1 for r in self.waiting if r.num_preemptions)

    def preempt_all(self) -> int:
        """Preempt every running request, in order (their blocks freed; each recomputes its
        prompt and outputs when scheduled again); the engine must have no step in flight.
        Returns how many."""
        victims = list(self.running)
        for request in reversed(victims):  # (each goes to the front: the order is kept)
            self._preempt(request)
        return len(victims)

    # -- the step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step. An empty ``num_scheduled_tokens`` means nothing to run now."""
        budget = self.config.max_num_batched_tokens
        out = SchedulerOutput(num_scheduled_tokens={})
        self._preempted_now.clear()
        self._sampled_now.clear()
        self._published_now.clear()
        if self.snapshots is not None:
            self.snapshots.begin_step()

        for request in self._running_order():
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget <= 0:
                break
            if request.num_output_tokens >= request.max_tokens:
                continue  # every token it needs is sampled; it ends when they arrive
            if (request.num_pending and not self.late_token_masks
                    and request.sampling_params.structured_outputs is not None):
                continue  # its next token's mask needs the one in flight (structured outputs)
            n = min(request.num_tokens - request.num_computed_tokens, self._capped(budget))
            if request.mm_items and request.num_computed_tokens < request.num_prompt_tokens:
                # (no step ends inside a bidirectional item, a one-token step neither)
                n = self._item_chunk(request, request.num_computed_tokens, n, budget)
                request.waits_for_item = n <= 0
            if n <= 0:
                continue
            drafts = (self._num_drafts(request, self._capped(budget))
                      if n == 1 and request.sampled_last_step else 0)
            n += drafts
            if self.tables.may_free(request):  # blocks out of a sliding window: to the pool
                self._cache_blocks(request)
                self.tables.free_outside_windows(request)
            end = self._with_lookahead(request.num_computed_tokens + n)
            needed = self.tables.blocks_needed(end, len(request.block_ids))
            if needed:
                while not self.blocks.can_allocate(needed):
                    victim = self._pick_victim()
                    if victim is request:
                        break
                    budget += self._unschedule(victim, out)
                    self._preempt(victim)
                if not self.blocks.can_allocate(needed):
                    self._preempt(request)
                    continue
                new_blocks = self.tables.allocate(request, end)
                out.new_block_ids[request.req_id] = new_blocks[0]
                if len(new_blocks) > 1:
                    out.new_extra_block_ids[request.req_id] = new_blocks[1:]
            self._schedule(request, n, out, drafts)
            budget -= n

        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            chosen = self._next_waiting()
            if chosen is None:
                break
            request = chosen
            if request.num_pending or request.req_id in self._preempted_now:
                break  # preempted with a token in flight, or just now: resume later
            if not self._admit(request, budget, out):
                break
            budget -= out.num_scheduled_tokens[request.req_id]

        for request in self.running:
            self._cache_blocks(request)
        out.finished_req_ids = self.take_finished_ids()
        return out

    def _count_lora(self, request: Request, change: int) -> None:
        """Count a request with an adapter into (+1) or out of (-1) the runner's rows."""
        if request.lora_request is None:
            return
        lora_id = request.lora_request.lora_int_id
        users = self._lora_users.get(lora_id, 0) + change
        if users:
            self._lora_users[lora_id] = users
        else:
            self._lora_users.pop(lora_id, None)

    def _count_waiting_lora(self, request: Request, change: int) -> None:
        if request.lora_request is not None:
            self._waiting_loras[request.lora_request.lora_name] += change
            if self._waiting_loras[request.lora_request.lora_name] <= 0:
                del self._waiting_loras[request.lora_request.lora_name]

    def lora_names(self) -> tuple[list[str], list[str]]:
        """The adapters (names, sorted) of the running and of the waiting requests."""
        running = {r.lora_request.lora_name for r in self.running if r.lora_request is not None}
        return sorted(running), sorted(self._waiting_loras)

    def _lora_fits(self, request: Request) -> bool:
        """Whether the request's adapter is live already or one more adapter fits."""
        lora = request.lora_request
        return (lora is None or self.max_loras is None or lora.lora_int_id in self._lora_users
                or len(self._lora_users) < self.max_loras)

    def _next_waiting(self) -> Request | None:
        """The head of the waiting queue (while draining, ``admitting`` False, of its started
        requests: the preempted, wherever the priority order put them); with ``max_loras``
        adapters live, the first of the next 256 of them whose adapter is live or fits (a
        request of another adapter waits, as in vLLM, while others pass it)."""
        queue: Iterable[Request] = (self.waiting if self.admitting
                                    else (r for r in self.waiting if r.num_preemptions))
        if self.max_loras is None:
            return next(iter(queue), None)
        return next((r for r in itertools.islice(queue, 256) if self._lora_fits(r)), None)

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> bool:
        """Start a waiting request, after its cached prefix; False if it can't."""
        size = self.blocks.block_size
        tables = self.tables
        hit: list[list[int]] = [[] for _ in range(tables.num_tables)]
        held_from = [0] * tables.num_tables
        # Prompt logprobs and per-token pooling need every prompt position computed: no
        # cache hits for them.
        pooling = request.pooling_params
        looked_up = (self.blocks.enable_caching and request.sampling_params.prompt_logprobs
                     is None and (pooling is None or not pooling.per_token))
        if looked_up:
            hashes = request.update_block_hashes(size)
            hit, held_from = tables.find_prefix(hashes[: (request.num_tokens - 1) // size])
        num_hit, resumed_from = len(hit[0]), None
        if self.snapshots is not None and num_hit:  # (the state after the hit is needed too)
            resumed, resumed_from = self.snapshots.deepest(request.block_hashes[:num_hit])
            if resumed < num_hit:
                hit, held_from = tables.find_prefix(request.block_hashes[:resumed])
        computed = len(hit[0]) * size
        n = self._capped(request.num_tokens - computed)  # (as vLLM: before the budget's test)
        if n > budget:
            if not self.config.enable_chunked_prefill and not request.num_preemptions:
                return False  # (a resumed request may exceed the budget: it recomputes in chunks)
            n = budget
        if request.mm_items:  # (no step ends inside a bidirectional item)
            n = self._item_chunk(request, computed, n, budget)
            if n <= 0:
                return False
        end = self._with_lookahead(computed + n)
        needed = tables.blocks_needed(end, len(hit[0]))
        held = tables.held_hits(hit, held_from)
        if not self.blocks.can_allocate(needed + self.blocks.num_free_among(held)):
            return False
        if self.waiting[0] is request:
            self.waiting.popleft()
        else:  # (passed a request whose LoRA adapter must wait)
            self.waiting.remove(request)
        self._count_waiting_lora(request, -1)
        tables.take(request, hit, held_from, end)
        request.num_cached_blocks = len(hit[0])
        request.num_computed_tokens = computed
        if not request.num_preemptions:
            request.num_cached_tokens = computed
            if request.scheduled_time is None:  # (its time in queue ends here)
                request.scheduled_time = time.monotonic()
            if looked_up:  # (as vLLM's: a resumed request's lookup is no new prompt's)
                self.blocks.record_query(request.num_tokens, computed)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._in_runner.add(request.req_id)
        self._count_lora(request, 1)
        state_row = None
        if self.snapshots is not None:
            state_row = self.snapshots.plan(
                request.state_saves, request.update_block_hashes(size), request.num_tokens,
                num_hit, len(hit[0]), resumed_from)
        out.new_requests.append(NewRequest(
            req_id=request.req_id,
            token_ids=request.all_token_ids,
            sampling_params=request.sampling_params,
            seed=request.seed,
            block_ids=list(request.block_ids),
            extra_block_ids=[list(ids) for ids in request.extra_block_ids],
            num_computed_tokens=computed,
            mm_items=request.mm_items,
            lora_request=request.lora_request,
            pooling_params=request.pooling_params,
            state_table_row=state_row,
        ))
        self._schedule(request, n, out)
        return True

    def _schedule(self, request: Request, n: int, out: SchedulerOutput, drafts: int = 0) -> None:
        out.num_scheduled_tokens[request.req_id] = n
        if request.state_saves and self.snapshots is not None:
            due = self.snapshots.publish_due(request.state_saves, request.num_computed_tokens, n)
            if due:
                self._published_now[request.req_id] = due
        if drafts:
            out.num_draft_tokens[request.req_id] = drafts
        request.num_computed_tokens += n
        request.sampled_last_step = request.num_computed_tokens == request.num_tokens + drafts
        if request.sampled_last_step:
            request.num_pending += 1 + drafts  # every draft counted as kept until the result
            self._sampled_now.add(request.req_id)
