"""``LLM.beam_search`` with a structured output (``BeamSearchParams.structured_outputs``,
vLLM's): every beam matches the constraint, the beams are distinct, a completed match ends its
beam (``stop``, before ``max_tokens``), and the same search without the constraint matches
nothing (the tiny model's weights are random: a match is the grammar at work). Each beam's own
grammar state goes to the engine as the step's ``_grammar_prefix``, which the engine replays;
a bad constraint is refused by name before any step runs."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from mrv2 import LLM, SamplingParams, StructuredOutputsParams
from mrv2.engine.beam_search import BeamSearchParams
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

PROMPTS = ["Hello world", "The capital"]
WIDTH = 3
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"enum": ["x", "y"]}}}
CHOICES = ["Paris", "London", "Berlin"]


def _json_ok(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"a", "b"}
            and isinstance(value["a"], int) and 0 <= value["a"] <= 99
            and value["b"] in ("x", "y"))


#: kind: (constraint, whether a text matches it, max_tokens: room to complete every match)
CASES: dict[str, tuple[StructuredOutputsParams, Callable[[str], bool], int]] = {
    "regex": (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"),
              lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t) is not None, 10),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES, 10),
    "json": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), _json_ok, 20),
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path: Path = make_tiny_checkpoint(tmp_path_factory.mktemp("beam_so"), "LlamaForCausalLM",
                                      vocab_size=320)
    make_tiny_tokenizer(path)
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, max_model_len=64,
               enable_prefix_caching=True)


@pytest.mark.parametrize("kind", list(CASES))
def test_every_beam_matches(llm: LLM, kind: str) -> None:
    spec, ok, max_tokens = CASES[kind]
    tokenizer = llm.get_tokenizer()
    free = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=WIDTH, max_tokens=max_tokens))
    free_texts = [tokenizer.decode(b.output_tokens) for o in free for b in o.sequences]
    assert not any(ok(t) for t in free_texts), free_texts  # (so a match is the grammar's)
    held = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=WIDTH, max_tokens=max_tokens,
                                                     structured_outputs=spec))
    for out in held:
        beams = out.sequences
        assert len(beams) == WIDTH
        assert len({tuple(b.output_tokens) for b in beams}) == WIDTH  # distinct beams
        for beam in beams:
            text = tokenizer.decode(beam.output_tokens)
            assert ok(text), (kind, text)
            # the completed match ended the beam, not max_tokens
            assert beam.finish_reason == "stop", (kind, text)
            assert len(beam.output_tokens) < max_tokens
            assert math.isfinite(beam.cum_logprob)
            assert beam.cum_logprob == pytest.approx(sum(beam.logprobs), abs=1e-5)
            assert beam.guide is None  # (the matchers are let go)


def test_a_beams_logprobs_are_its_constrained_requests(llm: LLM) -> None:
    """A beam's logprobs are those a constrained request returns (the masked distribution's,
    as ``LLM.generate``'s under the same choice): its first token is among that request's
    top logprobs, with the same value."""
    spec = StructuredOutputsParams(choice=CHOICES)
    out = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=WIDTH, max_tokens=10,
                                                       structured_outputs=spec)).pop()
    greedy = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, logprobs=5,
                                                     structured_outputs=spec),
                          use_tqdm=False).pop().outputs[0]
    firsts = {b.output_tokens[0] for b in out.sequences}
    top = greedy.logprobs[0] if greedy.logprobs else {}
    assert firsts <= set(top)  # every beam's first token is among the allowed best
    for beam in out.sequences:
        assert beam.logprobs[0] == pytest.approx(top[beam.output_tokens[0]].logprob, abs=1e-5)


def test_the_engine_replays_a_beams_output(llm: LLM) -> None:
    """A step's request holds its prompt's last ``_grammar_prefix`` tokens to the grammar: a
    prefix the grammar refuses is a ValueError, one it takes goes on from there."""
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("Hi", add_special_tokens=False)
    spec = StructuredOutputsParams(regex=r"[0-9]{3}")
    with pytest.raises(ValueError, match="_grammar_prefix=1 is invalid"):
        llm.engine.add_request(prompt, SamplingParams(max_tokens=1, structured_outputs=spec,
                                                      _grammar_prefix=1))
    digits = tokenizer.encode("12", add_special_tokens=False)
    out = llm.generate({"prompt_token_ids": prompt + digits}, SamplingParams(
        temperature=0, max_tokens=5, structured_outputs=spec,
        _grammar_prefix=len(digits)), use_tqdm=False).pop().outputs[0]
    assert re.fullmatch(r"[0-9]", out.text) and out.finish_reason == "stop", out.text


def test_a_bad_constraint_is_refused_by_name(llm: LLM) -> None:
    with pytest.raises(ValueError, match="structured_outputs.regex is invalid"):
        llm.beam_search(PROMPTS, BeamSearchParams(
            beam_width=2, max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(")))
    with pytest.raises(ValueError, match="BeamSearchParams.structured_outputs"):
        BeamSearchParams(beam_width=2, max_tokens=4,
                         structured_outputs={"regex": "[0-9]"})  # type: ignore[arg-type]
    assert llm.engine.scheduler.num_unfinished == 0


def test_each_beam_keeps_its_own_grammar_state(tmp_path: Path) -> None:
    """:class:`BeamSearch` on made-up steps (a thinking model's, DeepSeek-R1's convention: the
    prompt opened ``<think>``): a beam is free until its own ``</think>``, then held; a
    candidate its grammar refuses is dropped even where a step's logprobs carry it, one that
    completes the match ends its beam (``stop``), and each beam's step request replays its own
    output (``_grammar_prefix``)."""
    from transformers import AutoTokenizer

    from mrv2.engine.beam_search import BeamSearch
    from mrv2.engine.outputs import Logprob
    from mrv2.engine.structured_outputs import StructuredOutputs

    make_tiny_tokenizer(tmp_path, special_tokens=["<think>", "</think>"])
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    start, end, a, one, two = (hf.encode(t, add_special_tokens=False)[0]
                               for t in ("<think>", "</think>", "a", "1", "2"))
    params = BeamSearchParams(beam_width=2, max_tokens=5, _reasoning="deepseek_r1",
                              length_penalty=0.0,
                              structured_outputs=StructuredOutputsParams(regex="[0-9]{2}"))
    search = BeamSearch([[5, 6, start]], params, frozenset({hf.eos_token_id}), 64,
                        StructuredOutputs(hf, 320, [hf.eos_token_id]))
    steps = [{end: -0.1, a: -0.2, one: -3.0}]  # both free: "</think>" and "a" go on
    # after "</think>", "a" is refused (at -0.1 it would lead); the other beam stays free
    steps += [{a: -0.1, one: -0.2, two: -0.35}] + [{a: -2.0, one: -0.2, two: -0.35}] * 3
    prefixes = []
    for top in steps:
        requests = search.requests()
        if not requests:
            break
        prefixes.append(search.step_params._grammar_prefix)
        search.advance([{t: Logprob(lp) for t, lp in top.items()} for _ in requests])
    beams = search.outputs()[0].sequences
    assert prefixes[:3] == [0, 1, 2]
    assert [b.output_tokens for b in beams] == [[end, one, one], [end, one, two]]
    assert [b.finish_reason for b in beams] == ["stop", "stop"]  # (the match, not max_tokens)
    assert [b.cum_logprob for b in beams] == pytest.approx([-0.5, -0.65])
