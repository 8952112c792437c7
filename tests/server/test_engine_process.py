"""``mrv2 serve``'s default: the engine in a child process. Its answers equal the
engine thread's (streamed or not, n > 1, logprobs); the engine's own refusals are 400s; a
client that leaves has its request aborted; a dead engine process makes the server answer
503. The deltas between the processes rebuild every cumulative output exactly."""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, ENGINE_KWARGS, MODEL, Served

from mrv2 import EngineConfig, hookimpl, plugins
from mrv2.engine.output_deltas import DeltaEncoder, OutputAccumulator
from mrv2.engine.outputs import CompletionOutput, Logprob, RequestOutput
from mrv2.testing import serve_in_thread

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _remote(model_dir: Path, app_kwargs: dict[str, Any] | None = None,
            **overrides: Any) -> Iterator[tuple[str, Any]]:
    from mrv2.entrypoints.engine_process import RemoteEngine
    from mrv2.entrypoints.server import create_app

    engine = RemoteEngine(EngineConfig.from_kwargs(model=str(model_dir),
                                                   **{**ENGINE_KWARGS, **overrides}))
    try:
        for url in serve_in_thread(create_app(engine, served_model_name=MODEL,
                                              api_key=API_KEY, **(app_kwargs or {}))):
            yield url, engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def remote(model_dir: Path) -> Iterator[tuple[str, Any]]:
    yield from _remote(model_dir)


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, **body}, headers=AUTH,
                      timeout=60)


def _streamed(url: str, body: dict[str, Any]) -> dict[int, tuple[str, str | None, int]]:
    """choice index -> (text, finish reason, chunks) of a streamed completion."""
    got: dict[int, tuple[str, str | None, int]] = {}
    with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "stream": True, **body}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                text, reason, chunks = got.get(c["index"], ("", None, 0))
                got[c["index"]] = (text + c["text"], c["finish_reason"] or reason, chunks + 1)
    return got


