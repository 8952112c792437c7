"""``mrv2 serve --lora-modules``: a request whose ``model`` names an adapter gets
``LLM.generate``'s answer through that adapter (completions and chat, streamed and whole, the
engine in this process and in its own); ``/v1/models`` lists the adapters under their base
model; bad flags and unknown names are clear errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, ENGINE_KWARGS, MODEL, Served

from conftest import serve
from mrv2 import LLM, EngineConfig, LoRARequest, SamplingParams
from mrv2.entrypoints.lora_modules import parse_lora_modules
from mrv2.testing import serve_in_thread
from mrv2.testing_checkpoints import make_lora_adapter

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [5, 9, 3, 17, 4, 60, 2]
LORA_KWARGS = {"enable_lora": True, "max_loras": 2}


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    first = make_lora_adapter(model_dir, root / "first", rank=8, seed=3)
    second = make_lora_adapter(model_dir, root / "second", rank=4, seed=4,
                               targets=("o_proj", "up_proj"))
    return parse_lora_modules([f"first={first}",
                               json.dumps({"name": "second", "path": str(second)})])


@pytest.fixture(scope="module")
def want(model_dir: Path, adapters: list[LoRARequest]) -> dict[str | None, list[int]]:
    llm = LLM(str(model_dir), **{**ENGINE_KWARGS, **LORA_KWARGS})
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    names: list[LoRARequest | None] = [None, *adapters]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(names), params, use_tqdm=False,
                        lora_request=names)
    got = {lora.lora_name if lora else None: o.outputs[0].token_ids
           for lora, o in zip(names, outs, strict=True)}
    assert len({tuple(t) for t in got.values()}) == 3  # each adapter changes the answer
    return got


@pytest.fixture(scope="module")
def lora_server(model_dir: Path, adapters: list[LoRARequest]) -> Iterator[Served]:
    yield from serve(model_dir, LORA_KWARGS, lora_modules=adapters)


def _ids(url: str, model: str, stream: bool = False) -> tuple[list[int], str]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": stream}
    if not stream:
        answer = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH,
                            timeout=60).json()
        return answer["choices"][0]["token_ids"], answer["model"]
    ids: list[int] = []
    name = ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH,
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                name = chunk["model"]
                for choice in chunk["choices"]:
                    ids += choice.get("token_ids") or []
    return ids, name


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_naming_an_adapter_runs_through_it(
        lora_server: Served, want: dict[str | None, list[int]], stream: bool) -> None:
    for name in (None, "first", "second"):
        ids, model = _ids(lora_server.url, name or MODEL, stream)
        assert ids == want[name]
        assert model == (name or MODEL)  # answers carry the name asked for


def test_chat_names_an_adapter_too(lora_server: Served, model_dir: Path) -> None:
    body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True}
    answers = {name: httpx.post(f"{lora_server.url}/v1/chat/completions", headers=AUTH,
                                json={**body, "model": name}, timeout=60).json()
               for name in (MODEL, "first")}
    assert answers["first"]["model"] == "first"
    texts = {n: a["choices"][0]["message"]["content"] for n, a in answers.items()}
    assert texts[MODEL] != texts["first"]


def test_models_lists_the_adapters(lora_server: Served, adapters: list[LoRARequest]) -> None:
    cards = httpx.get(f"{lora_server.url}/v1/models", headers=AUTH).json()["data"]
    assert [c["id"] for c in cards] == [MODEL, "first", "second"]
    assert [c.get("parent") for c in cards] == [None, MODEL, MODEL]
    assert cards[1]["root"] == adapters[0].lora_path


def test_an_unknown_model_is_a_404_naming_the_adapters(lora_server: Served) -> None:
    response = httpx.post(f"{lora_server.url}/v1/completions", headers=AUTH, timeout=60,
                          json={"model": "third", "prompt": PROMPT, "max_tokens": 2})
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert "'third' does not exist" in message and "'first'" in message


def test_the_engine_process_serves_adapters(model_dir: Path, adapters: list[LoRARequest],
                                            want: dict[str | None, list[int]]) -> None:
    from mrv2.entrypoints.engine_process import RemoteEngine
    from mrv2.entrypoints.server import create_app

    engine = RemoteEngine(EngineConfig.from_kwargs(model=str(model_dir),
                                                   **{**ENGINE_KWARGS, **LORA_KWARGS}))
    try:
        app = create_app(engine, served_model_name=MODEL, api_key=API_KEY,
                         lora_modules=adapters)
        for url in serve_in_thread(app):
            for name in (None, "second", "first"):
                assert _ids(url, name or MODEL, stream=name == "second")[0] == want[name]
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("items", "match"), [
    (["first"], "is not NAME=PATH"),
    (["a=/x", "a=/y"], "given twice"),
    (['{"name": "a"}'], "'name' and 'path'"),
    (["{oops"], "not valid JSON"),
])
def test_bad_lora_modules_flags(items: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_lora_modules(items)


def test_adapters_are_checked_before_the_server_starts(model_dir: Path, tmp_path: Path,
                                                       adapters: list[LoRARequest]) -> None:
    from mrv2.engine.engine import LLMEngine
    from mrv2.entrypoints.server import create_app

    plain = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), **ENGINE_KWARGS))
    with pytest.raises(ValueError, match="needs --enable-lora"):
        create_app(plain, lora_modules=adapters)
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir),
                                                **{**ENGINE_KWARGS, **LORA_KWARGS}))
    missing = LoRARequest("gone", 1, str(tmp_path / "gone"))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        create_app(engine, lora_modules=[missing])
    with pytest.raises(ValueError, match="base model's name"):
        create_app(engine, served_model_name="first", lora_modules=adapters)


def test_adapters_load_and_unload_at_runtime(model_dir: Path, adapters: list[LoRARequest],
                                             want: dict[str | None, list[int]],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``MRV2_ALLOW_RUNTIME_LORA_UPDATING=1``: vLLM's load/unload routes; a name loaded
    again from another path is another adapter (a new id: nothing of the old one reused)."""
    monkeypatch.setenv("MRV2_ALLOW_RUNTIME_LORA_UPDATING", "1")
    for served in serve(model_dir, LORA_KWARGS):
        url = served.url

        def post(route: str, body: dict[str, str], url: str = url) -> httpx.Response:
            return httpx.post(f"{url}/v1/{route}", json=body, headers=AUTH, timeout=60)

        first, second = adapters
        assert post("load_lora_adapter", {"lora_name": "mine", "lora_path": first.lora_path}
                    ).status_code == 200
        assert _ids(url, "mine")[0] == want["first"]
        again = post("load_lora_adapter", {"lora_name": "mine", "lora_path": first.lora_path})
        assert again.status_code == 400 and "loaded already" in again.json()["error"]["message"]
        bad = post("load_lora_adapter", {"lora_name": "bad", "lora_path": str(model_dir)})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
        assert "no adapter_config.json" in bad.json()["error"]["message"]
        base = post("load_lora_adapter", {"lora_name": MODEL, "lora_path": first.lora_path})
        assert base.status_code == 400 and base.json()["error"]["param"] == "lora_name"
        assert post("unload_lora_adapter", {"lora_name": "mine"}).status_code == 200
        gone = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                          json={"model": "mine", "prompt": PROMPT, "max_tokens": 2})
        assert gone.status_code == 404
        assert post("unload_lora_adapter", {"lora_name": "mine"}).status_code == 404
        assert post("load_lora_adapter", {"lora_name": "mine", "lora_path": second.lora_path}
                    ).status_code == 200
        assert _ids(url, "mine", stream=True)[0] == want["second"]
        ids = [c["id"] for c in httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]]
        assert ids == [MODEL, "mine"]


