"""The engine thread's hand-over to the event loop (a busy loop gets later outputs merged), and
how a stream reports merged outputs."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from server_util import ENGINE_KWARGS

from mrv2 import EngineConfig, RequestOutputKind, SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.engine.outputs import RequestOutput
from mrv2.entrypoints.engine_thread import EngineThread


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_outputs_wait_and_merge_while_the_loop_is_busy(model_dir: Path,
                                                       kind: RequestOutputKind) -> None:
    """The first output goes to the loop at once; while the loop has not run it (busy), the
    next steps' outputs wait in the backlog, folded into one (cumulative: the latest stands
    for the rest; deltas: appended); once the loop has written that batch, it gets the merged
    one: every token, in order, finished, as the same request run alone gives them."""
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), **ENGINE_KWARGS))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=kind)
    engine.add_request([5, 6, 7], params, request_id="alone")
    want: list[int] = []
    while engine.has_unfinished():
        want = next((list(o.outputs[0].token_ids) for o in engine.step() if o.finished), want)
    worker = EngineThread(engine)
    worker.start()
    loop = asyncio.new_event_loop()
    try:
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        worker.submit("r", [5, 6, 7], params, None, sink, loop)
        deadline = time.monotonic() + 60
        while worker.num_pending and time.monotonic() < deadline:  # the loop is not running
            time.sleep(0.01)
        assert worker.num_pending == 0, "the request did not finish"

        async def drain() -> list[RequestOutput]:
            items: list[RequestOutput] = []
            while not (items and items[-1].finished):
                item = await asyncio.wait_for(sink.get(), 30)
                assert not isinstance(item, BaseException), item
                items.append(item)
            return items

        items = loop.run_until_complete(drain())
    finally:
        worker.stop()
        loop.close()
    lengths = [len(o.outputs[0].token_ids) for o in items]
    delta = kind == RequestOutputKind.DELTA
    assert lengths == ([1, 7] if delta else [1, 8])
    assert [o.delta for o in items] == [delta, delta]
    assert len(want) == 8 and items[-1].new_token_ids == want[1:]
    assert items[0].outputs[0].token_ids == want[:1]
    assert (items[0].outputs[0].token_ids if delta else []) + items[-1].outputs[0].token_ids \
        == want


def test_a_stream_reports_each_choice_under_its_own_index() -> None:
    """With n > 1 the merged output holds the choices seen so far: a chunk of choice 1 that
    comes before choice 0 has produced anything is reported as choice 1, not as choice 0."""
    from mrv2.engine.outputs import CompletionOutput
    from mrv2.entrypoints.responses import Stream as _Stream

    class Body:
        include_usage = False
        continuous_usage = False

    stream = _Stream(None, "cmpl-x", "m", False, SamplingParams(n=2, max_tokens=4), Body(),
                     ["r"], [([1, 2], None)])  # type: ignore[arg-type]

    def output(*choices: CompletionOutput) -> RequestOutput:
        return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2],
                             outputs=list(choices), finished=False, delta=True)

    first = [c for c, _ in stream._deltas(output(CompletionOutput(1, "b", [7])))]
    assert [(c["index"], c["text"]) for c in first] == [(1, "b")]
    both = [c for c, _ in stream._deltas(output(CompletionOutput(0, "a", [5]),
                                                CompletionOutput(1, "c", [8])))]
    assert [(c["index"], c["text"]) for c in both] == [(0, "a"), (1, "c")]


def test_calls_are_answered_once_the_engine_stops_or_fails(model_dir: Path) -> None:
    """A development route's call queued behind the stop, or sent after the engine thread
    ended (stopped, or failed for good), is refused (QueueFullError: the routes' 503), never
    left waiting forever."""
    from mrv2.entrypoints.engine_thread import QueueFullError

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), **ENGINE_KWARGS))

    async def refused(worker: EngineThread, then: Any = None) -> str:
        call = asyncio.ensure_future(worker.call("is_paused"))
        await asyncio.sleep(0)  # (queued, behind the stop)
        if then is not None:
            then()
        with pytest.raises(QueueFullError) as error:
            await asyncio.wait_for(call, 10)
        return str(error.value)

    stopped = EngineThread(engine)
    stopped.stop()  # ("stop" queued first; the thread not yet started)
    assert "shutting down" in asyncio.run(refused(stopped, stopped.start))
    stopped.stop()
    assert "shutting down" in asyncio.run(refused(stopped))  # (after the thread ended)
    failed = EngineThread(engine)
    failed.start()
    failed.mark_fatal(RuntimeError("boom"))
    failed.stop()
    assert "the engine failed: boom" in asyncio.run(refused(failed))


def test_an_error_outside_a_step_fails_the_engine_loudly(model_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception the engine thread meets between steps (here an abort that raises) marks
    the engine failed (/health's 503, the on_fatal listeners) and answers the requests in
    flight, instead of ending the thread quietly with them waiting forever."""
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), **ENGINE_KWARGS))
    engine.pause_generation("keep")  # (the requests stay in flight)
    worker = EngineThread(engine)
    told: list[BaseException] = []
    worker.on_fatal.append(told.append)
    worker.start()

    def broken(req_id: str) -> None:
        raise RuntimeError("abort broke")

    async def run() -> RequestOutput | BaseException:
        loop = asyncio.get_running_loop()
        first: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        other: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        worker.submit("a", [5, 6, 7], SamplingParams(max_tokens=4), None, first, loop)
        worker.submit("b", [5, 6, 7], SamplingParams(max_tokens=4), None, other, loop)
        while worker.engine.scheduler.num_unfinished < 2:
            await asyncio.sleep(0.01)
        monkeypatch.setattr(engine, "abort", broken)
        worker.abort("a")
        return await asyncio.wait_for(other.get(), 10)

    try:
        item = asyncio.run(run())
    finally:
        worker.stop()
    assert isinstance(item, RuntimeError) and "abort broke" in str(item)
    assert worker.fatal is not None and told == [worker.fatal]
    assert worker.num_pending == 0
