"""A client that leaves gets its request aborted within a couple of seconds, streamed or not,
for any ``n``, by beam search too; the engine ends idle with every KV block free."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from server_util import API_KEY, MODEL, Served

from conftest import serve
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def long_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """Room for long generations: a request runs for many seconds unless aborted."""
    path = tmp_path_factory.mktemp("long")
    make_tiny_checkpoint(path, "LlamaForCausalLM", vocab_size=320, max_position_embeddings=8192)
    make_tiny_tokenizer(path)
    yield from serve(path, {"max_model_len": 8192, "num_gpu_blocks_override": 8192})


def _wait_idle(server: Served, timeout: float = 3.0) -> None:
    engine = server.engine
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if not engine.has_unfinished() and engine.block_manager.usage == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"still running {timeout} s after the client left: {engine.stats()}")


def _aborted(server: Served, prefix: str = "mrv2_request_aborted_total", has: str = "") -> int:
    text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
    line = next(x for x in text.splitlines() if x.startswith(prefix) and has in x)
    return int(float(line.split()[-1]))


def _vllm_aborted(server: Served) -> int:
    """vLLM's count of aborted sequences: ``vllm:request_success{finished_reason="abort"}``."""
    return _aborted(server, "vllm:request_success_total{", 'finished_reason="abort"')


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 3])
def test_client_gone_aborts(long_server: Served, path: str, stream: bool, n: int) -> None:
    body: dict[str, object] = {"model": MODEL, "max_tokens": 8000, "ignore_eos": True,
                               "n": n, "stream": stream, "temperature": 0.8, "seed": 1}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Tell me a long story"}]
    else:
        body["prompt"] = "Once upon a time"
    before, vllm_before = _aborted(long_server), _vllm_aborted(long_server)
    # non-streamed: the client gives up after 1 s of silence; streamed: after its first chunk
    with pytest.raises(httpx.ReadTimeout), httpx.stream(
            "POST", f"{long_server.url}{path}", json=body, headers=AUTH,
            timeout=httpx.Timeout(10, read=1.0)) as response:
        for _ in response.iter_bytes():
            if stream:
                raise httpx.ReadTimeout("leaving after the first chunk")
    _wait_idle(long_server)  # within 3 s of the client leaving
    assert _aborted(long_server) == before + 1  # aborted, not finished (8000 tokens)
    assert _vllm_aborted(long_server) == vllm_before + n  # as vLLM counts them: each sequence


def test_beam_search_client_gone_aborts(long_server: Served) -> None:
    """Beam search (each step's beams one-token requests) stops when its client leaves: the
    step in flight is aborted and no other starts, long before ``max_tokens``."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000, "n": 2,
            "use_beam_search": True, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s of silence
        httpx.post(f"{long_server.url}/v1/completions", json=body, headers=AUTH,
                   timeout=httpx.Timeout(10, read=1.0))
    _wait_idle(long_server)
    for _ in range(10):  # and stays idle: not just between two steps
        time.sleep(0.03)
        assert not long_server.engine.has_unfinished(), "a beam search step after the client left"


@pytest.mark.parametrize("path", ["/v1/embeddings", "/pooling"])
def test_pooling_client_gone_aborts(long_server: Served, path: str) -> None:
    """Pooling requests (embeddings, ``/pooling``; scores and classification share the path)
    are aborted when the client leaves: of a batch of long inputs most never run (the step
    in flight ends first: on a busy machine one long prompt's step can take seconds)."""
    inputs = [[5 + (i * 31 + j) % 300 for j in range(6000)] for i in range(48)]
    before = _aborted(long_server)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s of silence
        httpx.post(f"{long_server.url}{path}", json={"model": MODEL, "input": inputs},
                   headers=AUTH, timeout=httpx.Timeout(10, read=1.0))
    _wait_idle(long_server, timeout=120)
    assert _aborted(long_server) - before >= len(inputs) // 2
