"""Pausing generation with requests in flight (SGLang's ``pause_generation`` /
``continue_generation``, for weights updated mid-rollout): the steps in flight finish and
their outputs come with the next step, then nothing runs until continued; a pause with no
update in between changes no token; ``recompute`` gives the rest of an answer as a fresh
engine on the new weights gives it for the prompt plus the tokens before the pause; sleeping
while paused recomputes; the weight operations run while paused."""

from __future__ import annotations

from pathlib import Path

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.model_loader.loader import iter_safetensors
from mrv2.testing import make_tiny_checkpoint

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 200, 31, 4], [17, 3]]
NEW = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pause")
    return (make_tiny_checkpoint(root / "a", "Qwen3ForCausalLM", seed=3),
            make_tiny_checkpoint(root / "b", "Qwen3ForCausalLM", seed=4))


def _llm(path: Path) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=64,
               max_num_seqs=4)


def _start(engine: LLMEngine) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return [engine.add_request(p, params, stream=True) for p in PROMPTS]


def _tokens_so_far(engine: LLMEngine, ids: list[str]) -> list[list[int]]:
    return [list(engine._flight.requests[i].request.output_token_ids) for i in ids]


def _finish(engine: LLMEngine, ids: list[str]) -> list[list[int]]:
    done: dict[str, list[int]] = {}
    while engine.wants_step():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[i] for i in ids]


def _uninterrupted(path: Path) -> list[list[int]]:
    engine = _llm(path).engine
    return _finish(engine, _start(engine))


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_a_pause_without_an_update_changes_no_token(checkpoints: tuple[Path, Path],
                                                    mode: str) -> None:
    want = _uninterrupted(checkpoints[0])
    llm = _llm(checkpoints[0])
    engine = llm.engine
    ids = _start(engine)
    for _ in range(4):
        engine.step()
    llm.pause_generation(mode)
    assert engine.is_paused() and not engine._flight.steps
    before = _tokens_so_far(engine, ids)
    assert all(0 < len(t) < NEW for t in before)
    held = engine.step()  # what the pause finished arrives, then nothing runs
    assert {o.request_id for o in held} <= set(ids)
    for _ in range(3):
        assert engine.step() == [] and not engine.wants_step()
    assert _tokens_so_far(engine, ids) == before
    with pytest.raises(RuntimeError, match="paused"):
        llm.generate([{"prompt_token_ids": [1, 2]}], use_tqdm=False)
    llm.continue_generation()
    assert _finish(engine, ids) == want


def test_recompute_continues_on_the_new_weights(checkpoints: tuple[Path, Path]) -> None:
    a, b = checkpoints
    llm = _llm(a)
    engine = llm.engine
    ids = _start(engine)
    for _ in range(5):
        engine.step()
    llm.pause_generation("recompute")
    engine.step()  # (the held outputs)
    before = _tokens_so_far(engine, ids)
    assert all(0 < len(t) < NEW for t in before) and not engine.scheduler.running
    llm.update_weights(iter_safetensors(str(b)))  # mid-rollout, requests in flight
    llm.continue_generation()
    got = _finish(engine, ids)
    fresh = _llm(b).engine
    rest = [fresh.add_request(p + t, SamplingParams(temperature=0.0, max_tokens=NEW - len(t),
                                                     ignore_eos=True))
            for p, t in zip(PROMPTS, before, strict=True)]
    assert got == [t + r for t, r in zip(before, _finish(fresh, rest), strict=True)]


def test_sleeping_while_paused_recomputes_and_bad_modes_are_refused(
        checkpoints: tuple[Path, Path]) -> None:
    want = _uninterrupted(checkpoints[0])
    llm = _llm(checkpoints[0])
    engine = llm.engine
    with pytest.raises(ValueError, match=r"mode must be one of \['keep', 'recompute', "
                                         r"'abort', 'wait'\]"):
        llm.pause_generation("in_place")
    ids = _start(engine)
    for _ in range(4):
        engine.step()
    with pytest.raises(RuntimeError, match=r"pause_generation\(\) first"):
        llm.sleep()
    llm.pause_generation("keep")
    llm.sleep()  # the running requests' KV is discarded: they recompute it
    assert not engine.scheduler.running
    llm.continue_generation()
    engine.step()  # (the outputs the pause held)
    assert not engine.wants_step() and engine.step() == []  # asleep: the requests wait
    llm.wake_up()
    assert _finish(engine, ids) == want


