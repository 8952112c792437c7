"""Seeded stress of Scheduler + BlockManager over what ``test_scheduler_property.py`` leaves
out: cache salts and LoRA adapters (whose KV must never be shared across them), ``max_loras``,
prompt-logprob requests (which read no cached block), ``n`` copies of one prompt at once,
``preempt_all`` (a pause that recomputes), ``forget_cached`` (a weight update), the drafter's
lookahead slots, ``max_model_len``, chunked prefill off, a small ``max_waiting``, and the
snapshot slots of a model with per-request recurrent state (:mod:`mrv2.engine.state_snapshots`).

A fake runner writes each computed position's "KV" as (token, salt and adapter, weights
version) and checks every position a step attends to; with snapshots it keeps a fake state (a
hash of the tokens so far, under the weights' version), stores it at the positions the
scheduler plans, and checks every state a hit resumes from. After every step the blocks'
reference counts and free list are exact; at the end nothing leaks, every request that was not
aborted has the tokens it would produce alone, and the prefix-cache counters count exactly the
tokens the hits skipped.
"""

from __future__ import annotations

import random

import pytest
from test_scheduler_property import (
    BASE,
    FakeEngine,
    apply_tables,
    check_blocks,
    expected_output,
    next_token,
)

from mrv2.config import SchedulerConfig
from mrv2.contract.lora import LoRARequest
from mrv2.contract.params import SamplingParams
from mrv2.contract.requests import SchedulerOutput
from mrv2.engine.block_manager import BlockManager
from mrv2.engine.request import Request
from mrv2.engine.scheduler import Scheduler
from mrv2.engine.state_snapshots import StateSnapshots

_MOD = (1 << 61) - 1


def _advance(state: int, token: int, version: int) -> int:
    return (state * 1_000_003 + token + 7 + 13 * version) % _MOD


def _state_of(tokens: list[int], version: int) -> int:
    state = 1
    for token in tokens:
        state = _advance(state, token, version)
    return state


