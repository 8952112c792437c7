"""A tiny-model server on a free port, run in-process by uvicorn in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_util import API_KEY, ENGINE_KWARGS, MODEL, Served

from mrv2 import EngineConfig
from mrv2.engine.engine import LLMEngine
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_checkpoint(path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(path)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="package")
def server(model_dir: Path) -> Iterator[Served]:
    yield from serve(model_dir)


def serve(model_dir: Path, engine_kwargs: dict[str, object] | None = None,
          **app_kwargs: object) -> Iterator[Served]:
    """Start a server on a free port (engine and ``create_app`` keywords as given), yield it,
    stop it."""
    from mrv2.entrypoints.server import create_app

    kwargs = {**ENGINE_KWARGS, **(engine_kwargs or {})}
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), **kwargs))
    app = create_app(engine, **{"served_model_name": MODEL, "api_key": API_KEY,
                                **app_kwargs})  # type: ignore[arg-type]
    port = _free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.05)
    else:
        raise RuntimeError("the server did not start")
    yield Served(url, engine, model_dir)
    srv.should_exit = True
    thread.join(15)
