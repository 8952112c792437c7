"""``--enable-prompt-tokens-details`` (vLLM's flag): usage carries
``prompt_tokens_details.cached_tokens``, the prompt tokens the prefix cache held when the
request was admitted, whole and streamed, with the engine on a thread or in its own process;
without the flag usage has no such field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, ENGINE_KWARGS, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [(7 * i + 3) % 250 + 5 for i in range(40)]  # 10 blocks of 4


def _usage(url: str, body: dict[str, Any]) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": 2, **body}
    if not body.get("stream"):
        r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60, json=body)
        assert r.status_code == 200, r.text
        return dict(r.json()["usage"])
    usage = None
    with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=60,
                      json={**body, "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage is not None
    return dict(usage)


def _servers(model_dir: Path, mode: str, details: bool) -> Iterator[str]:
    if mode == "thread":
        from conftest import serve

        for served in serve(model_dir, enable_prompt_tokens_details=details):
            yield served.url
    else:
        from test_engine_process import _remote

        for url, _ in _remote(model_dir, {"enable_prompt_tokens_details": details}):
            yield url


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_cached_tokens_in_usage(model_dir: Path, mode: str) -> None:
    assert ENGINE_KWARGS["block_size"] == 4
    for url in _servers(model_dir, mode, True):
        first = _usage(url, {"prompt": PROMPT})
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        again = _usage(url, {"prompt": PROMPT})  # every full block but the last token's
        assert again["prompt_tokens_details"] == {"cached_tokens": 36}
        streamed = _usage(url, {"prompt": PROMPT + [9, 9, 9, 9, 9], "stream": True, "n": 2})
        assert streamed["prompt_tokens_details"] == {"cached_tokens": 40}
    for url in _servers(model_dir, mode, False):
        assert "prompt_tokens_details" not in _usage(url, {"prompt": PROMPT})
