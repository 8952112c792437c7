"""vLLM's ``priority`` request field on the generation and pooling routes: under
``--scheduling-policy priority`` the value reaches the engine's request (lower runs first),
with the engine on a thread or in its own process; under ``fcfs`` (the default) any but 0 is
a 400 naming the field, as vLLM's; a priority that is not an integer is a 400 naming it.
Before, the routes took the field and dropped it: every request ran in arrival order."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, MODEL, Served

from mrv2.engine.request import Request
from mrv2.entrypoints.engine_calls import DEV_MODE_ENV

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "rank me"}]
#: A body a route answers, one per route that takes ``priority``.
BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": [5, 6, 7], "max_tokens": 2},
    "/v1/chat/completions": {"messages": CHAT, "max_tokens": 2},
    "/v1/responses": {"input": "rank me", "max_output_tokens": 2},
    "/v1/embeddings": {"input": [5, 6, 7]},
    "/pooling": {"input": [5, 6, 7]},
    "/score": {"text_1": [5, 6, 7], "text_2": [8, 9]},  # (an embedding model's: 2 prompts)
    "/rerank": {"query": [5, 6, 7], "documents": [[8, 9]]},
}
#: Priority scheduling, one sequence at a time (the queue's order is the order they run in),
#: usage's cached tokens (the first to run finds none of a shared prompt cached).
PRIORITY_ENGINE = {"policy": "priority", "max_num_seqs": 1}
PRIORITY_APP = {"enable_prompt_tokens_details": True}


def _post(url: str, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{route}", headers=AUTH, timeout=60, json={"model": MODEL, **body})


@pytest.fixture(scope="module")
def ranked(model_dir: Path) -> Iterator[Served]:
    """A server of the "priority" policy, the engine on a thread of its process."""
    from conftest import serve

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(DEV_MODE_ENV, "1")  # (/pause_generation: requests queue meanwhile)
        yield from serve(model_dir, PRIORITY_ENGINE, **PRIORITY_APP)


@pytest.mark.parametrize("route", list(BODIES))
def test_a_nonzero_priority_under_fcfs_is_a_400_naming_it(server: Served, route: str) -> None:
    assert server.engine.config.scheduler.policy == "fcfs"
    for priority in (0, None):  # (None: the field left out)
        body = BODIES[route] if priority is None else {**BODIES[route], "priority": priority}
        r = _post(server.url, route, body)
        assert r.status_code == 200, r.text
    r = _post(server.url, route, {**BODIES[route], "priority": 3})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "priority"
    assert "Got priority 3 but Priority scheduling is not enabled" in error["message"]
    assert "--scheduling-policy priority" in error["message"]


@pytest.mark.parametrize("route", list(BODIES))
def test_a_priority_that_is_not_an_integer_is_a_400_naming_it(ranked: Served,
                                                              route: str) -> None:
    for bad in ("1", 1.5, True, [1], 2**63):
        r = _post(ranked.url, route, {**BODIES[route], "priority": bad})
        assert r.status_code == 400, (bad, r.text)
        error = r.json()["error"]
        assert error["param"] == "priority" and "priority" in error["message"], (bad, error)


def test_the_priority_reaches_the_engines_request(ranked: Served,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Through every route (an ``n=2`` request's samples and a beam search's steps too):
    the scheduler is handed requests of the body's priority."""
    scheduler = ranked.engine.scheduler
    seen: list[int] = []
    add = scheduler.add

    def spy(request: Request) -> None:
        seen.append(request.priority)
        add(request)

    monkeypatch.setattr(scheduler, "add", spy)
    for i, route in enumerate(BODIES):
        rank = 10 * i - 25  # (never 0, the default)
        seen.clear()
        r = _post(ranked.url, route, {**BODIES[route], "priority": rank})
        assert r.status_code == 200, r.text
        assert seen and set(seen) == {rank}, route
    for body in ({"n": 2, "temperature": 1.0, "seed": 1},
                 {"n": 2, "use_beam_search": True, "temperature": 0}):
        seen.clear()
        r = _post(ranked.url, "/v1/completions", {**BODIES["/v1/completions"], **body,
                                                  "priority": 7})
        assert r.status_code == 200, r.text
        assert len(seen) >= 2 and set(seen) == {7}, body


def _ranked_round(url: str, route: str, body: dict[str, Any], priorities: list[int]
                  ) -> list[int]:
    """Each request's cached prompt tokens, the requests (``body`` each, with its priority of
    ``priorities``, in that order) queued while generation is paused, then run one at a time:
    the first to run finds none of the shared prompt cached, the others find it."""
    paused = httpx.post(f"{url}/pause_generation", json={"mode": "keep"}, headers=AUTH,
                        timeout=60)
    assert paused.status_code == 200, paused.text
    cached: dict[int, int] = {}
    threads = []
    for i, priority in enumerate(priorities):
        queued = threading.Event()

        def read(i: int = i, priority: int = priority, queued: threading.Event = queued
                 ) -> None:
            sent = {"model": MODEL, **body, "priority": priority, "stream": True,
                    "stream_options": {"include_usage": True}}
            try:
                with httpx.stream("POST", f"{url}{route}", json=sent, headers=AUTH,
                                  timeout=60) as response:
                    queued.set()  # (its answer began: the engine holds the request)
                    for line in response.iter_lines():
                        if line.startswith("data: {") and (
                                usage := json.loads(line[6:]).get("usage")):
                            cached[i] = usage["prompt_tokens_details"]["cached_tokens"]
            finally:
                queued.set()

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        threads.append(thread)
        assert queued.wait(60)  # (queued in the order sent)
    resumed = httpx.post(f"{url}/continue_generation", headers=AUTH, timeout=60)
    assert resumed.status_code == 200, resumed.text
    for thread in threads:
        thread.join(60)
    assert sorted(cached) == list(range(len(priorities)))
    return [cached[i] for i in range(len(priorities))]


def _check_order(url: str) -> None:
    # sent in the order 5, -1, 2: the request of priority -1 runs first (in arrival order,
    # the first sent would)
    prompt = [(3 * i + 17) % 250 + 5 for i in range(13)]  # 3 full blocks of 4, and one token
    completions = _ranked_round(url, "/v1/completions", {"prompt": prompt, "max_tokens": 2},
                                [5, -1, 2])
    assert completions[1] == 0 and completions[0] == completions[2] > 0, completions
    chat = {"messages": [{"role": "user", "content": "queued chat, ranked " * 3}],
            "max_tokens": 2}
    chats = _ranked_round(url, "/v1/chat/completions", chat, [5, -1, 2])
    assert chats[1] == 0 and chats[0] == chats[2] > 0, chats


def test_lower_priority_runs_first_engine_thread(ranked: Served) -> None:
    _check_order(ranked.url)


def test_lower_priority_runs_first_engine_process(model_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from test_engine_process import _remote

    monkeypatch.setenv(DEV_MODE_ENV, "1")
    for url, _ in _remote(model_dir, PRIORITY_APP, **PRIORITY_ENGINE):
        _check_order(url)
