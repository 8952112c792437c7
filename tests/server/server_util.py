"""Constants shared by the server tests (conftest.py builds the server)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mrv2.contract.params import SamplingParams
from mrv2.engine.engine import LLMEngine

API_KEY = "sk-test"
MODEL = "tiny"
ENGINE_KWARGS: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4, max_model_len=64,
                     num_gpu_blocks_override=512, max_num_seqs=128, seed=0)


@dataclass
class Served:
    url: str
    engine: LLMEngine
    model_dir: Path


def spy_add_request(monkeypatch: pytest.MonkeyPatch, engine: LLMEngine,
                    record: Callable[[SamplingParams], object]) -> None:
    """Wrap ``engine.add_request`` for the rest of the test (``monkeypatch`` undoes it) so
    that each request's sampling params go to ``record`` before the engine queues it: what
    a route made of a request's fields."""
    add = engine.add_request

    def add_request(ids: list[int], params: SamplingParams, *args: Any, **kwargs: Any) -> Any:
        record(params)
        return add(ids, params, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", add_request)


def join_tool_calls(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A chat stream's ``delta.tool_calls`` entries joined into whole calls, checking vLLM's
    shape on the way: a call's first entry has its (next) index, id, type and name; the
    others have only its index and an arguments piece, the last call's (calls do not
    interleave)."""
    calls: list[dict[str, Any]] = []
    for entry in entries:
        if "id" in entry:
            assert entry["index"] == len(calls) and entry["type"] == "function", entry
            assert entry["function"]["name"] and entry["id"], entry
            calls.append({"id": entry["id"], "type": "function",
                          "function": dict(entry["function"])})
        else:
            assert set(entry) == {"index", "function"} and set(entry["function"]) == {
                "arguments"}, entry
            assert calls and entry["index"] == len(calls) - 1, entry
            calls[-1]["function"]["arguments"] += entry["function"]["arguments"]
    return calls


def run_serve_cli(monkeypatch: pytest.MonkeyPatch, *flags: str) -> tuple[int, dict[str, Any]]:
    """``mrv2 serve`` with ``flags``, the engine and the server faked: its exit code and what
    it passed to the server."""
    import mrv2.engine.engine as engine_module
    import mrv2.entrypoints.server_run as run_module
    from mrv2.entrypoints.cli import main

    seen: dict[str, Any] = {}

    def run_server(*args: Any, **kwargs: Any) -> int:
        seen.update(kwargs)
        return 0

    monkeypatch.setattr(engine_module, "LLMEngine", lambda config: object())
    monkeypatch.setattr(run_module, "run_server", run_server)
    monkeypatch.setattr(run_module, "listen_socket", lambda host, port: None)
    base = ["serve", "m", "--device", "cpu", "--load-format", "dummy", "--no-engine-process"]
    return main([*base, *flags]), seen
