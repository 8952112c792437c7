"""A tiny-model server on a free port, run in-process by uvicorn in a background thread."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_util import API_KEY, ENGINE_KWARGS, MODEL, Served

from mrv2 import EngineConfig
from mrv2.engine.engine import LLMEngine
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer, serve_in_thread

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_checkpoint(path, "LlamaForCausalLM", vocab_size=320,
                         is_matryoshka=True)  # (embedding requests may ask for dimensions)
    make_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="package")
def server(model_dir: Path) -> Iterator[Served]:
    yield from serve(model_dir)


def serve(model_dir: Path, engine_kwargs: dict[str, object] | None = None,
          **app_kwargs: object) -> Iterator[Served]:
    """Start a server on a free port (engine and ``create_app`` keywords as given), yield it,
    stop it."""
    kwargs = {**ENGINE_KWARGS, **(engine_kwargs or {})}
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), **kwargs))
    from mrv2.entrypoints.server import create_app

    app_kwargs = {"served_model_name": MODEL, "api_key": API_KEY, **app_kwargs}
    for url in serve_in_thread(create_app(engine, **app_kwargs)):  # type: ignore[arg-type]
        yield Served(url, engine, model_dir)