def test_runtime_routes_are_off_by_default(lora_server: Served) -> None:
    response = httpx.post(f"{lora_server.url}/v1/load_lora_adapter", headers=AUTH,
                          json={"lora_name": "x", "lora_path": "/x"}, timeout=60)
    assert response.status_code == 404


def test_metrics_carry_the_adapters_info(lora_server: Served) -> None:
    text = httpx.get(f"{lora_server.url}/metrics", headers=AUTH).text
    line = next(x for x in text.splitlines() if x.startswith("mrv2_lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters=""' in line


def test_two_loads_of_one_name_at_once_load_one_adapter() -> None:
    """The load route reads adapters on worker threads: a second load of a name whose first
    is still being checked is refused, not both answered 200 with the first one dropped."""
    import threading
    from types import SimpleNamespace

    from mrv2.entrypoints.lora_modules import LoRAModules

    entered, release = threading.Event(), threading.Event()

    def check(lora: LoRARequest) -> None:
        if lora.lora_path == "/first":  # (the first load is slow to read its adapter)
            entered.set()
            release.wait(timeout=2)

    lora_config = SimpleNamespace(enable_lora=True, max_lora_rank=16)
    engine = SimpleNamespace(config=SimpleNamespace(lora=lora_config),
                             runner=SimpleNamespace(lora=SimpleNamespace(check=check)))
    modules = LoRAModules(engine, [], ["base"])
    results: dict[str, object] = {}

    def load(path: str) -> None:
        try:
            results[path] = modules.load("mine", path)
        except ValueError as error:
            results[path] = error

    first = threading.Thread(target=load, args=("/first",))
    first.start()
    assert entered.wait(timeout=2)
    second = threading.Thread(target=load, args=("/second",))
    second.start()
    second.join(timeout=0.5)
    release.set()
    first.join()
    second.join()
    assert isinstance(results["/first"], LoRARequest)
    assert isinstance(results["/second"], ValueError) and "loaded already" in str(
        results["/second"])
    assert modules.by_name["mine"].lora_path == "/first"


def test_an_adapter_unloaded_mid_request_keeps_its_answers_name(
        model_dir: Path, adapters: list[LoRARequest], monkeypatch: pytest.MonkeyPatch) -> None:
    """An embeddings request through adapter ``mine`` that is unloaded while the request runs
    answers as ``mine`` (whose weights made the vectors), not as the base model."""
    monkeypatch.setenv("MRV2_ALLOW_RUNTIME_LORA_UPDATING", "1")
    for served in serve(model_dir, LORA_KWARGS):
        answer = _embed_while_unloading(served, adapters[0].lora_path, monkeypatch)
        assert answer.status_code == 200
        assert answer.json()["model"] == "mine"


def _embed_while_unloading(served: Served, path: str,
                           monkeypatch: pytest.MonkeyPatch) -> httpx.Response:
    import threading
    import time

    url = served.url
    assert httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH, timeout=60, json={
        "lora_name": "mine", "lora_path": path}).status_code == 200
    step = served.engine.step
    started = threading.Event()

    def slow_step() -> Any:  # (the unload comes while the request runs)
        started.set()
        time.sleep(0.3)
        return step()

    monkeypatch.setattr(served.engine, "step", slow_step)
    answers: list[httpx.Response] = []

    def embed() -> None:
        answers.append(httpx.post(f"{url}/v1/embeddings", headers=AUTH, timeout=60,
                                  json={"model": "mine", "input": PROMPT}))

    thread = threading.Thread(target=embed)
    thread.start()
    assert started.wait(timeout=10)
    assert httpx.post(f"{url}/v1/unload_lora_adapter", headers=AUTH, timeout=60,
                      json={"lora_name": "mine"}).status_code == 200
    thread.join()
    return answers[0]