def test_abort_ends_every_request_and_wait_lets_the_started_finish(
        checkpoints: tuple[Path, Path]) -> None:
    """vLLM's pause: ``abort`` ends every request now (finish_reason "abort", an n > 1
    request's samples merged); ``wait`` starts no new request, runs the started ones to
    their end (tokens unchanged), then pauses."""
    want = _uninterrupted(checkpoints[0])
    llm = _llm(checkpoints[0])
    engine = llm.engine
    ids = _start(engine)
    n2 = engine.add_request([4, 4, 4], SamplingParams(temperature=0.8, seed=1, n=2,
                                                      max_tokens=NEW, ignore_eos=True))
    for _ in range(3):
        engine.step()
    llm.pause_generation("abort")
    ended = {o.request_id: o for o in engine.step() if o.finished}
    assert set(ended) == {*ids, n2} and not engine.has_unfinished()
    assert all(c.finish_reason == "abort" for o in ended.values() for c in o.outputs)
    assert len(ended[n2].outputs) == 2
    llm.continue_generation()
    ids = _start(engine)
    for _ in range(3):
        engine.step()
    llm.pause_generation("wait")
    assert not engine.is_paused() and engine.is_draining()
    late = engine.add_request([9, 9], SamplingParams(temperature=0.0, max_tokens=3))
    done: dict[str, list[int]] = {}
    while not engine.is_paused():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert [done[i] for i in ids] == want and late not in done
    assert not engine.is_draining()
    assert engine.step() == [] and not engine.wants_step()  # the late one waits
    assert llm.reset_prefix_cache()  # (paused: allowed with a request waiting)
    llm.continue_generation()
    assert len(_finish(engine, [late])[0]) == 3


def test_wait_resumes_a_preempted_request_behind_a_new_one_of_higher_priority(
        checkpoints: tuple[Path, Path]) -> None:
    """Under the "priority" policy a request preempted while draining (``wait``) sorts
    behind one that arrived meanwhile with a better priority; it still resumes and runs to
    its end, and the engine pauses (it was stuck behind the one that may not start)."""
    llm = LLM(str(checkpoints[0]), device="cpu", dtype="float32", block_size=4,
              max_model_len=64, num_gpu_blocks_override=6, policy="priority")
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = [engine.add_request(p, params, priority=1) for p in ([5, 6, 7], [8, 9, 10])]
    engine.step()
    engine.step()
    llm.pause_generation("wait")
    late = engine.add_request([11, 12], SamplingParams(max_tokens=2), priority=0)
    done: set[str] = set()
    for _ in range(100):
        if engine.is_paused():
            break
        done |= {o.request_id for o in engine.step() if o.finished}
    assert engine.scheduler.num_preemptions >= 1  # (6 blocks hold one of them whole)
    assert engine.is_paused() and done == set(first)
    llm.continue_generation()
    assert len(_finish(engine, [late])[0]) == 2


def test_a_request_kept_through_an_update_caches_none_of_its_old_kv(tmp_path: Path) -> None:
    """``keep`` then an update: the kept request's blocks hold the old weights' KV (and what
    it computes afterwards attends to it), so none of them may enter the prefix cache the
    update emptied; a later prompt extending its tokens gets a fresh engine's tokens on the
    new weights, not ones read from the old KV."""
    a = make_tiny_checkpoint(tmp_path / "a", "LlamaForCausalLM", seed=3, std=0.15)
    b = make_tiny_checkpoint(tmp_path / "b", "LlamaForCausalLM", seed=4, std=0.15)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = [5, 6, 7, 5, 6, 7, 5, 9, 200, 31, 4, 17, 3, 8]
    llm = _llm(a)
    engine = llm.engine
    kept = engine.add_request(prompt, params)
    for _ in range(3):
        engine.step()
    llm.pause_generation("keep")
    llm.update_weights(iter_safetensors(str(b)))
    llm.continue_generation()
    (tokens,) = _finish(engine, [kept])
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # its blocks: new KV
    longer = [{"prompt_token_ids": prompt + tokens[:8]}]
    got = llm.generate(longer, params, use_tqdm=False)[0].outputs[0].token_ids
    assert engine.block_manager.num_hit_tokens == 12  # the new request's 3 blocks only
    assert got == _llm(b).generate(longer, params, use_tqdm=False)[0].outputs[0].token_ids
    assert engine.block_manager.usage == 0


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_a_pause_that_ends_the_last_request_frees_its_row(checkpoints: tuple[Path, Path],
                                                          mode: str) -> None:
    """The last request's last token in flight when the engine pauses: the pause processes
    it, the request ends, and its runner row is freed then, as an abort or an idle step
    frees it (the row stayed held until some later request's step)."""
    llm = _llm(checkpoints[0])
    engine = llm.engine
    req_id = engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3,
                                                          ignore_eos=True))
    request = engine._flight.requests[req_id].request
    while request.num_output_tokens < 3:  # (the last token is sampled, not yet read)
        engine.step()
    assert engine._flight.steps and len(engine.runner.table) == 1
    llm.pause_generation(mode)
    assert engine.is_paused() and not engine.has_unfinished()
    assert len(engine.runner.table) == 0
    (out,) = engine.step()
    assert out.finished and len(out.outputs[0].token_ids) == 3
    llm.continue_generation()
