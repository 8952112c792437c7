"""100 streaming requests at once, some cancelled midway: nothing lost, nothing leaked."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from server_util import API_KEY, MODEL, Served

AUTH = {"Authorization": f"Bearer {API_KEY}"}


async def _one(client: httpx.AsyncClient, i: int, cancel: bool) -> int | None:
    # (a chunk may carry several tokens where the server's loop falls behind: the tokens are
    # counted by their logprobs entries, one a token)
    body = {"model": MODEL, "prompt": f"Hello {i}", "max_tokens": 5 + i % 7, "stream": True,
            "ignore_eos": True, "temperature": 0.7, "seed": i, "logprobs": 1}
    tokens, text_done = 0, False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                text_done = True
                break
            chunk = json.loads(data)
            if chunk["choices"]:
                choice = chunk["choices"][0]
                assert choice["text"] is not None
                tokens += len(choice["logprobs"]["tokens"])
            if cancel and tokens >= 2:
                return None  # leaving the block closes the stream
    assert text_done
    return tokens


def test_many_streams_with_cancellations(server: Served) -> None:
    async def main() -> list[int | None]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60,
                                     limits=httpx.Limits(max_connections=200)) as client:
            return await asyncio.gather(*[_one(client, i, i % 5 == 0) for i in range(100)])

    results = asyncio.run(main())
    for i, got in enumerate(results):
        if i % 5 == 0:
            assert got is None
        else:  # every token, with ignore_eos
            assert got == 5 + i % 7, (i, got)
    # the server still answers, and ends idle with every KV block free
    r = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=30,
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 3
    engine = server.engine
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (engine.has_unfinished() or
                                           engine.block_manager.usage > 0):
        time.sleep(0.05)
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
