"""Property test of Scheduler + BlockManager without a model.

A fake runner mirrors the real one: it applies each SchedulerOutput to a table of rows, writes
the "KV" of every computed position (the token itself) into a fake paged cache through each of
the request's block tables (sliding-window and chunked tables too, whose blocks before what
the queries see the scheduler frees), checks that every position attention would read holds
the right token and that no step ends inside a bidirectional multimodal item (an image whose
tokens attend to each other both ways: Gemma 3's), and samples a token that is a pure
function of the sequence. A fake engine loop feeds tokens back one step late (async) or at
once (sync), the way ``LLMEngine`` does, with random arrivals, aborts and stops. Invariants
are checked after every step, and every request that was not aborted must end with exactly
the tokens it would produce alone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mrv2.config import SchedulerConfig
from mrv2.contract.kv_cache import AttentionChunk, first_visible
from mrv2.contract.params import SamplingParams
from mrv2.contract.requests import MultiModalItem, SchedulerOutput
from mrv2.engine.block_manager import BlockManager
from mrv2.engine.request import Request, RequestStatus
from mrv2.engine.scheduler import Scheduler

STOP = 6
BASE = [1, 2, 3, 1, 2, 3, 3, 2, 1, 1, 2, 2, 3, 3, 1, 2, 1, 3, 2, 1]


def next_token(tokens: list[int]) -> int:
    """The fake model: deterministic in the whole sequence, small vocabulary, sometimes STOP."""
    return (sum(tokens[-3:]) * 7 + len(tokens) * 3 + tokens[0]) % 6 + 1


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        token = next_token(tokens)
        tokens.append(token)
        out.append(token)
        if token == STOP:
            break
    return out


@dataclass
class Row:
    tokens: list[int]
    tables: list[list[int]]
    computed: int
    spans: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class FakeRunner:
    block_size: int
    num_blocks: int
    windows: tuple[int | None, ...] = (None,)
    rows: dict[str, Row] = field(default_factory=dict)
    kv: dict[tuple[int, int], int] = field(default_factory=dict)

    def remove(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            del self.rows[req_id]

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        apply_tables(self.rows, len(self.windows), out)
        sampled = {}
        size = self.block_size
        for req_id, n in out.num_scheduled_tokens.items():
            row = self.rows[req_id]
            assert 0 < n <= len(row.tokens) - row.computed
            end = row.computed + n
            assert not any(a < end < b for a, b in row.spans), (
                f"{req_id}: a step ends at {end}, inside a bidirectional item ({row.spans})")
            for blocks in row.tables:
                for pos in range(row.computed, row.computed + n):
                    self.kv[blocks[pos // size], pos % size] = row.tokens[pos]
            first = row.computed
            row.computed += n
            for blocks, window in zip(row.tables, self.windows, strict=True):
                # what attention reads: from what the step's first query sees on
                start = first_visible(first, window)
                for pos in range(start, row.computed):
                    assert self.kv.get((blocks[pos // size], pos % size)) == row.tokens[pos], (
                        f"{req_id}: stale KV at position {pos} (window {window})")
            if row.computed == len(row.tokens):
                token = next_token(row.tokens)
                row.tokens.append(token)
                sampled[req_id] = token
        return sampled


def apply_tables(rows: dict[str, Row], num_tables: int, out: SchedulerOutput) -> None:
    """A fake runner's rows after a step's scheduler output: finished ones removed, new ones
    added, every table extended by the step's new blocks (``num_tables`` tables each)."""
    for req_id in out.finished_req_ids:
        del rows[req_id]
    for new in out.new_requests:
        assert new.req_id not in rows
        assert len(new.extra_block_ids) == num_tables - 1
        rows[new.req_id] = Row(
            list(new.token_ids), [list(new.block_ids), *map(list, new.extra_block_ids)],
            new.num_computed_tokens,
            [(i.offset, i.offset + i.length) for i in new.mm_items if i.bidirectional])
    for req_id, blocks in out.new_block_ids.items():
        rows[req_id].tables[0] += blocks
        extra = out.new_extra_block_ids.get(req_id, [])
        assert len(extra) == num_tables - 1
        for ids, more in zip(rows[req_id].tables[1:], extra, strict=True):
            ids += more
    assert set(out.new_extra_block_ids) <= set(out.new_block_ids)


class StepRunner(Protocol):
    """What :class:`FakeEngine` drives: a fake runner's step and its row removal."""

    def execute(self, out: SchedulerOutput) -> Any: ...

    def remove(self, req_ids: list[str]) -> None: ...


