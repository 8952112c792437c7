"""``/metrics``' prompt and generation token counters count tokens as they come out (vLLM
counts them per step), in both server modes: a request's prompt once, with its first tokens;
every sequence's tokens; nothing left for the finish."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from server_util import ENGINE_KWARGS

from mrv2 import EngineConfig, SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.engine.output_deltas import DeltaEncoder
from mrv2.engine.outputs import CompletionOutput, RequestOutput
from mrv2.entrypoints.engine_process import EngineProcess, _Sink
from mrv2.entrypoints.engine_thread import EngineThread
from mrv2.entrypoints.metrics import ServerMetrics


def _record(metrics: ServerMetrics) -> list[tuple[str, int, int]]:
    """Every ``observe_tokens`` / ``observe_finished`` call, in order, as the counters stood
    after it: ``("tokens" | "finished", prompt total, generation total)``."""
    calls: list[tuple[str, int, int]] = []
    tokens, finished = metrics.observe_tokens, metrics.observe_finished

    def totals() -> tuple[int, int]:
        return (int(metrics.prompt_tokens._value.get()),
                int(metrics.generation_tokens._value.get()))

    def on_tokens(*args: Any) -> None:
        tokens(*args)
        calls.append(("tokens", *totals()))

    def on_finished(*args: Any) -> None:
        finished(*args)
        calls.append(("finished", *totals()))

    metrics.observe_tokens = on_tokens  # type: ignore[method-assign]
    metrics.observe_finished = on_finished  # type: ignore[method-assign]
    return calls


def test_the_engine_thread_counts_each_steps_tokens(model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dir), **ENGINE_KWARGS))
    worker = EngineThread(engine)
    calls = _record(worker.metrics)
    worker.start()
    loop = asyncio.new_event_loop()
    try:
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        worker.submit("r", [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True, n=2), None,
                      sink, loop)
        deadline = time.monotonic() + 60
        while worker.num_pending and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker.num_pending == 0, "the request did not finish"
    finally:
        worker.stop()
        loop.close()
    assert calls[-1] == ("finished", 3, 12)  # prompt once; 2 x 6 tokens
    counted = [c for c in calls if c[0] == "tokens"]
    assert len(counted) >= 6 and counted[0][1] == 3  # a call per step, the prompt with the first
    assert all(b[2] > a[2] for a, b in zip(counted, counted[1:], strict=False))
    assert calls.index(("finished", 3, 12)) == len(calls) - 1  # all counted before the finish


def test_the_engine_process_reader_counts_each_deltas_tokens() -> None:
    metrics = ServerMetrics("m")
    calls = _record(metrics)
    reader = object.__new__(EngineProcess)  # only what _deliver reads
    reader.metrics = metrics
    reader._lock = threading.Lock()
    reader._pending = 2
    handed: list[Any] = []
    reader._hand_over = type("HandOver", (), {"add": lambda self, loop, item: handed.append(item),
                                              "post": lambda self: None})()
    reader._sinks = {"r": _Sink(None, None, 0.0, num_prompt=4, num_seqs=2)}  # type: ignore[arg-type]
    encoder = DeltaEncoder()
    state = {1: CompletionOutput(1, "", [])}  # choice 1 comes out first
    steps = [({1: [7]}, False), ({0: [3, 4], 1: [8]}, False), ({0: [5]}, False),
             ({0: [], 1: [9]}, True)]
    for new, finished in steps:
        for index, ids in new.items():
            c = state.setdefault(index, CompletionOutput(index, "", []))
            c.token_ids = c.token_ids + ids
            if finished:
                c.finish_reason = "length"
        output = RequestOutput("r", None, [1, 2, 3, 4], [state[i] for i in sorted(state)],
                               finished=finished)
        reader._deliver([encoder.encode(output)], time.monotonic())
    assert calls == [("tokens", 4, 1), ("tokens", 4, 4), ("tokens", 4, 5), ("tokens", 4, 6),
                     ("finished", 4, 6)]
    assert len(handed) == 4 and reader._pending == 0 and not reader._sinks


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_time_per_output_token_ends_with_each_sequence(worker: str) -> None:
    """n=2: choice 0 stops after 2 tokens at t=1.1, choice 1 runs to 4 tokens at t=4.1
    (first token at t=0.1). Each sequence's TPOT is its own decode time over its own tokens
    (1.0 s and 4.0 s / 3), not the request's whole decode time over each one's tokens."""
    metrics = ServerMetrics("m")
    lock = threading.Lock()
    hand_over = type("HandOver", (), {"add": lambda self, loop, item, key=None: None,
                                      "post": lambda self: None})()
    encoder = DeltaEncoder()
    if worker == "thread":
        thread = object.__new__(EngineThread)  # only what _deliver reads
        thread.metrics, thread._lock, thread._pending, thread._hand_over = (
            metrics, lock, 2, hand_over)
        thread._sinks = {"r": _Sink(None, None, 0.0, num_prompt=4, num_seqs=2)}  # type: ignore[arg-type]

        def deliver(output: RequestOutput, now: float) -> None:
            thread._deliver(output, now)
    else:
        reader = object.__new__(EngineProcess)
        reader.metrics, reader._lock, reader._pending, reader._hand_over = (
            metrics, lock, 2, hand_over)
        reader._sinks = {"r": _Sink(None, None, 0.0, num_prompt=4, num_seqs=2)}  # type: ignore[arg-type]

        def deliver(output: RequestOutput, now: float) -> None:
            reader._deliver([encoder.encode(output)], now)
    state = [CompletionOutput(0, "", []), CompletionOutput(1, "", [])]
    steps = [(0.1, {0: 3, 1: 7}, {}), (1.1, {0: 4, 1: 8}, {0: "stop"}),
             (2.1, {1: 9}, {}), (4.1, {1: 10}, {1: "length"})]
    for now, new, reasons in steps:
        for index, token in new.items():
            state[index].token_ids = state[index].token_ids + [token]
        for index, reason in reasons.items():
            state[index].finish_reason = reason
        output = RequestOutput("r", None, [1, 2, 3, 4], [CompletionOutput(
            c.index, "", list(c.token_ids), c.finish_reason) for c in state],
            finished=now == 4.1, new_token_ids=[new[i] for i in sorted(new)])
        deliver(output, now)
    assert metrics.tpot._sum.get() == pytest.approx(1.0 / 1 + 4.0 / 3)
    # vLLM's names: the same per-sequence time per output token; arrival (0.0) to each end
    assert metrics._vllm_tpot._sum.get() == pytest.approx(1.0 / 1 + 4.0 / 3)
    assert metrics._vllm_e2e._sum.get() == pytest.approx(1.1 + 4.1)
    assert metrics._vllm_ttft._sum.get() == metrics.ttft._sum.get() == pytest.approx(0.1)
    text = metrics.render().decode()
    assert 'mrv2_request_success_total{finished_reason="stop",model_name="m"} 1.0' in text
    assert 'mrv2_time_per_output_token_seconds_count{model_name="m"} 2.0' in text
