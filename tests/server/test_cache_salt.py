"""vLLM's ``cache_salt`` request field on ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/responses``: only requests of the same salt share prefix-cache blocks (usage's cached
tokens show it), with the engine on a thread or in its own process; an empty or non-string
salt is a 400 naming the field."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, MODEL, Served

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [(5 * i + 11) % 250 + 5 for i in range(40)]  # 10 blocks of 4
LONG = "the lazy dog jumps"


def _post(url: str, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{route}", headers=AUTH, timeout=60, json={"model": MODEL, **body})


BODIES = {
    "/v1/completions": {"prompt": "salted prompt " + LONG, "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "salted chat " + LONG}],
                             "max_tokens": 2},
    "/v1/responses": {"input": "salted response " + LONG, "max_output_tokens": 2},
}


@pytest.mark.parametrize("route", list(BODIES))
def test_cache_salt_accepted_and_checked(server: Served, route: str) -> None:
    for salt in ("tenant-1", None):
        r = _post(server.url, route, {**BODIES[route], "cache_salt": salt})
        assert r.status_code == 200, r.text
    for bad in ("", 5, ["a"]):
        r = _post(server.url, route, {**BODIES[route], "cache_salt": bad})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "cache_salt" and "cache_salt" in error["message"]


def test_responses_salt_keeps_prefixes_apart(server: Served) -> None:
    def cached(salt: str | None) -> int:
        body = {"input": "responses isolation " + LONG, "max_output_tokens": 2}
        r = _post(server.url, "/v1/responses", {**body, "cache_salt": salt})
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["input_tokens_details"]["cached_tokens"])

    assert cached("r1") == 0
    assert cached("r1") > 0
    assert cached("r2") == 0
    assert cached(None) == 0


def _servers(model_dir: Path, mode: str) -> Iterator[str]:
    if mode == "thread":
        from conftest import serve

        for served in serve(model_dir, enable_prompt_tokens_details=True):
            yield served.url
    else:
        from test_engine_process import _remote

        for url, _ in _remote(model_dir, {"enable_prompt_tokens_details": True}):
            yield url


def _cached(url: str, route: str, body: dict[str, Any], salt: str | None) -> tuple[int, Any]:
    """Usage's cached prompt tokens and the choices' answers of a greedy request."""
    r = _post(url, route, {**body, "max_tokens": 3, "temperature": 0, "cache_salt": salt})
    assert r.status_code == 200, r.text
    answer = r.json()
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"], [
        c.get("text", c.get("message")) for c in answer["choices"]]


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_salt_keeps_prefixes_apart(model_dir: Path, mode: str) -> None:
    for url in _servers(model_dir, mode):
        cached = functools.partial(_cached, url)
        completion = {"prompt": PROMPT}
        first = cached("/v1/completions", completion, "a")
        assert first[0] == 0
        assert cached("/v1/completions", completion, "a") == (36, first[1])
        assert cached("/v1/completions", completion, "b") == (0, first[1])
        assert cached("/v1/completions", completion, None) == (0, first[1])
        assert cached("/v1/completions", completion, None) == (36, first[1])
        # beam search's requests carry the salt too
        beams = _post(url, "/v1/completions", {**completion, "use_beam_search": True, "n": 2,
                                               "max_tokens": 2, "cache_salt": "e"})
        assert beams.status_code == 200, beams.text
        assert cached("/v1/completions", completion, "e")[0] == 36
        chat = {"messages": [{"role": "user", "content": "isolated chat " + LONG}]}
        assert cached("/v1/chat/completions", chat, "c")[0] == 0
        assert cached("/v1/chat/completions", chat, "c")[0] > 0
        assert cached("/v1/chat/completions", chat, "d")[0] == 0
