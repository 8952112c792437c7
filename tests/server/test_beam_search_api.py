"""``/v1/completions`` with ``use_beam_search`` (vLLM's): ``n`` beams a prompt, best first,
equal to ``LLM.beam_search``'s, with the engine in this process and in its own, and in chat
completions; a structured output holds every beam; what it cannot combine with is refused by
name."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, ENGINE_KWARGS, MODEL, Served

from mrv2 import LLM, EngineConfig
from mrv2.engine.beam_search import BeamSearchParams
from mrv2.testing import serve_in_thread

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = [[5, 9, 3, 17, 4], [60, 2, 8]]


def _want(model_dir: Path, penalty: float) -> list[list[str]]:
    llm = LLM(str(model_dir), **{k: v for k, v in ENGINE_KWARGS.items()
                                 if k not in ("num_gpu_blocks_override", "max_num_seqs")})
    outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                           BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True,
                                            length_penalty=penalty))
    tokenizer = llm.get_tokenizer()
    return [[tokenizer.decode(b.output_tokens) for b in o.sequences] for o in outs]


def _texts(url: str, penalty: float, **extra: Any) -> list[list[str]]:
    body = {"model": MODEL, "prompt": PROMPTS, "n": 3, "max_tokens": 5, "ignore_eos": True,
            "use_beam_search": True, "length_penalty": penalty, **extra}
    answer = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60).json()
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert answer["usage"]["completion_tokens"] == 30
    return [[c["text"] for c in choices[:3]], [c["text"] for c in choices[3:]]]


def test_beams_are_the_engines(server: Served, model_dir: Path) -> None:
    assert _texts(server.url, 0.5) == _want(model_dir, 0.5)
    # temperature 0 (BeamSearchParams' default): n is the beam width, no greedy n > 1
    assert _texts(server.url, 0.5, temperature=0) == _want(model_dir, 0.5)


def test_beams_through_the_engine_process(model_dir: Path) -> None:
    from mrv2.entrypoints.engine_process import RemoteEngine
    from mrv2.entrypoints.server import create_app

    engine = RemoteEngine(EngineConfig.from_kwargs(model=str(model_dir), **ENGINE_KWARGS))
    try:
        for url in serve_in_thread(create_app(engine, served_model_name=MODEL,
                                              api_key=API_KEY)):
            assert _texts(url, 1.0) == _want(model_dir, 1.0)
            # (the beams' grammar states in this process, the engine's in its own)
            assert all(re.fullmatch(REGEX, t) for t in _held(url, {"guided_regex": REGEX}))
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("extra", "param"), [
    ({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"), ({"echo": True}, "echo"),
    ({"n": 11}, "n"),
])
def test_what_beam_search_cannot_combine_with(server: Served, extra: dict[str, Any],
                                              param: str) -> None:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "use_beam_search": True, **extra}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH,
                          timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra", [
    {"stop": ["l"]}, {"stop": "l"}, {"stop_token_ids": [7]}, {"logit_bias": {"5": 10}},
    {"bad_words": ["l"]}, {"allowed_token_ids": [5, 6]}, {"presence_penalty": 0.5},
    {"frequency_penalty": 0.5}, {"repetition_penalty": 1.2}, {"min_tokens": 2},
    {"prompt_logprobs": 1}, {"return_token_ids": True},
])
def test_what_beam_search_does_not_honour_is_refused(server: Served, path: str,
                                                    extra: dict[str, Any]) -> None:
    """A constraint beam search would drop (stops, biases, penalties) or an extra it does not
    give is a 400 naming the field sent, on both routes."""
    base: dict[str, Any] = ({"messages": [{"role": "user", "content": "Hi"}]}
                            if "chat" in path else {"prompt": "Hi"})
    body = {"model": MODEL, **base, "max_tokens": 3, "n": 2, "use_beam_search": True, **extra}
    response = httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == next(iter(extra))


def test_beam_search_names_every_field_it_drops(server: Served) -> None:
    """Several such fields: the first is the error's param, the message names them all; what
    beam search honours, and those fields at their neutral values, are not refused."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "n": 2, "use_beam_search": True}
    response = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                          json={**body, "stop": ["l"], "logit_bias": {"5": 10}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "stop"
    assert "stop, logit_bias" in response.json()["error"]["message"]
    neutral = {"stop": [], "stop_token_ids": [], "presence_penalty": 0,
               "repetition_penalty": 1.0, "min_tokens": 0, "response_format": {"type": "text"},
               "ignore_eos": True, "temperature": 0.5, "length_penalty": 0.8}
    ok = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                    json={**body, **neutral})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2, ok.text


