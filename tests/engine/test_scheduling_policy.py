"""Scheduling policy: priority admission, preemption victims, decodes before prefills."""

from __future__ import annotations

from pathlib import Path

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.config import SchedulerConfig
from mrv2.contract.requests import SchedulerOutput
from mrv2.engine.block_manager import BlockManager
from mrv2.engine.request import Request, RequestStatus
from mrv2.engine.scheduler import Scheduler
from mrv2.testing import make_tiny_checkpoint


def _scheduler(policy: str, num_blocks: int = 64, block_size: int = 2, **kwargs: int) -> Scheduler:
    config = SchedulerConfig(policy=policy, **kwargs)  # type: ignore[arg-type]
    return Scheduler(config, BlockManager(num_blocks, block_size))


def _request(
    req_id: str, prompt_len: int, priority: int = 0, max_tokens: int = 8, first: int = 1
) -> Request:
    return Request(req_id=req_id, prompt_token_ids=[first + i % 9 for i in range(prompt_len)],
                   sampling_params=SamplingParams(temperature=0.0), seed=0,
                   eos_token_ids=frozenset(), max_tokens=max_tokens, priority=priority)


def _step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule, then deliver every sampled token at once (synchronous engine)."""
    out = scheduler.schedule()
    for request in scheduler.running:
        while request.num_pending:
            request.num_pending -= 1
            request.output_token_ids.append(7)
    return out


@pytest.mark.parametrize(("policy", "first"), [("priority", "urgent"), ("fcfs", "a")])
def test_late_high_priority_request_is_admitted_first(policy: str, first: str) -> None:
    scheduler = _scheduler(policy, max_num_seqs=1)
    scheduler.add(_request("a", 4, priority=5))
    scheduler.add(_request("b", 4, priority=5))
    scheduler.add(_request("urgent", 4, priority=0))
    out = _step(scheduler)
    assert [r.req_id for r in out.new_requests] == [first]
    if policy == "priority":
        assert [r.req_id for r in scheduler.waiting] == ["a", "b"]


def test_priority_ties_keep_arrival_order() -> None:
    scheduler = _scheduler("priority")
    for i, priority in enumerate([2, 1, 2, 1, 0]):
        scheduler.add(_request(f"r{i}", 3, priority=priority))
    assert [r.req_id for r in scheduler.waiting] == ["r4", "r1", "r3", "r0", "r2"]


@pytest.mark.parametrize(("policy", "victim"), [("priority", "b"), ("fcfs", "c")])
def test_preemption_victim(policy: str, victim: str) -> None:
    # 3 requests x 2 blocks fill the 6 blocks; the next block any of them needs preempts one.
    scheduler = _scheduler(policy, num_blocks=6)
    for req_id, priority in [("a", 0), ("b", 2), ("c", 1)]:
        scheduler.add(_request(req_id, 2, priority=priority))
    for _ in range(3):
        _step(scheduler)
    assert scheduler.blocks.num_free_blocks == 0 and scheduler.num_preemptions == 0
    out = _step(scheduler)
    assert scheduler.num_preemptions == 1
    assert [r.req_id for r in scheduler.waiting] == [victim]
    preempted = scheduler.waiting[0]
    assert preempted.status is RequestStatus.WAITING and preempted.block_ids == []
    assert victim not in out.num_scheduled_tokens
    assert victim in out.finished_req_ids  # its runner row goes at once
    assert sorted(out.num_scheduled_tokens) == sorted({"a", "b", "c"} - {victim})


def test_priority_preempts_a_request_already_scheduled_this_step() -> None:
    """The victim may be a decode scheduled earlier in the step: its tokens are taken back."""
    scheduler = _scheduler("priority", num_blocks=8, max_num_batched_tokens=8)
    scheduler.add(_request("low", 2, priority=9, first=20))  # a decode by the time "high" prefills
    _step(scheduler)
    _step(scheduler)
    scheduler.add(_request("high", 12, priority=0, max_tokens=2))  # a chunked prefill
    for _ in range(6):
        out = _step(scheduler)
        assert out.total_num_scheduled_tokens <= 8
        if scheduler.num_preemptions:
            break
    assert scheduler.num_preemptions == 1
    assert "low" not in out.num_scheduled_tokens and "high" in out.num_scheduled_tokens
    assert "low" not in out.new_block_ids and "low" in out.finished_req_ids
    low = scheduler.waiting[0]
    assert low.req_id == "low" and low.num_pending == 0 and low.num_computed_tokens == 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_decodes_are_not_starved_by_prefills(policy: str) -> None:
    scheduler = _scheduler(policy, max_num_batched_tokens=6)
    scheduler.add(_request("decode", 2, priority=5, max_tokens=30))
    _step(scheduler)
    scheduler.add(_request("long", 40, priority=0))
    for _ in range(6):
        out = _step(scheduler)
        assert out.num_scheduled_tokens["decode"] == 1
        assert out.num_scheduled_tokens["long"] == 5  # the rest of the budget: chunked


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    checkpoint: Path = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "LlamaForCausalLM")
    return LLM(str(checkpoint), device="cpu", dtype="float32", block_size=4, policy="priority",
               max_waiting=3)


def test_engine_priority_and_overload(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3)
    engine.add_request([1, 2, 3], params, request_id="x", priority=3)
    engine.add_request([4, 5, 6], params, request_id="y", priority=1)
    engine.add_request([7, 8, 9], params, request_id="z", priority=2)
    assert [r.req_id for r in engine.scheduler.waiting] == ["y", "z", "x"]
    with pytest.raises(RuntimeError, match="waiting queue full"):
        engine.add_request([1, 2], params, request_id="w")
    assert engine.stats()["num_waiting"] == 3
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["kv_usage"] == 0.0


def test_a_nonzero_priority_is_refused_under_fcfs(tmp_path: Path) -> None:
    """vLLM's rule: a priority other than 0 needs the "priority" policy; under "fcfs" the
    engine and ``LLM.generate`` refuse it (ValueError naming it), nothing queued. It was taken
    and ignored: the request ran in arrival order."""
    checkpoint: Path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    llm = LLM(str(checkpoint), device="cpu", dtype="float32", block_size=4)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(ValueError, match="Got priority 3 but Priority scheduling is not "
                       "enabled: the scheduling policy is 'fcfs'"):
        engine.add_request([1, 2, 3], params, request_id="x", priority=3)
    with pytest.raises(ValueError, match="priority must be an integer"):
        engine.add_request([1, 2, 3], params, request_id="x", priority=1.5)  # type: ignore[arg-type]
    assert not engine.has_unfinished()
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    with pytest.raises(ValueError, match="Got priority -1 but Priority scheduling"):
        llm.generate(prompts, params, use_tqdm=False, priority=[0, -1])
    assert not engine.has_unfinished()
    assert len(llm.generate(prompts, params, use_tqdm=False, priority=[0, 0])) == 2


def test_samples_of_a_request_are_queued_all_or_none(llm: LLM) -> None:
    """``n=2`` with room for one more request in the waiting queue: refused whole, nothing
    queued, its id free for the retry. The first sample was queued, then the second refused:
    the first ran for nobody (its output merged into a parent that never completed) and the
    id stayed in use for good."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=3)
    engine.add_request([1, 2, 3], params, request_id="x")
    engine.add_request([4, 5, 6], params, request_id="y")
    two = SamplingParams(top_k=1, max_tokens=3, n=2)  # (greedy takes n=1 only, as vLLM's)
    with pytest.raises(RuntimeError, match="waiting queue full"):
        engine.add_request([7, 8], two, request_id="w")
    assert [r.req_id for r in engine.scheduler.waiting] == ["x", "y"]
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert sorted(o.request_id for o in outputs) == ["x", "y"]
    engine.add_request([7, 8], two, request_id="w")  # (the retry)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [(o.request_id, len(o.outputs)) for o in outputs] == [("w", 2)]


