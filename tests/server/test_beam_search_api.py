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


def _texts(url: str, penalty: float) -> list[list[str]]:
    body = {"model": MODEL, "prompt": PROMPTS, "n": 3, "max_tokens": 5, "ignore_eos": True,
            "use_beam_search": True, "length_penalty": penalty}
    answer = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60).json()
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert answer["usage"]["completion_tokens"] == 30
    return [[c["text"] for c in choices[:3]], [c["text"] for c in choices[3:]]]


def test_beams_are_the_engines(server: Served, model_dir: Path) -> None:
    assert _texts(server.url, 0.5) == _want(model_dir, 0.5)


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
                         ({"response_format": {"type": "json_object"}}, "response_format")):
        response = httpx.post(f"{server.url}/v1/chat/completions", json={**body, **extra},
                              headers=AUTH, timeout=60)
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == param