def test_chat_beams(server: Served, model_dir: Path) -> None:
    """Chat with ``use_beam_search``: the chat-templated prompt's beams, ``LLM``'s, as
    messages; what it cannot combine with is refused by name."""
    messages = [{"role": "user", "content": "Hi"}]
    llm = LLM(str(model_dir), **{k: v for k, v in ENGINE_KWARGS.items()
                                 if k not in ("num_gpu_blocks_override", "max_num_seqs")})
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.apply_chat_template(messages, True)
    want = [tokenizer.decode(b.output_tokens) for b in llm.beam_search(
        {"prompt_token_ids": ids}, BeamSearchParams(beam_width=2, max_tokens=4,
                                                    ignore_eos=True)).pop().sequences]
    body = {"model": MODEL, "messages": messages, "use_beam_search": True, "n": 2,
            "max_tokens": 4, "ignore_eos": True}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH,
                        timeout=60).json()
    assert answer["object"] == "chat.completion"
    assert [c["message"]["content"] for c in answer["choices"]] == want
    for extra, param in (({"stream": True}, "stream"), ({"logprobs": True}, "logprobs"),
                         ({"stop": ["l"]}, "stop")):
        response = httpx.post(f"{server.url}/v1/chat/completions", json={**body, **extra},
                              headers=AUTH, timeout=60)
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == param


REGEX = r"[0-9]{3}-[a-z]{2}"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                         "b": {"enum": ["x", "y"]}}}


def _json_ok(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"a", "b"}
            and isinstance(value["a"], int) and value["b"] in ("x", "y"))


def _held(url: str, extra: dict[str, Any], path: str = "/v1/completions",
          status: int = 200) -> list[str]:
    """The beams' texts of a ``use_beam_search`` request (3 beams, room for every match) with
    ``extra``; each beam ended by its completed match."""
    base: dict[str, Any] = ({"messages": [{"role": "user", "content": "Hi"}]}
                            if "chat" in path else {"prompt": "Hello world"})
    body = {"model": MODEL, **base, "n": 3, "max_tokens": 20, "use_beam_search": True,
            **extra}
    response = httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=60)
    assert response.status_code == status, response.text
    choices = response.json()["choices"]
    assert len(choices) == 3
    texts = [c["message"]["content"] if "chat" in path else c["text"] for c in choices]
    if extra:
        assert [c["finish_reason"] for c in choices] == ["stop"] * 3, texts
    return texts


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("extra", "ok"), [
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t) is not None),
    ({"structured_outputs": {"choice": ["Paris", "London", "Berlin"]}},
     lambda t: t in ("Paris", "London", "Berlin")),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, _json_ok),
    # (an enum: no whitespace for the beams to spend max_tokens on)
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "pick", "schema": {"enum": ["alpha", "beta", 10]}}}},
     lambda t: t in ('"alpha"', '"beta"', "10")),
], ids=["guided_regex", "structured_outputs_choice", "structured_outputs_json",
        "response_format_json_schema"])
def test_a_structured_output_holds_every_beam(server: Served, path: str,
                                             extra: dict[str, Any], ok: Any) -> None:
    """vLLM's beam search with a structured output: a 200 whose beams all match it; without
    it, none does (the tiny model's weights are random)."""
    free = _held(server.url, {}, path)
    assert not any(ok(t) for t in free), free
    held = _held(server.url, extra, path)
    assert all(ok(t) for t in held), held  # (distinct beams: LLM's test; two tokenizations
    # of one choice are two beams of one text)


def test_a_bad_constraint_with_beam_search_is_a_400(server: Served) -> None:
    body = {"model": MODEL, "prompt": "Hi", "n": 2, "max_tokens": 3, "use_beam_search": True,
            "guided_regex": "("}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH,
                          timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "guided_regex"


def test_choices_are_numbered_through_when_a_prompt_has_fewer_beams() -> None:
    """A structured output may leave a prompt fewer than ``n`` beams (``choice: ["Paris"]``
    has one tokenization here): the choices' indexes still run 0, 1, 2... over the prompts
    (they were ``prompt * its beams + beam``: two choices had index 1)."""
    from mrv2.engine.beam_search import BeamSearchOutput, BeamSearchSequence
    from mrv2.entrypoints.whole_answers import beam_answer_body

    def beams(k: int) -> BeamSearchOutput:
        return BeamSearchOutput([BeamSearchSequence([1, 2 + j], 1, finish_reason="stop")
                                 for j in range(k)])

    body = beam_answer_body([beams(3), beams(1)], [[1], [1]], None, MODEL, False)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 4