def test_one_token_left_in_the_budget_never_ends_a_step_inside_an_image() -> None:
    """A running request at the start of a bidirectional image of 2 tokens, with 1 token of
    budget left after two decodes: it waits rather than computing half the image (the
    one-token case used to skip the check), and takes the image whole once there is room."""
    from mrv2.contract.requests import MultiModalItem

    scheduler = _scheduler("fcfs", max_num_batched_tokens=3)
    scheduler.add(_request("a", 1, max_tokens=6, first=10))
    scheduler.add(_request("b", 1, max_tokens=6, first=30))
    _step(scheduler)
    image = _request("img", 5, first=50)
    image.mm_items = [MultiModalItem("image", None, "h", 3, 2, bidirectional=True)]
    scheduler.add(image)
    steps = [_step(scheduler).num_scheduled_tokens for _ in range(8)]
    assert [s.get("img", 0) for s in steps[:3]] == [1, 1, 1]  # positions 0, 1, 2
    assert steps[3] == {"a": 1, "b": 1}  # (img at 3: one token would end inside the image)
    whole = [s.get("img", 0) for s in steps].index(2)  # the image whole, after a and b end
    assert all("img" not in s for s in steps[3:whole])


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_an_image_waiting_for_room_is_not_starved_by_later_decodes(policy: str) -> None:
    """A running request at a bidirectional image as long as the budget, under a steady
    load of short requests: once the decodes admitted before it end, it takes the image
    whole. The decodes went first every step, and the requests admitted after it (with the
    budget the skipped image left) were decodes too: the image never ran."""
    from mrv2.contract.requests import MultiModalItem

    scheduler = _scheduler(policy, max_num_batched_tokens=3)
    scheduler.add(_request("a", 1, max_tokens=6, first=10))
    _step(scheduler)
    image = _request("img", 4, first=50, max_tokens=2)
    image.mm_items = [MultiModalItem("image", None, "h", 1, 3, bidirectional=True)]
    scheduler.add(image)
    scheduled = []
    for i in range(40):
        if i % 2 == 0:  # (a load the budget serves: the queue stays short)
            scheduler.add(_request(f"x{i}", 1, max_tokens=4, first=20 + i % 9))
        scheduled.append(_step(scheduler).num_scheduled_tokens.get("img", 0))
        for request in list(scheduler.running):
            if request.num_output_tokens >= request.max_tokens:
                scheduler.finish(request, "length")
        assert len(scheduler.waiting) <= 1
    assert scheduled[0] == 1  # its first token, then the image whole once "a" is done
    assert 3 in scheduled[:8] and image.finished


