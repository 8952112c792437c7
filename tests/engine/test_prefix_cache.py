"""Automatic prefix caching end to end on CPU: greedy output is the same with the cache on or
off, through cache hits, preemption storms and aborts, and nothing leaks."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.testing import hf_greedy, make_tiny_checkpoint

NEW_TOKENS = 10
PREFIX = [3 + (7 * i) % 250 for i in range(22)]
SUFFIXES = [[11], [12, 13, 14], [15, 16, 17, 18, 19], [20, 21], [22, 23, 24, 25, 26, 27, 28]]
PROMPTS = [PREFIX + s for s in SUFFIXES] + [PREFIX[:8], PREFIX[:12]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "LlamaForCausalLM")


def _llm(checkpoint: Path, **kwargs: object) -> LLM:
    return LLM(str(checkpoint), device="cpu", dtype="float32", block_size=4, **kwargs)


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def _rounds(llm: LLM) -> list[list[int]]:
    """Several rounds on one engine, so later rounds find earlier rounds' blocks."""
    outputs: list[list[int]] = []
    for batch in (PROMPTS[:1], PROMPTS[1:3], PROMPTS[3:], PROMPTS[:2]):
        results = llm.generate([{"prompt_token_ids": p} for p in batch], _params())
        outputs += [r.outputs[0].token_ids for r in results]
    return outputs


def _assert_clean(engine: LLMEngine) -> None:
    blocks = engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks
    assert all(count == 0 for count in blocks.ref_count)
    assert engine.scheduler.num_unfinished == 0
    assert len(engine.runner.table) == 0  # every runner row released


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> list[list[int]]:
    llm = _llm(checkpoint, enable_prefix_caching=False)
    out = _rounds(llm)
    assert llm.engine.stats()["prefix_cache_hits"] == 0
    return out


def test_cache_off_matches_hf(checkpoint: Path, reference: list[list[int]]) -> None:
    for prompt, tokens in zip(PROMPTS[:2], reference[:2], strict=True):
        assert tokens == hf_greedy(checkpoint, prompt, NEW_TOKENS)


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"async_scheduling": False}, {"max_num_batched_tokens": 6}],
    ids=["async", "sync", "chunked"],
)
def test_prefix_cache_hits_same_output(
    checkpoint: Path, reference: list[list[int]], kwargs: dict[str, object]
) -> None:
    llm = _llm(checkpoint, **kwargs)
    assert _rounds(llm) == reference
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] > 0
    assert 0 < stats["prefix_cache_hit_rate"] < 1
    assert stats["prefix_cache_queries"] >= stats["prefix_cache_hits"]
    _assert_clean(llm.engine)


@pytest.mark.parametrize("caching", [True, False])
def test_tiny_cache_preempts_often(
    checkpoint: Path, reference: list[list[int]], caching: bool
) -> None:
    llm = _llm(checkpoint, num_gpu_blocks_override=12, enable_prefix_caching=caching)
    assert _rounds(llm) == reference
    assert llm.engine.stats()["num_preemptions"] > 0
    _assert_clean(llm.engine)


def test_prefix_cache_counters_count_new_prompts_only(checkpoint: Path) -> None:
    """As vLLM's ``prefix_cache_queries`` / ``hits``: each prompt's first lookup (its tokens
    and its ``num_cached_tokens``), not a preempted request's lookups again when it resumes
    (it would find its own blocks: a hit rate of nothing the cache saved), nor a request
    that never looks up (prompt logprobs)."""
    llm = _llm(checkpoint, num_gpu_blocks_override=12)
    queried = hits = 0
    for batch in (PROMPTS[:1], PROMPTS[1:3], PROMPTS[3:], PROMPTS[:2]):
        for result in llm.generate([{"prompt_token_ids": p} for p in batch], _params()):
            queried += len(result.prompt_token_ids)
            hits += result.num_cached_tokens
    llm.generate([{"prompt_token_ids": PROMPTS[0]}],
                 SamplingParams(max_tokens=1, prompt_logprobs=1))
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and hits > 0
    assert (stats["prefix_cache_queries"], stats["prefix_cache_hits"]) == (queried, hits)


