"""Property test of Scheduler + BlockManager with speculative drafts, without a model.

The drafts' counterpart of ``test_scheduler_property.py`` (whose fake model and expected
outputs it reuses). A decode request is scheduled its last token and ``k`` drafts; until the
step's result arrives the scheduler counts every draft as kept, and ``Scheduler.correct`` takes
back the rejected ones. A fake runner guesses each draft right or wrong (a seeded random
acceptance), writes the "KV" of every scheduled position, drafts included, into a fake paged
cache through each of the request's block tables (sliding-window and chunked-attention tables
too), and checks for every query of every step that each position it attends to lies in a
block the request still holds and holds the right token. That is what the tables' ``margin``
(the drafts a result may take back) is for: with async scheduling the scheduler frees a
sliding table's blocks from a computed count that may still hold rejected drafts. A fake
engine loop feeds the accepted tokens back one step late (async) or at once (sync), with
arrivals, aborts, prefix caching and preemption; block reference counts and the free list are
checked after every step, every request that was not aborted must end with exactly the tokens
it would produce alone, and no block may leak.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler_property import (
    BASE,
    STOP,
    FakeEngine,
    Row,
    apply_tables,
    check_blocks,
    expected_output,
    next_token,
)

from mrv2.config import SchedulerConfig
from mrv2.contract.kv_cache import AttentionChunk, first_visible
from mrv2.contract.requests import SchedulerOutput
from mrv2.engine.block_manager import BlockManager
from mrv2.engine.scheduler import Scheduler


@dataclass
class Stats:
    """What a run exercised (the tests assert the cases they are for happened)."""

    drafts: int = 0
    rejected: int = 0
    freed: int = 0
    hit_tokens: int = 0
    preemptions: int = 0
    aborts: int = 0


@dataclass
class Step:
    """What the engine gets before one step: new requests (prompt, max_tokens) and, maybe,
    the index (modulo their number) of the live request to abort."""

    arrivals: list[tuple[list[int], int]]
    abort: int | None = None


@dataclass
class Case:
    """One run: the block pool, the scheduler (``k`` drafts per decode), the model's block
    tables' windows, the drafts' acceptance (rate and seed) and the workload, step by step."""

    block_size: int
    num_blocks: int
    num_speculative_tokens: int
    config: SchedulerConfig
    caching: bool
    windows: tuple[int | None, ...]
    p_accept: float
    seed: int
    steps: list[Step]


@dataclass
class DraftRunner:
    """The device side: each scheduled request's table rows, KV and sampled tokens."""

    block_size: int
    windows: tuple[int | None, ...]
    scheduler: Scheduler
    accept: Callable[[], bool]
    stats: Stats
    rows: dict[str, Row] = field(default_factory=dict)
    kv: dict[tuple[int, int], int] = field(default_factory=dict)

    def remove(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            del self.rows[req_id]

    def execute(self, out: SchedulerOutput) -> dict[str, tuple[list[int], int]]:
        """Run a step; per request that sampled: its kept tokens and its drafts' count."""
        apply_tables(self.rows, len(self.windows), out)
        assert set(out.num_draft_tokens) <= set(out.num_scheduled_tokens)
        running = {r.req_id: r for r in self.scheduler.running}
        size = self.block_size
        sampled = {}
        for req_id, n in out.num_scheduled_tokens.items():
            row, request = self.rows[req_id], running[req_id]
            assert row.tables == self.scheduler.tables.tables(request)
            held_from = request.held_from or [0] * len(self.windows)
            num_drafts = out.num_draft_tokens.get(req_id, 0)
            self.stats.drafts += num_drafts
            real = n - num_drafts  # (the scheduler counts drafts in flight as kept: not these)
            assert 0 < real <= len(row.tokens) - row.computed, (req_id, n, num_drafts)
            assert not num_drafts or real == 1, "drafts follow a decode's one token"
            first = row.computed
            tokens = row.tokens[: first + real]
            drafts: list[int] = []  # the continuation, or a wrong guess
            for _ in range(num_drafts):
                true = next_token(tokens + drafts)
                drafts.append(true if self.accept() else true % 6 + 1)
            tokens += drafts
            end = len(tokens)
            for t, blocks in enumerate(row.tables):
                assert len(blocks) * size >= end, f"{req_id}: no block for position {end - 1}"
                for pos in range(first, end):
                    assert pos // size >= held_from[t], f"{req_id}: writes a freed block"
                    self.kv[blocks[pos // size], pos % size] = tokens[pos]
            for t, (blocks, window) in enumerate(zip(row.tables, self.windows, strict=True)):
                for query in range(first, end):  # every query of the step, drafts' too
                    for pos in range(first_visible(query, window), query + 1):
                        assert pos // size >= held_from[t], (
                            f"{req_id}: query {query} reads position {pos}, in a block freed "
                            f"(window {window!r}, held from entry {held_from[t]})")
                        assert self.kv.get((blocks[pos // size], pos % size)) == tokens[pos], (
                            f"{req_id}: stale KV at position {pos} for query {query} "
                            f"(window {window!r})")
            row.computed = first + real
            if row.computed == len(row.tokens):  # it samples: verify the drafts, then one more
                kept = []
                for guess in drafts:
                    if guess != next_token(row.tokens):
                        self.stats.rejected += 1
                        break
                    row.tokens.append(guess)
                    row.computed += 1
                    kept.append(guess)
                    if guess == STOP:
                        break
                kept.append(next_token(row.tokens))
                row.tokens.append(kept[-1])
                sampled[req_id] = (kept, num_drafts)
            else:
                assert not num_drafts
        return sampled


class DraftEngine(FakeEngine):
    """:class:`FakeEngine` whose runner's results carry drafts: each request's kept tokens
    and its draft count, the rejected drafts taken back (``Scheduler.correct``)."""

    def _process(self, sampled: Any) -> None:
        """A step's result: ``{req_id: (kept tokens, drafts scheduled)}``."""
        for req_id, (tokens, num_drafts) in sampled.items():
            request = self.requests.get(req_id)
            if request is None:
                continue
            if num_drafts:
                self.scheduler.correct(request, num_drafts, len(tokens) - 1)
            request.num_pending -= len(tokens)
            self._deliver(request, tokens)


def check_invariants(engine: DraftEngine, out: SchedulerOutput, case: Case) -> None:
    """Block reference counts, the free list and the step's limits, after a step."""
    check_blocks(engine.scheduler, engine.gone, 1 + case.num_speculative_tokens)
    assert out.total_num_scheduled_tokens <= case.config.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= case.config.max_num_seqs
    assert all(0 < d <= case.num_speculative_tokens for d in out.num_draft_tokens.values())


def run(case: Case) -> Stats:
    """Serve the case's requests to the end, checking every step; what it exercised."""
    blocks = BlockManager(case.num_blocks, case.block_size, enable_caching=case.caching)
    scheduler = Scheduler(case.config, blocks, case.num_speculative_tokens,
                          table_windows=case.windows)
    rng = random.Random(case.seed)
    stats = Stats()
    runner = DraftRunner(case.block_size, case.windows, scheduler,
                         lambda: rng.random() < case.p_accept, stats)
    engine = DraftEngine(scheduler, runner, case.config.async_scheduling)
    added: dict[str, tuple[list[int], int]] = {}
    aborted: set[str] = set()
    for step in range(len(case.steps) + 5_000):
        if step < len(case.steps):
            for prompt, max_tokens in case.steps[step].arrivals:
                if scheduler.most_blocks(len(prompt) + max_tokens) > case.num_blocks:
                    continue  # the engine rejects it up front
                req_id = f"r{len(added)}"
                engine.add(req_id, prompt, max_tokens)
                added[req_id] = (prompt, max_tokens)
            index = case.steps[step].abort
            if index is not None and engine.requests:
                live = sorted(engine.requests)
                req_id = live[index % len(live)]
                engine.abort(req_id)
                aborted.add(req_id)
        elif not engine.has_unfinished():
            break
        out = engine.step()
        check_invariants(engine, out, case)
    assert not engine.has_unfinished(), "requests never finished (deadlock)"
    assert runner.rows == {}
    assert blocks.num_free_blocks == case.num_blocks and not any(blocks.ref_count)
    for req_id, (prompt, max_tokens) in added.items():
        if req_id in aborted:
            assert req_id not in engine.done
        else:
            assert engine.done[req_id] == expected_output(prompt, max_tokens), req_id
    stats.freed = scheduler.tables.num_freed
    stats.hit_tokens = blocks.num_hit_tokens
    stats.preemptions = scheduler.num_preemptions
    stats.aborts = len(aborted)
    return stats


def random_step(rng: random.Random) -> Step:
    """Up to two arrivals (a prefix of :data:`BASE` and up to six tokens of 1-3, 1-12 tokens
    to generate) and, one step in eight, an abort. (Drawn from a seed rather than by
    Hypothesis token by token: Hypothesis' draws of every step's lists cost more than serving
    the workload, and the examples' count is what finds the scheduler's rare interleavings.)"""
    arrivals = []
    for _ in range(rng.randint(0, 2)):
        tail = [rng.randint(1, 3) for _ in range(rng.randint(0, 6))]
        arrivals.append((BASE[:rng.randint(0, len(BASE))] + tail or [1], rng.randint(1, 12)))
    abort = rng.randint(0, 31)
    return Step(arrivals, abort if abort < 4 else None)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """A model's block tables, a scheduler with drafts, an acceptance rate and a workload."""
    k = draw(st.integers(1, 4), label="k")
    window: int = draw(st.integers(1, 17), label="window")
    if draw(st.booleans(), label="chunked"):
        window = AttentionChunk(window)
    num_steps = draw(st.integers(1, 30), label="steps")
    workload = random.Random(draw(st.integers(0, 2**32 - 1), label="workload"))
    return Case(
        block_size=draw(st.sampled_from([1, 2, 4]), label="block_size"),
        num_blocks=draw(st.integers(6, 80), label="num_blocks"),
        num_speculative_tokens=k,
        config=SchedulerConfig(
            max_num_seqs=draw(st.integers(1, 4), label="max_num_seqs"),
            max_num_batched_tokens=draw(st.integers(k + 1, 24), label="budget"),
            async_scheduling=draw(st.booleans(), label="async"),
            policy=draw(st.sampled_from(["fcfs", "priority"]), label="policy"),
        ),
        caching=draw(st.booleans(), label="caching"),
        windows=draw(st.sampled_from([(None,), (None, window), (window,),
                                      (None, window, window)]), label="tables"),
        p_accept=draw(st.floats(0, 1), label="p_accept"),
        seed=draw(st.integers(0, 2**16), label="seed"),
        steps=[random_step(workload) for _ in range(num_steps)],
    )


def test_drafts_scheduler_invariants_and_outputs() -> None:
    """Random workloads with drafts over every kind of block table, sync and async: every
    step's queries read only held blocks with the right KV, reference counts hold, outputs
    match, nothing leaks; across the (derandomized) examples drafts were rejected, windows
    freed blocks, requests were preempted, hit the prefix cache and were aborted."""
    total = Stats()

    @settings(max_examples=1500, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases())
    def check(case: Case) -> None:
        stats = run(case)
        for name in vars(total):
            setattr(total, name, getattr(total, name) + getattr(stats, name))

    check()
    assert total.drafts and total.rejected and total.freed, total
    assert total.preemptions and total.hit_tokens and total.aborts, total


@pytest.mark.parametrize("window", [2, AttentionChunk(2)], ids=["sliding", "chunked"])
def test_rejected_drafts_in_a_window(window: int) -> None:
    """A workload chosen to reject drafts (seeded, half accepted) with async scheduling while a
    window frees blocks, two requests share a prefix and a third preempts them, one aborted:
    the rejected drafts' positions stay held (the tables' margin) and every check holds."""
    case = Case(block_size=2, num_blocks=20, num_speculative_tokens=3,
                config=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8,
                                       async_scheduling=True),
                caching=True, windows=(None, window), p_accept=0.5, seed=0,
                steps=[Step([(BASE[:9], 12), (BASE[:9], 12)]), Step([(BASE[:12], 12)]),
                       Step([(BASE, 12)], abort=2)])
    stats = run(case)
    assert stats.rejected and stats.freed and stats.hit_tokens, stats
    assert stats.preemptions and stats.aborts, stats