def test_a_request_the_pool_holds_with_the_lookahead_is_scheduled() -> None:
    """A drafter's lookahead (3 slots past each step's tokens) counts in the blocks a request
    needs: a pool of :meth:`Scheduler.most_blocks` blocks admits a lone request. The bound had
    left the lookahead out: a one-token prompt passed the engine's check on 3 blocks of one
    slot, then waited forever for the 4 its first step holds, never admitted, never
    preempted; the engine now refuses it up front."""
    config = SchedulerConfig(max_num_batched_tokens=2)

    def scheduler(num_blocks: int) -> Scheduler:
        return Scheduler(config, BlockManager(num_blocks, 1), num_lookahead_tokens=3,
                         max_model_len=64)

    big = scheduler(64)
    needed = big.most_blocks(1 + 1)
    assert needed == 5  # the prompt, its output and 3 lookahead slots (one token to spare)
    assert big.tables.most_held(1 + 1, big.max_step_tokens) == 2  # (the old bound)
    for num_blocks, admitted in [(needed, ["a"]), (3, [])]:
        pool = scheduler(num_blocks)
        pool.add(_request("a", 1, max_tokens=1))
        for _ in range(3):  # 3 blocks: the first step's 4 slots never fit, nothing to preempt
            out = _step(pool)
            assert [r.req_id for r in out.new_requests] == admitted
            if admitted:
                break
