"""``LLM.beam_search`` against HF's beam search (``generate(num_beams=k)``, no EOS, no length
penalty: both rank by the sum of logprobs) on a tiny Qwen3: the same ``k`` sequences in the
same order with the same scores; EOS ends a beam early and the length penalty ranks by
``cum_logprob / len ** penalty``; bad parameters are refused by name."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import transformers

from mrv2 import LLM
from mrv2.engine.beam_search import BeamSearchParams
from mrv2.testing import make_tiny_checkpoint

PROMPTS = [[5, 17, 99, 3, 42], [64, 9, 120]]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("beam"), "Qwen3ForCausalLM",
                                head_dim=16)


@pytest.fixture(scope="module")
def llm(path: Path) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=64,
               enable_prefix_caching=True)


def test_beams_match_hf(llm: LLM, path: Path) -> None:
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path),
                                                           dtype=torch.float32).eval()
    width, new = 3, 6
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(beam_width=width, max_tokens=new, ignore_eos=True,
                                            length_penalty=0.0))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([prompt]), num_beams=width,
                              num_return_sequences=width, do_sample=False,
                              max_new_tokens=new, length_penalty=0.0, eos_token_id=None,
                              pad_token_id=0, early_stopping=False,
                              output_scores=True, return_dict_in_generate=True)
        want = [s[len(prompt):].tolist() for s in gen.sequences]
        assert [b.output_tokens for b in out.sequences] == want
        for beam, score in zip(out.sequences, gen.sequences_scores.tolist(), strict=True):
            assert beam.cum_logprob == pytest.approx(score, abs=1e-4)
            assert beam.cum_logprob == pytest.approx(sum(beam.logprobs), abs=1e-6)
            assert beam.finish_reason == "length" and beam.tokens[:len(prompt)] == prompt


def test_eos_and_length_penalty(llm: LLM) -> None:
    """With the model's most likely token after the prompt as EOS, that beam completes at once
    (one token) and the length penalty decides where it ranks."""
    prompt = PROMPTS[0]
    first = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(
        beam_width=1, max_tokens=1, ignore_eos=True)).pop().sequences[0].output_tokens[0]
    original = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = frozenset({first})
    try:
        for penalty in (0.0, 1.0, 4.0):
            out = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(
                beam_width=2, max_tokens=4, length_penalty=penalty)).pop()
            stopped = [b for b in out.sequences if b.finish_reason == "stop"]
            for beam in out.sequences:
                n = len(beam.tokens) - (beam.finish_reason == "stop")
                assert beam.output_tokens[-1:] != [first] or beam.finish_reason == "stop"
                beam.score = beam.cum_logprob / n ** penalty  # type: ignore[attr-defined]
            scores = [b.score for b in out.sequences]  # type: ignore[attr-defined]
            assert scores == sorted(scores, reverse=True)
            if penalty == 0.0:  # the one-token beam has the largest sum of logprobs
                assert stopped and out.sequences[0].output_tokens == [first]
    finally:
        llm.engine.eos_token_ids = original
    assert math.isfinite(out.sequences[0].cum_logprob)


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 11, "max_tokens": 4}, "beam_width"),
    ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
    ({"beam_width": 2, "max_tokens": 4, "temperature": -1}, "temperature"),
])
def test_bad_parameters_name_the_field(kwargs: dict[str, int], name: str) -> None:
    with pytest.raises(ValueError, match=f"BeamSearchParams.{name}"):
        BeamSearchParams(**kwargs)


def test_an_interrupted_search_leaves_no_request_queued(llm: LLM,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A beam search stopped midway (Ctrl-C in a step, a request refused while queueing)
    aborts its requests, as ``LLM.generate`` does: none runs in the next call."""
    engine = llm.engine
    step = engine.step

    def interrupted() -> list:
        step()
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                        BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True))
    assert engine.scheduler.num_unfinished == 0  # (a step's output in flight may remain)
    monkeypatch.undo()
    out = llm.beam_search({"prompt_token_ids": PROMPTS[0]},
                          BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True))
    assert [len(b.output_tokens) for b in out[0].sequences] == [2, 2]


@pytest.mark.parametrize(("penalty", "want"), [
    (400.0, [[7, 7], [7, 8]]),  # the longest beams: their scores are the nearest to 0
    (-400.0, [[9], [7, 9]]),  # the shortest: EOS at once (its length 5, EOS not counted)
    (1.0, [[9], [7, 9]]),
])
def test_a_large_length_penalty_ranks_without_overflow(penalty: float,
                                                       want: list[list[int]]) -> None:
    """Any finite ``length_penalty`` is valid; ``length ** penalty`` of a large one overflows
    a float (a negative one: 0, a division by zero): the ranking must not (it raised
    OverflowError / ZeroDivisionError after the whole search had run)."""
    from mrv2.engine.beam_search import BeamSearch
    from mrv2.engine.outputs import Logprob

    search = BeamSearch([[1, 2, 3, 4, 5]], BeamSearchParams(
        beam_width=2, max_tokens=2, length_penalty=penalty), frozenset({9}), 64)
    while requests := search.requests():
        search.advance([{9: Logprob(-0.5), 7: Logprob(-1.0), 8: Logprob(-2.0)}
                        for _ in requests])
    beams = search.outputs()[0].sequences
    assert [b.output_tokens for b in beams] == want

    def score(b: object) -> float:  # (the documented score, exactly, where it fits a float)
        n = len(b.tokens) - (b.finish_reason == "stop")  # type: ignore[attr-defined]
        return b.cum_logprob / n ** penalty  # type: ignore[attr-defined]

    if abs(penalty) < 100:
        assert [score(b) for b in beams] == sorted(map(score, beams), reverse=True)