def _run_with_aborts(engine: LLMEngine, seed: int) -> dict[str, list[int]]:
    """Keep the PROMPTS requests, plus noise requests aborted at random moments."""
    rng = random.Random(seed)
    kept = {engine.add_request(p, _params(), request_id=f"keep{i}"): i
            for i, p in enumerate(PROMPTS)}
    noise = [engine.add_request(PREFIX[: rng.randint(1, 22)] + [rng.randint(1, 250)] * 5,
                                _params(), request_id=f"noise{i}") for i in range(6)]
    results: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        for output in engine.step():
            if output.request_id in kept:
                results[output.request_id] = output.outputs[0].token_ids
        steps += 1
        if noise and rng.random() < 0.4:
            engine.abort(noise.pop(rng.randrange(len(noise))))
        if steps == 3:
            engine.abort("keep-missing")  # unknown ids are ignored
    return results


@pytest.mark.parametrize("seed", [0, 1])
def test_random_aborts_leak_nothing(
    checkpoint: Path, reference: list[list[int]], seed: int
) -> None:
    llm = _llm(checkpoint, num_gpu_blocks_override=16)
    results = _run_with_aborts(llm.engine, seed)
    assert [results[f"keep{i}"] for i in range(len(PROMPTS))] == reference[: len(PROMPTS)]
    _assert_clean(llm.engine)


def test_abort_frees_blocks_at_once(checkpoint: Path) -> None:
    engine = _llm(checkpoint).engine
    engine.add_request(PROMPTS[0], _params(), request_id="a")
    engine.add_request(PROMPTS[1], _params(), request_id="b")
    engine.step()
    engine.step()
    held = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    assert held > 0
    engine.abort("a")
    engine.abort("b")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    while engine.has_unfinished():
        assert engine.step() == []
    _assert_clean(engine)


def test_aborting_one_sample_of_an_n_request_ends_that_sample_alone(checkpoint: Path) -> None:
    """``abort`` of a sample's id (``child_id``) ends that sample with finish_reason "abort"
    (vLLM's: the parent's output holds it as such); the parent finishes when its other
    samples do, with their outputs (it never finished: its other outputs were swallowed and
    its bookkeeping kept), and nothing is left behind."""
    engine = _llm(checkpoint).engine
    # (top_k=1: every sample greedy's tokens; greedy itself takes n=1 only, as vLLM's)
    params = SamplingParams(n=3, top_k=1, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.add_request(PROMPTS[0], params, request_id="x")
    engine.step()
    engine.step()
    engine.abort("x#n1")
    outputs = []
    while engine.wants_step():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["x"] and outputs[0].finished
    samples = outputs[0].outputs
    assert [c.index for c in samples] == [0, 1, 2]
    assert [c.finish_reason for c in samples] == ["length", "abort", "length"]
    want = hf_greedy(checkpoint, PROMPTS[0], NEW_TOKENS)
    assert samples[0].token_ids == samples[2].token_ids == want
    assert samples[1].token_ids == want[:len(samples[1].token_ids)]
    assert len(samples[1].token_ids) < NEW_TOKENS
    assert not engine._flight.fanout.parents and not engine._flight.fanout.child_parent
    _assert_clean(engine)
    # every sample aborted, one at a time: the parent's output ends with the last of them
    engine.add_request(PROMPTS[1], params, request_id="y")
    engine.step()
    for i in range(3):
        engine.abort(f"y#n{i}")
    outputs = []
    while engine.wants_step():
        outputs += engine.step()
    assert [o.request_id for o in outputs] == ["y"] and outputs[0].finished
    assert [c.finish_reason for c in outputs[0].outputs] == ["abort"] * 3
    assert not engine._flight.fanout.parents
    _assert_clean(engine)


@pytest.mark.parametrize("how", ["abort", "stop"])
def test_a_reused_request_id_gets_none_of_the_old_requests_tokens(checkpoint: Path,
                                                                  how: str) -> None:
    """An id is free again once its request is aborted or finished, while with async
    scheduling a step of the old request may still be in flight: that step's token is the
    old request's and is dropped, never handed to the new request of the same id (it was:
    the new request's output began with the old one's token)."""
    engine = _llm(checkpoint).engine
    first, second = PROMPTS[0], PROMPTS[1]
    want = hf_greedy(checkpoint, second, NEW_TOKENS)
    if how == "abort":
        engine.add_request(first, _params(), request_id="x")
        engine.step()
        engine.step()
        assert engine._flight.steps  # (a step of "x" is in flight)
        engine.abort("x")
    else:  # stops on its second token while its third is in flight
        stop = hf_greedy(checkpoint, first, 2)[1]
        engine.add_request(first, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                 ignore_eos=True, stop_token_ids=[stop]),
                           request_id="x")
        while not engine.step():
            pass
        assert engine._flight.steps
    engine.add_request(second, _params(), request_id="x")
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.outputs[0].token_ids for o in outputs] == [want]
    _assert_clean(engine)


