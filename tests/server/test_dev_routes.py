"""The development routes (``MRV2_SERVER_DEV_MODE=1``): ``/update_weights_from_disk`` loads
another checkpoint's weights between steps, after which the server answers as a fresh engine
on that checkpoint does, with the engine in this process and in its own;
``/reset_prefix_cache``; sleep mode's ``/sleep``, ``/wake_up`` and ``/is_sleeping`` (503 for
requests while asleep); a bad path is a 400 naming ``model_path``, a busy engine refuses, and
without the mode the routes do not exist."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, ENGINE_KWARGS, MODEL

from mrv2 import LLM, EngineConfig, SamplingParams
from mrv2.entrypoints.engine_calls import DEV_MODE_ENV, EngineBusy, run_engine_call
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer, serve_in_thread

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "Hello there"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dev")
    out = []
    for name, seed in (("a", 1), ("b", 2)):
        path = make_tiny_checkpoint(root / name, "Qwen3ForCausalLM", seed=seed, vocab_size=320)
        make_tiny_tokenizer(path)
        out.append(path)
    return out[0], out[1]


def _text(url: str) -> str:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def _want(path: Path) -> str:
    llm = LLM(str(path), **ENGINE_KWARGS)
    return llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0].outputs[0].text


def _check(url: str, a: Path, b: Path) -> None:
    assert _text(url) == _want(a) != _want(b)
    post = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(b)},
                      headers=AUTH, timeout=60)
    assert post.status_code == 200 and post.json()["success"], post.text
    assert _text(url) == _want(b)
    assert httpx.post(f"{url}/reset_prefix_cache", headers=AUTH, timeout=60).status_code == 200
    bad = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": "/nonexistent"},
                     headers=AUTH, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "model_path"


def _serving(path: Path, process: bool, **overrides: Any) -> Iterator[str]:
    from mrv2.engine.engine import LLMEngine
    from mrv2.entrypoints.engine_process import RemoteEngine
    from mrv2.entrypoints.server import create_app

    config = EngineConfig.from_kwargs(model=str(path), **{**ENGINE_KWARGS, **overrides})
    engine = RemoteEngine(config) if process else LLMEngine(config)
    try:
        yield from serve_in_thread(create_app(engine, served_model_name=MODEL,
                                              api_key=API_KEY))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("process", [False, True])
def test_weights_update_from_disk_between_steps(checkpoints: tuple[Path, Path], process: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEV_MODE_ENV, "1")
    a, b = checkpoints
    for url in _serving(a, process):
        _check(url, a, b)


def test_without_dev_mode_the_routes_do_not_exist(checkpoints: tuple[Path, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEV_MODE_ENV, raising=False)
    for url in _serving(checkpoints[0], False):
        for route in ("/reset_prefix_cache", "/update_weights_from_disk", "/sleep",
                      "/wake_up", "/init_weights_update_group",
                      "/update_weights_from_distributed", "/collective_rpc"):
            assert httpx.post(f"{url}{route}", json={}, headers=AUTH,
                              timeout=60).status_code == 404


def test_a_busy_engine_refuses(checkpoints: tuple[Path, Path]) -> None:
    llm = LLM(str(checkpoints[0]), **ENGINE_KWARGS)
    llm.engine.add_request([5, 6, 7], SamplingParams(max_tokens=4))
    with pytest.raises(EngineBusy, match="requests are in flight"):
        run_engine_call(llm.engine, "update_weights_from_disk", str(checkpoints[1]))
    with pytest.raises(EngineBusy, match="requests are in flight"):
        run_engine_call(llm.engine, "sleep", 1)
    assert run_engine_call(llm.engine, "is_sleeping", None) is False  # (asked any time)
    with pytest.raises(ValueError, match="unknown engine call"):
        run_engine_call(llm.engine, "shutdown", None)


def test_a_checkpoint_of_another_model_changes_no_weight(checkpoints: tuple[Path, Path],
                                                        tmp_path: Path) -> None:
    """/update_weights_from_disk's load with a checkpoint of a deeper model (its first
    tensors fit, its third layer's match nothing): the 400 (a ValueError) comes before any
    tensor is loaded, so the engine answers as before."""
    a, _ = checkpoints
    other = make_tiny_checkpoint(tmp_path / "deep", "Qwen3ForCausalLM", seed=5,
                                 num_hidden_layers=3, vocab_size=320)
    llm = LLM(str(a), **ENGINE_KWARGS)
    with pytest.raises(ValueError, match="matches no parameter"):
        run_engine_call(llm.engine, "update_weights_from_disk", str(other))
    assert llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)[0].outputs[0].text == _want(a)


def _completion(url: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)


def _sleeping(url: str) -> bool:
    response = httpx.get(f"{url}/is_sleeping", headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return bool(response.json()["is_sleeping"])


def _gauge(url: str, name: str) -> float:
    """``name``'s value in /metrics, once the engine's stats have caught up (they are taken
    between steps, just after a call returns)."""
    import time

    value = float("nan")
    for _ in range(50):
        text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=60).text
        value = float(next(line.rsplit(" ", 1)[1] for line in text.splitlines()
                           if line.startswith(name + "{")))
        if value in (0.0, 1.0) and (value == 1.0) == _sleeping(url):
            return value
        time.sleep(0.1)
    return value


@pytest.mark.parametrize("process", [False, True])
def test_sleep_and_wake_up_routes(checkpoints: tuple[Path, Path], process: bool,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEV_MODE_ENV, "1")
    a, _ = checkpoints
    want = _want(a)
    for url in _serving(a, process):
        assert _text(url) == want and not _sleeping(url)
        for level in ("3", "x"):
            bad = httpx.post(f"{url}/sleep", params={"level": level}, headers=AUTH, timeout=60)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "level"
        assert httpx.post(f"{url}/sleep", headers=AUTH, timeout=60).status_code == 200
        assert _sleeping(url)
        assert _gauge(url, "mrv2_engine_sleeping") == 1.0
        refused = _completion(url)
        assert refused.status_code == 503 and "POST /wake_up" in refused.text
        bad = httpx.post(f"{url}/wake_up", params={"tags": "weight"}, headers=AUTH, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tags"
        woken = httpx.post(f"{url}/wake_up", params={"tags": "weights"}, headers=AUTH,
                           timeout=60)
        assert woken.status_code == 200 and _sleeping(url)  # the KV cache still sleeps
        assert _completion(url).status_code == 503
        assert httpx.post(f"{url}/wake_up", headers=AUTH, timeout=60).status_code == 200
        assert not _sleeping(url) and _text(url) == want
        assert _gauge(url, "mrv2_engine_sleeping") == 0.0
        # level 2: no request until new weights are loaded
        assert httpx.post(f"{url}/sleep", params={"level": 2}, headers=AUTH,
                          timeout=60).status_code == 200
        assert httpx.post(f"{url}/wake_up", headers=AUTH, timeout=60).status_code == 200
        refused = _completion(url)
        assert refused.status_code == 503 and "/update_weights_from_disk" in refused.text
        post = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(a)},
                          headers=AUTH, timeout=60)
        assert post.status_code == 200, post.text
        assert _text(url) == want


@pytest.mark.parametrize("process", [False, True])
def test_weights_from_a_trainers_process_group(checkpoints: tuple[Path, Path], process: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's routes: the server joins the trainer's group (gloo here), then loads the
    tensors the trainer broadcasts; vLLM's /collective_rpc runs a runner method by name."""
    import socket
    import threading

    from mrv2.distributed.weight_sync import trainer_group
    from mrv2.model_loader.loader import iter_safetensors

    monkeypatch.setenv(DEV_MODE_ENV, "1")
    a, b = checkpoints
    tensors = list(iter_safetensors(str(b)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    for url in _serving(a, process):
        box: dict[str, object] = {}
        joining = threading.Thread(target=lambda box=box: box.update(group=trainer_group(
            "127.0.0.1", port, 2, backend="gloo")))
        joining.start()
        joined = httpx.post(f"{url}/init_weights_update_group", headers=AUTH, timeout=60,
                            json={"master_address": "127.0.0.1", "master_port": port,
                                  "rank_offset": 1, "world_size": 2, "backend": "gloo"})
        joining.join(60)
        assert joined.status_code == 200 and joined.json()["success"], joined.text
        group = box["group"]
        send = group.broadcast  # type: ignore[attr-defined]
        sending = threading.Thread(target=lambda send=send: [send(t.contiguous())
                                                             for _, t in tensors])
        sending.start()
        body = {"names": [n for n, _ in tensors],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors], "flush_cache": True}
        loaded = httpx.post(f"{url}/update_weights_from_distributed", json=body, headers=AUTH,
                            timeout=60)
        sending.join(60)
        assert loaded.status_code == 200 and loaded.json()["success"], loaded.text
        assert _text(url) == _want(b)
        bad = httpx.post(f"{url}/update_weights_from_distributed", headers=AUTH, timeout=60,
                         json={"names": ["x"], "dtypes": ["float33"], "shapes": [[1]]})
        assert bad.status_code == 400 and "float33" in bad.text
        left = httpx.post(f"{url}/destroy_weights_update_group", json={}, headers=AUTH,
                          timeout=60)
        assert left.status_code == 200 and left.json()["success"]
        group.close()  # type: ignore[attr-defined]
        rpc = httpx.post(f"{url}/collective_rpc", headers=AUTH, timeout=60,
                         json={"method": "load_weights", "args": [[]]})
        assert rpc.status_code == 200 and rpc.json() == {"results": [[]]}, rpc.text
        bad = httpx.post(f"{url}/collective_rpc", json={"method": "_forward"}, headers=AUTH,
                         timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "method"


@pytest.mark.parametrize("process", [False, True])
def test_pause_and_continue_generation(checkpoints: tuple[Path, Path], process: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's /pause_generation: a request sent while paused waits (the weights change
    meanwhile, requests in flight or not) and is answered once generation continues."""
    import threading

    monkeypatch.setenv(DEV_MODE_ENV, "1")
    a, b = checkpoints
    for url in _serving(a, process):
        bad = httpx.post(f"{url}/pause_generation", json={"mode": "stop"}, headers=AUTH,
                         timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "mode"
        paused = httpx.post(f"{url}/pause_generation", json={"mode": "retract"},
                            headers=AUTH, timeout=60)
        assert paused.status_code == 200, paused.text
        assert httpx.get(f"{url}/is_paused", headers=AUTH, timeout=60).json()["is_paused"]
        box: dict[str, str] = {}
        waiting = threading.Thread(target=lambda box=box, url=url: box.update(text=_text(url)))
        waiting.start()
        waiting.join(2.0)
        assert waiting.is_alive()  # (it waits while paused)
        post = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(b)},
                          headers=AUTH, timeout=60)
        assert post.status_code == 200, post.text
        assert httpx.post(f"{url}/continue_generation", headers=AUTH,
                          timeout=60).status_code == 200
        waiting.join(60)
        assert box["text"] == _want(b)
        assert not httpx.get(f"{url}/is_paused", headers=AUTH, timeout=60).json()["is_paused"]


def _stream_in_thread(url: str, max_tokens: int) -> tuple[Any, Any, dict[str, Any]]:
    """A streamed completion in a thread: an event set at its first chunk, and its last
    chunk's choice (``box["last"]``) once it ends."""
    import json
    import threading

    started = threading.Event()
    box: dict[str, Any] = {}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}

    def read() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH,
                          timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    choice = json.loads(line[6:])["choices"][0]
                    box["tokens"] = box.get("tokens", 0) + 1
                    if choice.get("finish_reason"):
                        box["last"] = choice
        started.set()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, started, box


@pytest.mark.parametrize("process", [False, True])
def test_vllm_pause_aborts_or_waits_then_resume(checkpoints: tuple[Path, Path], process: bool,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's /pause: by default the requests in flight end with finish_reason "abort" (one
    held by a pause first, so it is surely in flight); with wait_for_inflight_requests they
    run to their end before /pause answers; /resume lets new requests run."""
    monkeypatch.setenv(DEV_MODE_ENV, "1")
    a, _ = checkpoints
    for url in _serving(a, process, max_model_len=256):
        # long: still running when the hold lands, on a loaded machine too (40 tokens once
        # finished first: "length", not "abort")
        thread, started, box = _stream_in_thread(url, 240)
        assert started.wait(60)
        held = httpx.post(f"{url}/pause_generation", json={"mode": "keep"}, headers=AUTH,
                          timeout=60)
        assert held.status_code == 200
        assert httpx.post(f"{url}/pause", headers=AUTH, timeout=60).status_code == 200
        thread.join(60)
        assert box["last"]["finish_reason"] == "abort"
        bad = httpx.post(f"{url}/pause", params={"clear_cache": "maybe"}, headers=AUTH,
                         timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "clear_cache"
        assert httpx.post(f"{url}/resume", headers=AUTH, timeout=60).status_code == 200
        thread, started, box = _stream_in_thread(url, 40)
        assert started.wait(60)
        waited = httpx.post(f"{url}/pause", params={"wait_for_inflight_requests": "true"},
                            headers=AUTH, timeout=60)
        assert waited.status_code == 200
        assert httpx.get(f"{url}/is_paused", headers=AUTH, timeout=60).json()["is_paused"]
        thread.join(60)
        assert box["last"]["finish_reason"] == "length"  # (it ran to its end)
        assert httpx.post(f"{url}/resume", headers=AUTH, timeout=60).status_code == 200
        assert _text(url) == _want(a)


class _DrainingWorker:
    """A worker whose engine drains (``pause_generation("wait")``) until a resume."""

    def __init__(self) -> None:
        self.draining = self.paused = False

    async def call(self, op: str, arg: Any) -> Any:
        if op == "pause_generation":
            self.draining = arg == "wait"
            self.paused = arg != "wait"
        elif op == "continue_generation":
            self.draining = self.paused = False
        return {"is_paused": self.paused, "is_draining": self.draining}.get(op)


def test_pause_waiting_for_requests_answers_409_when_resumed_first() -> None:
    """/pause?wait_for_inflight_requests=true polls until the engine pauses; a /resume that
    comes first ends the drain, so the engine never pauses: /pause answers 409 (it polled
    forever before) instead of hanging."""
    import asyncio

    from fastapi import FastAPI

    from mrv2.entrypoints.dev_routes import add_dev_routes
    from mrv2.entrypoints.responses import APIError

    app = FastAPI()

    async def on_error(request: Any, error: Any) -> Any:
        return error.response()

    app.add_exception_handler(APIError, on_error)
    worker = _DrainingWorker()

    async def body(request: Any) -> dict[str, Any]:
        return {}

    add_dev_routes(app, worker, body)

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            pause = asyncio.ensure_future(client.post(
                "/pause", params={"wait_for_inflight_requests": "true"}))
            while not worker.draining:
                await asyncio.sleep(0.01)
            resumed = await client.post("/resume")
            return await asyncio.wait_for(pause, 10), resumed

    paused, resumed = asyncio.run(scenario())
    assert resumed.status_code == 200
    assert paused.status_code == 409
    assert paused.json()["error"]["param"] == "wait_for_inflight_requests"
