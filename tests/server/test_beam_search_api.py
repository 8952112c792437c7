"""``/v1/completions`` with ``use_beam_search`` (vLLM's): ``n`` beams a prompt, best first,
equal to ``LLM.beam_search``'s, with the engine in this process and in its own, and in chat
completions; what it cannot combine with is refused by name."""

from __future__ import annotations

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
    {"guided_regex": "[0-9]+"}, {"guided_choice": ["a", "b"]},
    {"structured_outputs": {"regex": "[0-9]+"}}, {"response_format": {"type": "json_object"}},
    {"stop": ["l"]}, {"stop": "l"}, {"stop_token_ids": [7]}, {"logit_bias": {"5": 10}},
    {"bad_words": ["l"]}, {"allowed_token_ids": [5, 6]}, {"presence_penalty": 0.5},
    {"frequency_penalty": 0.5}, {"repetition_penalty": 1.2}, {"min_tokens": 2},
    {"prompt_logprobs": 1}, {"return_token_ids": True},
])
def test_what_beam_search_does_not_honour_is_refused(server: Served, path: str,
                                                    extra: dict[str, Any]) -> None:
    """A constraint beam search would drop (a structured output, stops, biases, penalties) or
    an extra it does not give is a 400 naming the field sent, on both routes."""
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
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"guided_regex": "[0-9]+"}, "guided_regex")):
        response = httpx.post(f"{server.url}/v1/chat/completions", json={**body, **extra},
                              headers=AUTH, timeout=60)
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == param