class TaggedRunner:
    """A fake runner whose KV names the request's salt and adapter and the weights' version,
    and (``snapshots``) keeps a fake recurrent state per row and in snapshot slots."""

    def __init__(self, block_size: int, tags: dict[str, tuple[str | None, int | None]],
                 snapshots: bool) -> None:
        self.size = block_size
        self.tags = tags
        self.snapshots = snapshots
        self.rows: dict = {}
        self.kv: dict[tuple[int, int], tuple[int, object, int, int]] = {}
        self.version = 0
        self.admitted_at: dict[str, int] = {}
        self.first_hit: dict[str, int] = {}
        self.slots: dict[int, int] = {}
        self.states: dict[str, list] = {}  # req_id -> [state or None, state_table_row]

    def remove(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            del self.rows[req_id]
            self.states.pop(req_id, None)

    def execute(self, out: SchedulerOutput) -> dict[str, int]:
        for req_id in out.finished_req_ids:
            self.states.pop(req_id, None)
        apply_tables(self.rows, 1, out)
        for new in out.new_requests:
            self.admitted_at[new.req_id] = self.version
            self.first_hit.setdefault(new.req_id, new.num_computed_tokens)
            self.states[new.req_id] = [None, new.state_table_row]
        reads: set[int] = set()
        writes: list[int] = []
        sampled = {}
        size = self.size
        for req_id, n in out.num_scheduled_tokens.items():
            row = self.rows[req_id]
            assert 0 < n <= len(row.tokens) - row.computed
            start = row.computed
            if self.snapshots:
                self._run_state(req_id, row.tokens, start, n, reads, writes)
            blocks, tag = row.tables[0], self.tags[req_id]
            for pos in range(start, start + n):
                self.kv[blocks[pos // size], pos % size] = (row.tokens[pos], tag, self.version,
                                                            pos)
            row.computed += n
            for pos in range(row.computed):
                got = self.kv.get((blocks[pos // size], pos % size))
                assert got is not None and got[:2] == (row.tokens[pos], tag) and got[3] == pos, (
                    f"{req_id}: wrong KV at {pos}: {got}")
                assert got[2] >= self.admitted_at[req_id], f"{req_id}: old weights' KV at {pos}"
            if row.computed == len(row.tokens):
                token = next_token(row.tokens)
                row.tokens.append(token)
                sampled[req_id] = token
        assert len(writes) == len(set(writes)), f"two stores into one slot in a step: {writes}"
        assert not reads & set(writes), "a slot read and stored in the same step"
        return sampled

    def _run_state(self, req_id: str, tokens: list[int], start: int, n: int, reads: set[int],
                   writes: list[int]) -> None:
        entry = self.states[req_id]
        state, table = entry
        if state is None:  # the request's first chunk: from the start, or from a snapshot
            if start == 0:
                state = 1
            else:
                assert table is not None and table[0] >= 0 and table[1] == start, (
                    f"{req_id}: starts at {start} without a snapshot ({table})")
                state = self.slots.get(table[0])
                reads.add(table[0])
                assert state == _state_of(tokens[:start], self.version), (
                    f"{req_id}: a wrong snapshot at {start}")
        saves = {} if table is None else {table[k]: table[k + 1] for k in (2, 4)
                                          if table[k] >= 0}
        for pos in range(start, start + n):
            state = _advance(state, tokens[pos], self.version)
            if pos + 1 in saves:
                self.slots[saves[pos + 1]] = state
                writes.append(saves[pos + 1])
        entry[0] = state


def _run(seed: int) -> tuple[int, int, int]:
    rng = random.Random(seed)
    size = rng.choice([1, 2, 4])
    num_blocks = rng.randint(3, 20)
    chunked = rng.random() < 0.8
    config = SchedulerConfig(
        max_num_seqs=rng.randint(1, 5), max_num_batched_tokens=rng.randint(1, 20),
        async_scheduling=rng.random() < 0.5, policy=rng.choice(["fcfs", "priority"]),
        enable_chunked_prefill=chunked, max_waiting=rng.randint(1, 30))
    caching = rng.random() < 0.85
    max_model_len = rng.choice([None, rng.randint(4, 40)])
    blocks = BlockManager(num_blocks, size, enable_caching=caching)
    scheduler = Scheduler(config, blocks, max_model_len=max_model_len,
                          num_lookahead_tokens=rng.choice([0, 0, 1, 3]))
    scheduler.max_loras = rng.choice([None, 1, 2])
    snapshots = caching and rng.random() < 0.5
    if snapshots:
        scheduler.snapshots = StateSnapshots(rng.randint(1, 4), size)
    tags: dict[str, tuple[str | None, int | None]] = {}
    runner = TaggedRunner(size, tags, snapshots)
    engine = FakeEngine(scheduler, runner, config.async_scheduling)
    added: dict[str, tuple[list[int], int, bool]] = {}
    aborted: set[str] = set()
    num_steps = rng.randint(1, 40)
    for step in range(num_steps + 5000):
        if step < num_steps:
            for _ in range(rng.randint(0, 3)):
                prompt = (BASE[:rng.randint(0, len(BASE))]
                          + [rng.randint(1, 3) for _ in range(rng.randint(0, 5))]) or [1]
                max_tokens = rng.randint(1, 8)
                if max_model_len is not None:  # (the engine's checks)
                    if len(prompt) >= max_model_len:
                        continue
                    max_tokens = min(max_tokens, max_model_len - len(prompt))
                if not chunked and len(prompt) > config.max_num_batched_tokens:
                    continue
                if scheduler.most_blocks(len(prompt) + max_tokens) > num_blocks:
                    continue
                salt = rng.choice([None, None, "a", "b"])
                lora = rng.choice([None, None, 1, 2, 3]) if scheduler.max_loras else None
                prompt_logprobs = rng.random() < 0.15
                copies = rng.choice([1, 1, 1, 2, 3])
                if len(scheduler.waiting) + copies > config.max_waiting:
                    with pytest.raises(RuntimeError, match="waiting queue full"):
                        scheduler.check_room(copies)
                    continue
                for _ in range(copies):
                    req_id = f"r{len(added)}"
                    request = Request(
                        req_id=req_id, prompt_token_ids=list(prompt),
                        sampling_params=SamplingParams(
                            temperature=0.0, prompt_logprobs=1 if prompt_logprobs else None),
                        seed=0, eos_token_ids=frozenset(), max_tokens=max_tokens,
                        priority=rng.randint(0, 3), cache_salt=salt,
                        lora_request=LoRARequest(f"a{lora}", lora, "/a") if lora else None)
                    tags[req_id] = (salt, lora)
                    scheduler.add(request)
                    engine.requests[req_id] = request
                    added[req_id] = (prompt, max_tokens, prompt_logprobs)
            if engine.requests and rng.randint(0, 5) == 0:
                req_id = rng.choice(sorted(engine.requests))
                engine.abort(req_id)
                aborted.add(req_id)
            if not engine.in_flight and rng.randint(0, 8) == 0:
                scheduler.preempt_all()
            if not engine.in_flight and rng.randint(0, 10) == 0:
                scheduler.forget_cached()  # (the engine updates weights between steps)
                runner.version += 1
        elif not engine.has_unfinished():
            break
        out = engine.step()
        check_blocks(scheduler, engine.gone, shared_cached=not runner.version)
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= config.max_num_seqs
        if scheduler.max_loras:
            live = {r.lora_request.lora_int_id for r in scheduler.running if r.lora_request}
            assert len(live) <= scheduler.max_loras
    assert not engine.has_unfinished(), "requests never finished (deadlock)"
    assert runner.rows == {}
    assert blocks.num_free_blocks == num_blocks and not any(blocks.ref_count)
    for req_id, (prompt, max_tokens, _) in added.items():
        if req_id not in aborted:
            assert engine.done[req_id] == expected_output(prompt, max_tokens), req_id
    hits = {req_id: n for req_id, n in runner.first_hit.items() if n}
    assert all(n < len(added[req_id][0]) and not added[req_id][2] for req_id, n in hits.items())
    assert blocks.num_hit_tokens == sum(hits.values())
    assert blocks.num_queried_tokens == (caching and sum(
        len(added[req_id][0]) for req_id in runner.first_hit if not added[req_id][2]))
    resumed = scheduler.snapshots.num_resumed if scheduler.snapshots else 0
    return len(hits), scheduler.num_preemptions, resumed


def test_scheduler_stress_salts_adapters_pauses_updates_and_snapshots() -> None:
    hits = preemptions = resumed = 0
    for seed in range(300):
        h, p, r = _run(seed)
        hits, preemptions, resumed = hits + h, preemptions + p, resumed + r
    assert hits and preemptions and resumed  # (the cases it is for happened)
