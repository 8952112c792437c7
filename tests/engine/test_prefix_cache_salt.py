"""vLLM's ``cache_salt``: mixed into a request's first prefix-cache block hash (every later
hash chains from it), so only requests of the same salt share cached blocks; the output is the
same either way."""

from __future__ import annotations

from pathlib import Path

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.engine.beam_search import BeamSearchParams
from mrv2.engine.request import Request
from mrv2.engine.state_snapshots import StateSnapshots
from mrv2.testing import make_tiny_checkpoint

PROMPT = [3 + (7 * i) % 250 for i in range(22)]  # 5 full blocks of 4 before the last token
CACHED = 20  # a hit: every full block before the last token


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "LlamaForCausalLM")


def _llm(checkpoint: Path) -> LLM:
    return LLM(str(checkpoint), device="cpu", dtype="float32", block_size=4)


def _params(n: int = 1) -> SamplingParams:
    # (top_k=1: greedy's tokens, for n > 1 too: greedy itself takes n=1 only, as vLLM's)
    return SamplingParams(top_k=1, max_tokens=6, ignore_eos=True, n=n)


def _run(llm: LLM, salt: str | None, n: int = 1) -> tuple[int, list[list[int]]]:
    """One request for PROMPT (salted with ``salt`` when given): its cached prompt tokens and
    its samples' tokens."""
    prompt: dict[str, object] = {"prompt_token_ids": PROMPT}
    if salt is not None:
        prompt["cache_salt"] = salt
    out = llm.generate([prompt], _params(n), use_tqdm=False)[0]
    return out.num_cached_tokens, [list(c.token_ids) for c in out.outputs]


def test_same_salt_hits_other_salts_and_none_miss(checkpoint: Path) -> None:
    llm = _llm(checkpoint)
    cached, first = _run(llm, "tenant-a")
    assert cached == 0
    outputs = [first]
    for salt, want in (("tenant-a", CACHED), ("tenant-b", 0), (None, 0), (None, CACHED),
                       ("tenant-b", CACHED), ("tenant-a", CACHED)):
        cached, tokens = _run(llm, salt)
        assert cached == want, salt
        outputs.append(tokens)
    assert all(tokens == first for tokens in outputs)  # the same greedy tokens either way


def test_engine_add_request_salt(checkpoint: Path) -> None:
    engine = _llm(checkpoint).engine

    def cached(**kwargs: object) -> int:
        req_id = engine.add_request(PROMPT, _params(), **kwargs)  # type: ignore[arg-type]
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished and out.request_id == req_id:
                    result = out.num_cached_tokens
        return result

    assert cached() == 0
    assert cached(cache_salt="s") == 0
    assert cached(cache_salt="s") == CACHED
    assert cached() == CACHED
    for bad in ("", 7, b"s"):
        with pytest.raises(ValueError, match="cache_salt"):
            engine.add_request(PROMPT, _params(), cache_salt=bad)  # type: ignore[arg-type]
    assert not engine.has_unfinished()  # (nothing queued)


def test_n_samples_and_beam_search_share_the_salt(checkpoint: Path) -> None:
    llm = _llm(checkpoint)
    cached, samples = _run(llm, "s", n=2)
    assert cached == 0 and len(samples) == 2
    assert _run(llm, "s", n=2)[0] == CACHED  # the samples cached the salted blocks
    assert _run(llm, None)[0] == 0
    llm = _llm(checkpoint)
    llm.beam_search([{"prompt_token_ids": PROMPT, "cache_salt": "s"}],
                    BeamSearchParams(beam_width=2, max_tokens=2))
    assert _run(llm, "t")[0] == 0
    assert _run(llm, "s")[0] == CACHED


def test_bad_salt_refused_before_anything_runs(checkpoint: Path) -> None:
    llm = _llm(checkpoint)
    for bad in ("", 3, ["a"]):
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate([{"prompt_token_ids": PROMPT},
                          {"prompt_token_ids": PROMPT, "cache_salt": bad}], _params(),
                         use_tqdm=False)
    assert _run(llm, None)[0] == 0  # the good prompt was never queued
    assert _run(llm, None)[0] == CACHED


def _hashes(salt: str | None) -> list[bytes]:
    request = Request("r", list(PROMPT), SamplingParams(), 0, frozenset(), 4, cache_salt=salt)
    return request.update_block_hashes(4)


def test_salt_enters_the_first_block_and_the_chain() -> None:
    plain, salted, again, other = _hashes(None), _hashes("a"), _hashes("a"), _hashes("b")
    assert salted == again
    for a, b, c in zip(plain, salted, other, strict=True):  # every block differs
        assert len({a, b, c}) == 3
    request = Request("r", list(PROMPT), SamplingParams(), 0, frozenset(), 4, cache_salt="a")
    assert request.block_extra_keys(0, 4) == (("cache_salt", "a"),)
    assert request.block_extra_keys(1, 4) is None  # later blocks chain from the first
    # Hybrid models' state snapshots are keyed by the same hashes: a salted prompt never
    # resumes from an unsalted one's (or another salt's) snapshot.
    snaps = StateSnapshots(2, 4)
    slot = snaps.reserve()
    assert slot is not None
    snaps.publish(slot, salted[3])
    snaps.begin_step()
    assert snaps.deepest(plain) == (0, None)
    assert snaps.deepest(other) == (0, None)
    assert snaps.deepest(again) == (4, slot)