BODIES = [
    {"prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0},
    {"prompt": [9, 3, 4], "max_tokens": 9, "temperature": 0.8, "seed": 3, "n": 2},
    {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0, "logprobs": 2},
    {"prompt": "hello world", "max_tokens": 10, "temperature": 0, "stop": ["ld"]},
    {"prompt": [5, 6], "max_tokens": 20, "temperature": 0.8, "seed": 2,
     "guided_choice": ["Paris", "London"]},
    {"prompt": "hello world", "max_tokens": 4, "temperature": 0.8, "seed": 5, "n": 2,
     "echo": True, "logprobs": 1},
    {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2},
]


@pytest.mark.parametrize("body", BODIES, ids=["greedy", "n2_seeded", "logprobs", "stop",
                                              "structured", "echo", "prompt_logprobs"])
def test_the_same_answers_as_the_engine_thread(server: Served, remote: tuple[str, Any],
                                               body: dict[str, Any]) -> None:
    want, got = _post(server.url, body).json(), _post(remote[0], body).json()
    assert got["choices"] == want["choices"] and got["usage"] == want["usage"]
    streamed = _streamed(remote[0], body)
    assert {i: (t, r) for i, (t, r, _) in streamed.items()} == {
        c["index"]: (c["text"], c["finish_reason"]) for c in want["choices"]}


def test_a_streamed_answer_never_holds_text_a_stop_string_cuts(
        server: Served, remote: tuple[str, Any]) -> None:
    """Stop strings cut from a greedy answer (three characters that occur once in it, of
    tokens of several characters: most lie across a token boundary): streamed through either
    worker, the answer is the text before the stop string, as the whole answer is; no chunk
    sent what the stop string then cut."""
    body: dict[str, Any] = {"prompt": "hello world", "max_tokens": 16, "temperature": 0,
                            "ignore_eos": True,  # the tokenizer's merges: text of whole chars
                            "allowed_token_ids": list(range(260, 320))}
    text = _post(server.url, body).json()["choices"][0]["text"]
    stops = [(k, text[k:k + 3]) for k in range(1, len(text) - 2)
             if text.count(text[k:k + 3]) == 1 and "\ufffd" not in text[:k + 3]][:6]
    assert len(stops) >= 3, f"{text!r} has too few unique stop strings: change the prompt"
    for k, stop in stops:
        whole = _post(server.url, {**body, "stop": [stop]}).json()["choices"][0]
        assert (whole["text"], whole["finish_reason"]) == (text[:k], "stop")
        for url in (server.url, remote[0]):
            streamed = _streamed(url, {**body, "stop": [stop]})
            assert streamed[0][:2] == (text[:k], "stop"), (stop, url)


def test_the_responses_api_through_the_engine_process(server: Served,
                                                      remote: tuple[str, Any]) -> None:
    body = {"model": MODEL, "input": "Hello world", "max_output_tokens": 6, "temperature": 0}
    got = [httpx.post(f"{url}/v1/responses", json=body, headers=AUTH, timeout=60).json()
           for url in (server.url, remote[0])]
    assert got[0]["output"][0]["content"] == got[1]["output"][0]["content"]

    def counts(usage: dict[str, Any]) -> dict[str, Any]:
        """The usage but the prefix cache's hits (the shared server may have seen the prompt
        in an earlier module's test; the remote one is fresh)."""
        return {**usage, "input_tokens_details": None}

    assert counts(got[0]["usage"]) == counts(got[1]["usage"])
    assert got[1]["status"] in ("completed", "incomplete")


def test_delta_outputs_cross_as_they_are() -> None:
    """A DELTA request's outputs (the server's) go through the encoder and the accumulator
    unchanged, n > 1 choices one at a time, and neither keeps anything of them."""
    encoder, accumulator = DeltaEncoder(), OutputAccumulator()
    outputs = [
        RequestOutput("r", None, [1], [CompletionOutput(1, "ab", [3, 4], logprobs=[
            {3: Logprob(-0.5, 1)}, {4: Logprob(-1.5, 2)}], cumulative_logprob=-2.0)], False,
                      num_cached_tokens=4, delta=True),
        RequestOutput("r", None, [1], [CompletionOutput(0, "c", [5])], False, delta=True),
        RequestOutput("r", None, [1], [CompletionOutput(1, "", [6], "stop", "x")], True,
                      delta=True),
    ]
    for original in outputs:
        rebuilt = accumulator.apply(encoder.encode(original))
        assert rebuilt.delta and rebuilt.finished == original.finished
        assert rebuilt.num_cached_tokens == original.num_cached_tokens
        assert rebuilt.outputs == original.outputs
        assert rebuilt.new_token_ids == original.outputs[0].token_ids
    assert not encoder._sent and not accumulator._outputs


def test_tokenize_and_detokenize_in_the_servers_process(remote: tuple[str, Any]) -> None:
    url = remote[0]
    ids = httpx.post(f"{url}/tokenize", headers=AUTH, timeout=60,
                     json={"prompt": "hello world", "add_special_tokens": False}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 64
    text = httpx.post(f"{url}/detokenize", headers=AUTH, timeout=60,
                      json={"tokens": ids["tokens"]}).json()
    assert text == {"prompt": "hello world"}
    bad = httpx.post(f"{url}/detokenize", headers=AUTH, timeout=60, json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_a_request_the_engine_refuses_is_a_400(model_dir: Path) -> None:
    """The engine's own check (KV blocks) runs in the child: its message comes back as 400."""
    for url, engine in _remote(model_dir, num_gpu_blocks_override=8, max_model_len=64):
        response = _post(url, {"prompt": [5] * 20, "max_tokens": 30})
        assert response.status_code == 400, response.text
        assert "KV blocks" in response.json()["error"]["message"]
        assert engine.process.num_pending == 0
        assert _post(url, {"prompt": [5, 6], "max_tokens": 4}).status_code == 200
        break


def test_a_client_that_leaves_has_its_request_aborted(remote: tuple[str, Any]) -> None:
    url, engine = remote
    with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=60,
                      json={"model": MODEL, "prompt": [5, 6], "max_tokens": 50,
                            "stream": True, "ignore_eos": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first chunk
    deadline = time.monotonic() + 30
    while engine.process.num_pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.process.num_pending == 0
    text = httpx.get(f"{url}/metrics", headers=AUTH).text
    assert 'mrv2_request_aborted_total{model_name="tiny"} 1.0' in text
    # (and on vLLM's series, where vLLM counts an aborted request)
    assert ('vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} '
            '1.0') in text
    for process in ("server", "engine"):  # each process's collector pauses
        assert f'mrv2_gc_pause_seconds_total{{model_name="tiny",process="{process}"}}' in text


@pytest.mark.parametrize("zygote", ["1", "0"], ids=["forked", "spawned"])
def test_a_dead_engine_process_makes_the_server_answer_503(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, zygote: str) -> None:
    """Killed, the engine process is named with its signal, forked from the zygote
    (``MRV2_WORKER_ZYGOTE=1``, the CPU suite's) or spawned (the default)."""
    from multiprocessing.process import BaseProcess

    from mrv2.executor.zygote import ForkedWorker

    monkeypatch.setenv("MRV2_WORKER_ZYGOTE", zygote)
    for url, engine in _remote(model_dir):
        assert isinstance(engine.process._process,
                          ForkedWorker if zygote == "1" else BaseProcess)
        assert _post(url, {"prompt": [5, 6], "max_tokens": 3}).status_code == 200
        engine.process._process.kill()
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{url}/health").status_code == 503
        assert str(engine.process.fatal) == "the engine process exited (-9)"
        response = _post(url, {"prompt": [5, 6], "max_tokens": 3})
        assert response.status_code == 503 and "engine" in response.json()["error"]["message"]
        break


def test_deltas_rebuild_every_cumulative_output() -> None:
    """Random cumulative outputs (two choices appearing out of order, logprobs, text that a
    stop string cuts back, the end) through the encoder and the accumulator: every rebuilt
    output equals the original."""
    rng = random.Random(0)
    encoder, accumulator = DeltaEncoder(), OutputAccumulator()
    state: dict[int, CompletionOutput] = {}
    for step in range(40):
        finished = step == 39
        for index in ([1] if step < 3 else [0, 1]):
            c = state.setdefault(index, CompletionOutput(index, "", [], logprobs=[]))
            new = [rng.randrange(100) for _ in range(rng.randrange(0, 3))]
            c.token_ids = c.token_ids + new
            c.logprobs = (c.logprobs or []) + [{t: Logprob(-1.0, 1)} for t in new]
            c.cumulative_logprob = -float(len(c.token_ids))
            if rng.random() < 0.15 and c.text:  # a stop string matched: cut back
                c.text = c.text[: rng.randrange(len(c.text))]
            else:
                c.text += "".join(rng.choice("ab\u00e9\u4e2d") for _ in new)
            if finished:
                c.finish_reason, c.stop_reason = "stop", "ld"
        original = RequestOutput("r", None, [1, 2], [state[i] for i in sorted(state)],
                                 finished=finished)
        rebuilt = accumulator.apply(encoder.encode(original))
        assert rebuilt.finished == finished
        assert [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason,
                 c.cumulative_logprob) for c in rebuilt.outputs] == [
            (c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason,
             c.cumulative_logprob) for c in original.outputs]
    assert not encoder._sent and not accumulator._outputs  # the finished request is gone


def test_engine_process_is_refused_under_torchrun(model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Under torchrun every rank is torchrun's: the flag is refused before anything starts."""
    from mrv2.entrypoints.cli import main

    for var, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(var, value)
    assert main(["serve", str(model_dir), "--device", "cpu", "--port", "0",
                 "--engine-process"]) == 2
    assert "--engine-process" in capsys.readouterr().err


@pytest.mark.parametrize("flag,torchrun,expected", [
    (None, False, "RemoteEngine"), (None, True, "LLMEngine"),
    ("--no-engine-process", False, "LLMEngine"), ("--engine-process", False, "RemoteEngine")])
def test_serve_runs_the_engine_in_a_process_of_its_own_by_default(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, flag: str | None, torchrun: bool,
        expected: str) -> None:
    """``mrv2 serve`` without the flag: a child process, except under torchrun (each rank is
    a process torchrun started), where the engine runs on a thread; the flag overrides."""
    import mrv2.engine.engine as engine_module
    import mrv2.entrypoints.engine_process as process_module
    import mrv2.entrypoints.server_run as server_module
    from mrv2.entrypoints.cli import main

    built: list[str] = []
    for module, name in ((engine_module, "LLMEngine"), (process_module, "RemoteEngine")):
        monkeypatch.setattr(module, name, lambda *a, _name=name, **k: built.append(_name))
    socks: list[Any] = []
    monkeypatch.setattr(server_module, "run_server", lambda *a, **k: socks.append(k["sock"]) or 0)
    if torchrun:
        for var, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")):
            monkeypatch.setenv(var, value)
    assert main(["serve", str(model_dir), "--device", "cpu", "--port", "0",
                 *([flag] if flag else [])]) == 0
    assert built == [expected]
    assert socks[0] is not None  # rank 0 under torchrun binds it too
    socks[0].close()


def test_an_engine_that_cannot_start_is_a_clear_error(tmp_path: Path) -> None:
    """A checkpoint the engine cannot load: the child's reason, raised in the server's process
    before anything serves."""
    from mrv2.entrypoints.engine_process import RemoteEngine

    config = {"architectures": ["NoSuchModel"], "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(RuntimeError, match="the engine could not start.*NoSuchModel"):
        RemoteEngine(EngineConfig.from_kwargs(model=str(tmp_path), device="cpu"))


def test_the_engine_process_samples_itself_under_the_profile_variable(
        model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``MRV2_SERVE_PROFILE=FILE``: the engine's own process writes its report to FILE.engine
    when it stops (the server's process writes FILE)."""
    from mrv2.entrypoints.stack_sampler import PROFILE_ENV_VAR

    path = tmp_path / "profile.txt"
    monkeypatch.setenv(PROFILE_ENV_VAR, str(path))  # (the child inherits it)
    for url, _ in _remote(model_dir):  # some steps to sample (a sample every 2 ms)
        response = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60, json={
            "model": MODEL, "prompt": [5, 6], "max_tokens": 16, "ignore_eos": True})
        assert response.status_code == 200
    report = Path(f"{path}.engine").read_text()
    assert "== thread" in report and "MainThread" in report


def test_the_engine_process_logs_at_the_commands_level(
        model_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The ``mrv2`` command configured logging: the child logs its start-up report (the KV
    cache, the engine ready, a structured-outputs backend note) to the same stderr at the same
    level, each line once (the note is the engine's, not the config's)."""
    import logging

    from mrv2.logs import _Handler, configure_logging

    root = logging.getLogger("mrv2")
    configure_logging("INFO")
    try:
        config = EngineConfig.from_kwargs(structured_outputs_config={"backend": "outlines"})
        for url, _ in _remote(model_dir, structured_outputs_config=config.structured_outputs):
            assert _post(url, {"prompt": [5, 6], "max_tokens": 2}).status_code == 200
    finally:
        for handler in [h for h in root.handlers if isinstance(h, _Handler)]:
            root.removeHandler(handler)
        root.setLevel(logging.NOTSET)
    err = capfd.readouterr().err
    assert "mrv2.runner: KV cache:" in err and "engine ready in" in err, err
    assert err.count("structured_outputs_config.backend='outlines': mrv2 uses llguidance") == 1


class InHousePlugin:
    """A private plugin registered in code (a module's top level: the engine's process, which
    loads plugins from their entry points only, gets it pickled)."""

    @hookimpl
    def mrv2_register_models(self, register: Any) -> None:
        register("InHouseForCausalLM", "mrv2_llama.model:LlamaForCausalLM")


def test_a_plugin_registered_in_code_reaches_the_engine_process(
        server: Served, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The docs' in-code registration (``get_plugin_manager().register``, before the engine is
    built) serves through ``mrv2 serve``'s default engine process too, as through ``LLM``."""
    private = tmp_path / "in-house"
    shutil.copytree(model_dir, private)
    config = json.loads((private / "config.json").read_text())
    config["architectures"] = ["InHouseForCausalLM"]
    (private / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(plugins, "_DEFAULT_MANAGER", plugins.PluginManager())
    plugins.get_plugin_manager().register(InHousePlugin(), name="in-house")
    body = BODIES[0]
    for url, engine in _remote(private):
        assert engine.process.info.architecture == "InHouseForCausalLM"
        assert _post(url, body).json()["choices"] == _post(server.url, body).json()["choices"]


def test_a_plugin_that_cannot_reach_the_engine_process_is_a_clear_error(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Local:  # (a class inside a function: no pickle finds it)
        @hookimpl
        def mrv2_register_models(self, register: Any) -> None:
            pass

    monkeypatch.setattr(plugins, "_DEFAULT_MANAGER", plugins.PluginManager())
    plugins.get_plugin_manager().register(Local(), name="local-plugin")
    with pytest.raises(ValueError, match="'local-plugin'.*--no-engine-process"):
        list(_remote(model_dir))