class FakeEngine:
    """``LLMEngine``'s loop over the scheduler: results processed one step late (async) or at
    once, requests finished on STOP or ``max_tokens``."""

    def __init__(self, scheduler: Scheduler, runner: StepRunner, async_scheduling: bool) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.async_scheduling = async_scheduling
        self.requests: dict[str, Request] = {}
        self.in_flight: deque[Any] = deque()  # (the runner's results, a step each)
        self.done: dict[str, list[int]] = {}
        self.gone: list[Request] = []
        self.scheduled_running: set[str] = set()

    def add(self, req_id: str, prompt: list[int], max_tokens: int, priority: int = 0,
            items: list[MultiModalItem] | None = None) -> None:
        request = Request(req_id=req_id, prompt_token_ids=prompt,
                          sampling_params=SamplingParams(temperature=0.0), seed=0,
                          eos_token_ids=frozenset(), max_tokens=max_tokens, priority=priority,
                          mm_items=items or [])
        self.scheduler.add(request)
        self.requests[req_id] = request

    def abort(self, req_id: str) -> None:
        request = self.requests.pop(req_id, None)
        if request is not None:
            self.scheduler.finish(request, "abort")
            self.gone.append(request)
            if not self.has_unfinished():
                self.runner.remove(self.scheduler.take_finished_ids())

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self.in_flight)

    def step(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self.scheduled_running = {r.req_id for r in self.scheduler.running}
        if out.num_scheduled_tokens:
            self.in_flight.append(self.runner.execute(out))
        else:
            self.runner.remove(out.finished_req_ids)
        keep = 1 if self.async_scheduling and out.num_scheduled_tokens else 0
        while len(self.in_flight) > keep:
            self._process(self.in_flight.popleft())
        if not self.has_unfinished():
            self.runner.remove(self.scheduler.take_finished_ids())
        return out

    def _process(self, sampled: Any) -> None:
        """A step's result: ``{req_id: token}`` (a runner without drafts)."""
        for req_id, token in sampled.items():
            request = self.requests.get(req_id)
            if request is not None:
                request.num_pending -= 1
                self._deliver(request, [token])

    def _deliver(self, request: Request, tokens: list[int]) -> None:
        """A live request's tokens of a step, until it finishes (STOP or ``max_tokens``)."""
        if request.finished:
            return
        for token in tokens:
            request.output_token_ids.append(token)
            if token == STOP:
                self.scheduler.finish(request, "stop")
            elif len(request.output_token_ids) >= request.max_tokens:
                self.scheduler.finish(request, "length")
            if request.finished:
                self.done[request.req_id] = list(request.output_token_ids)
                self.gone.append(request)
                del self.requests[request.req_id]
                return


def check_blocks(scheduler: Scheduler, gone: list[Request], max_pending: int = 1,
                 shared_cached: bool = True) -> None:
    """After a step: every running request's blocks (each table's) counted once, waiting
    and finished ones holding none, reference counts, the free list and the prefix cache
    exact; at most ``max_pending`` tokens pending a request (1, or 1 + drafts); a block held
    twice is a cached one (``shared_cached``: unless the cache was reset meanwhile)."""
    blocks = scheduler.blocks
    holders = [0] * blocks.num_blocks
    tables = scheduler.tables
    for request in scheduler.running:
        assert request.status is RequestStatus.RUNNING
        held = tables.held_hits(tables.tables(request),
                                request.held_from or [0] * tables.num_tables)
        assert len(set(held)) == len(held)
        assert all(len(ids) == len(request.block_ids) for ids in tables.tables(request))
        assert request.num_computed_tokens <= len(request.block_ids) * blocks.block_size
        for block in held:
            holders[block] += 1
    for request in scheduler.waiting:
        assert request.status is RequestStatus.WAITING
        assert request.block_ids == [] and request.num_computed_tokens == 0
        assert not any(request.extra_block_ids)
    for request in [*scheduler.running, *scheduler.waiting]:
        assert 0 <= request.num_computed_tokens <= request.num_tokens
        assert 0 <= request.num_pending <= max_pending
    for request in gone:
        assert request.finished and request.block_ids == []
    assert holders == blocks.ref_count
    for block, count in enumerate(holders):
        if count > 1 and shared_cached:
            assert blocks.block_hash[block] is not None, "shared block not from the cache"
    free = [b for b in range(blocks.num_blocks) if holders[b] == 0]
    assert sorted(blocks._free) == free
    assert blocks.num_free_blocks + sum(1 for c in holders if c) == blocks.num_blocks
    for block_hash, block in blocks._cached.items():
        assert blocks.block_hash[block] == block_hash
    if not blocks.enable_caching:
        assert not blocks._cached


def check_invariants(engine: FakeEngine, out: SchedulerOutput, config: SchedulerConfig) -> None:
    check_blocks(engine.scheduler, engine.gone)
    assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= config.max_num_seqs
    assert all(n > 0 for n in out.num_scheduled_tokens.values())
    assert set(out.num_scheduled_tokens) <= engine.scheduled_running


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_scheduler_invariants_and_outputs(data: st.DataObject) -> None:
    block_size = data.draw(st.sampled_from([1, 2, 4]), label="block_size")
    num_blocks = data.draw(st.integers(4, 24), label="num_blocks")
    config = SchedulerConfig(
        max_num_seqs=data.draw(st.integers(1, 6), label="max_num_seqs"),
        max_num_batched_tokens=data.draw(st.integers(1, 24), label="budget"),
        async_scheduling=data.draw(st.booleans(), label="async"),
        policy=data.draw(st.sampled_from(["fcfs", "priority"]), label="policy"),
    )
    caching = data.draw(st.booleans(), label="caching")
    images = data.draw(st.booleans(), label="images")
    window = data.draw(st.integers(1, 7), label="window")
    if data.draw(st.booleans(), label="chunked"):  # chunked local attention's tables
        window = AttentionChunk(window)
    windows = data.draw(st.sampled_from([(None,), (None, window), (window,),
                                         (None, window, window)]), label="tables")
    blocks = BlockManager(num_blocks, block_size, enable_caching=caching)
    scheduler = Scheduler(config, blocks, table_windows=windows)
    runner = FakeRunner(block_size, num_blocks, windows)
    engine = FakeEngine(scheduler, runner, config.async_scheduling)
    added: dict[str, tuple[list[int], int]] = {}
    aborted: set[str] = set()
    num_steps = data.draw(st.integers(1, 40), label="steps")
    for step in range(num_steps + 20_000):
        if step < num_steps:
            for _ in range(data.draw(st.integers(0, 2))):
                prefix = data.draw(st.integers(0, len(BASE)))
                tail = data.draw(st.lists(st.integers(1, 3), max_size=6))
                prompt = BASE[:prefix] + tail or [1]
                max_tokens = data.draw(st.integers(1, 8))
                if scheduler.most_blocks(len(prompt) + max_tokens) > num_blocks:
                    continue  # the engine rejects it up front
                req_id = f"r{len(added)}"
                items = []  # at most two images (their tokens named by their content)
                if images and data.draw(st.booleans()):
                    cuts = sorted(data.draw(st.lists(st.integers(0, len(prompt)), min_size=2,
                                                     max_size=4, unique=True)))
                    for a, b in zip(cuts[::2], cuts[1::2], strict=False):
                        if b - a <= config.max_num_batched_tokens:  # (else refused up front)
                            items.append(MultiModalItem("image", None, f"i{prompt[a:b]}", a,
                                                        b - a, bidirectional=True))
                engine.add(req_id, prompt, max_tokens, data.draw(st.integers(0, 3)), items)
                added[req_id] = (prompt, max_tokens)
            if engine.requests and data.draw(st.integers(0, 5)) == 0:
                req_id = data.draw(st.sampled_from(sorted(engine.requests)))
                engine.abort(req_id)
                aborted.add(req_id)
        elif not engine.has_unfinished():
            break
        out = engine.step()
        check_invariants(engine, out, config)
    assert not engine.has_unfinished(), "requests never finished (deadlock)"
    event(f"cache hits: {blocks.num_hit_tokens > 0}")
    event(f"preemptions: {engine.scheduler.num_preemptions > 0}")
    event(f"aborts: {bool(aborted)}")
    event(f"images: {images}")
    event(f"tables: {len(windows)}, sliding: {windows[-1] is not None}, "
          f"chunked: {isinstance(window, AttentionChunk)}")
    assert runner.rows == {}
    assert blocks.num_free_blocks == num_blocks and not any(blocks.ref_count)
    for req_id, (prompt, max_tokens) in added.items():
        if req_id in aborted:
            assert req_id not in engine.done
        else:
            assert engine.done[req_id] == expected_output(prompt, max_tokens), req_id