def test_a_failed_step_leaves_no_ended_id_behind(checkpoint: Path) -> None:
    """The ended ids whose newest step in flight was a step that failed (its processing
    raised) are forgotten with it: a request given that id afterwards gets its tokens (it got
    none: every later step's result for the id was dropped as the old request's, and it
    never finished)."""
    engine = _llm(checkpoint).engine
    engine.add_request(PROMPTS[0], _params(), request_id="x")
    engine.step()
    engine.step()
    assert engine._flight.steps  # (a step of "x" is in flight)
    engine.abort("x")
    failing = engine._flight.steps[-1]

    def fail() -> None:
        raise RuntimeError("the step failed")

    failing.result = fail  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="the step failed"):
        while engine.has_unfinished():
            engine.step()
    assert not engine._flight.steps and not engine._flight.ended
    want = hf_greedy(checkpoint, PROMPTS[1], NEW_TOKENS)
    engine.add_request(PROMPTS[1], _params(), request_id="x")
    outputs = []
    for _ in range(4 * NEW_TOKENS):
        if not engine.has_unfinished():
            break
        outputs += engine.step()
    assert [o.outputs[0].token_ids for o in outputs] == [want]


def test_whole_prompt_cached_still_computes_last_token(checkpoint: Path) -> None:
    """A prompt whose every block is cached recomputes its last block, and still samples."""
    llm = _llm(checkpoint)
    prompt = PREFIX[:20]  # 5 full blocks
    first = llm.generate([{"prompt_token_ids": prompt}], _params())[0].outputs[0].token_ids
    second = llm.generate([{"prompt_token_ids": prompt}], _params())[0].outputs[0].token_ids
    assert first == second == hf_greedy(checkpoint, prompt, NEW_TOKENS)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hits"] == 16  # 4 of 5 blocks: the last one is recomputed


def test_block_hash_encoding_is_pinned() -> None:
    """A block's hash is sha256(parent or b"root", each token as 8 little-endian signed bytes,
    repr(extra_keys)): written out here the slow way, so a faster encoding cannot change the
    hashes (cached blocks, and anything that stored them, stay valid)."""
    import hashlib

    from mrv2.engine.block_manager import hash_block

    rng = random.Random(0)
    parent = None
    for n in (1, 4, 16, 17):
        tokens = [rng.randint(-(2**40), 2**40) for _ in range(n)] + [-1, 0, 2**63 - 1]
        for extra in (None, (("img", 3),)):
            want = hashlib.sha256(parent or b"root")
            want.update(b"".join(t.to_bytes(8, "little", signed=True) for t in tokens))
            if extra:
                want.update(repr(extra).encode())
            got = hash_block(parent, tokens, extra)
            assert got == want.digest()
            parent = got
