"""``--skip-tokenizer-init`` on the server (vLLM's): completions take token-id prompts and
answer token ids (``return_token_ids``) with empty text; chat, text prompts and stop
strings are a 400 naming why."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, MODEL, Served

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [5, 9, 17, 33]


@pytest.fixture(scope="module", params=["thread", "process"])
def skipping(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """The server's URL, its engine on a thread or in its own process (whose front end
    loads the tokenizer itself: it must not either)."""
    if request.param == "thread":
        from conftest import serve

        for served in serve(model_dir, {"skip_tokenizer_init": True}):
            assert served.engine.tokenizer is None
            yield served.url
    else:
        from test_engine_process import _remote

        for url, engine in _remote(model_dir, skip_tokenizer_init=True):
            assert engine.tokenizer is None
            yield url


def _post(url: str, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{route}", headers=AUTH, timeout=60, json={"model": MODEL, **body})


def test_completions_of_token_ids(skipping: str, server: Served) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = _post(skipping, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == ""
    expected = _post(server.url, "/v1/completions", body).json()["choices"][0]
    assert choice["token_ids"] == expected["token_ids"] and len(choice["token_ids"]) == 4


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
    ("/v1/completions", {"prompt": "Hi"}, "prompt"),
])
def test_text_refused(skipping: str, route: str, body: dict[str, Any], param: str) -> None:
    r = _post(skipping, route, {**body, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "--skip-tokenizer-init" in error["message"] and error["param"] == param


def test_stop_strings_refused(skipping: str) -> None:
    r = _post(skipping, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2,
                                                "stop": ["a"]})
    assert r.status_code == 400, r.text
    assert "skip_tokenizer_init" in r.json()["error"]["message"]
