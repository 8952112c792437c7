"""The engine loop on its own thread, fed by a thread-safe queue, feeding asyncio queues.

HTTP handlers (on the asyncio loop) call :meth:`EngineThread.submit` / :meth:`abort`; the
engine thread owns the :class:`LLMEngine` and is the only thread that touches it (but for
read-only ``validate``). Outputs go to each request's ``asyncio.Queue`` through
``loop.call_soon_threadsafe``; the queues are unbounded, so a slow client never stalls decoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from mrv2.contract.params import SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

#: Histogram buckets (seconds) of time to first token and time per output token.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class QueueFullError(RuntimeError):
    """Too many requests in flight."""


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1


@dataclass
class Metrics:
    """Counters kept by the engine thread, read by ``/metrics``."""

    requests_success: dict[str, int] = field(default_factory=dict)  # by finish reason
    requests_aborted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    arrival: float
    first: float | None = None
    num_prompt: int = 0


class EngineThread:
    """Runs ``engine.step()`` in a daemon thread while there is work."""

    def __init__(self, engine: LLMEngine, max_pending: int = 1024) -> None:
        self.engine = engine
        self.max_pending = max_pending
        self.metrics = Metrics(stats=engine.stats())
        self._commands: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._pending = 0  # submitted and not yet finished or aborted
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="mrv2-engine", daemon=True)
        self._stopped = False

    # -- called from the asyncio side --------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._commands.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def num_pending(self) -> int:
        return self._pending

    def submit(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
               prompt: str | None, sink: asyncio.Queue[RequestOutput | BaseException],
               loop: asyncio.AbstractEventLoop) -> None:
        """Queue a (validated) request; its outputs go to ``sink``. Raises
        :class:`QueueFullError` when ``max_pending`` requests are in flight."""
        with self._lock:
            if self._stopped:
                raise QueueFullError("the server is shutting down")
            if self._pending >= self.max_pending:
                raise QueueFullError(
                    f"{self._pending} requests in flight, the most this server queues "
                    f"(--max-pending {self.max_pending}); retry later")
            self._pending += 1
        self._commands.put(("add", (req_id, prompt_token_ids, params, prompt, sink, loop,
                                    time.monotonic())))

    def abort(self, req_id: str) -> None:
        """Cancel a request (run on the engine thread); unknown or finished ids are ignored."""
        self._commands.put(("abort", req_id))

    # -- the engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            block = not engine.has_unfinished()
            try:
                while True:
                    command, arg = self._commands.get(block=block)
                    block = False
                    if command == "stop":
                        self._shutdown()
                        return
                    self._handle(command, arg)
            except queue.Empty:
                pass
            if not engine.has_unfinished():
                self.metrics.stats = engine.stats()
                continue
            try:
                outputs = engine.step()
            except Exception as error:  # keep serving: fail the requests in flight
                logger.exception("engine step failed")
                self._fail_all(error)
                continue
            now = time.monotonic()
            for output in outputs:
                self._deliver(output, now)
            self.metrics.stats = engine.stats()

    def _handle(self, command: str, arg: Any) -> None:
        if command == "add":
            req_id, ids, params, prompt, sink_queue, loop, arrival = arg
            sink = _Sink(loop, sink_queue, arrival, num_prompt=len(ids))
            try:
                self.engine.add_request(ids, params, request_id=req_id, prompt=prompt,
                                        stream=True)
            except Exception as error:
                self._finish_pending()
                _put(sink, error)
                return
            self._sinks[req_id] = sink
        elif command == "abort" and self._sinks.pop(arg, None) is not None:
            self.engine.abort(arg)
            self.metrics.requests_aborted += 1
            self._finish_pending()

    def _deliver(self, output: RequestOutput, now: float) -> None:
        sink = self._sinks.get(output.request_id)
        if sink is None:
            return
        if sink.first is None and output.new_token_ids:
            sink.first = now
            self.metrics.ttft.observe(now - sink.arrival)
        if output.finished:
            del self._sinks[output.request_id]
            self._finish_pending()
            m = self.metrics
            m.prompt_tokens += sink.num_prompt
            for choice in output.outputs:
                num = len(choice.token_ids)
                m.generation_tokens += num
                reason = choice.finish_reason or "unknown"
                m.requests_success[reason] = m.requests_success.get(reason, 0) + 1
                if num > 1 and sink.first is not None:
                    m.tpot.observe((now - sink.first) / (num - 1))
        _put(sink, output)

    def _fail_all(self, error: BaseException) -> None:
        for req_id, sink in list(self._sinks.items()):
            try:
                self.engine.abort(req_id)
            except Exception:  # the engine is already broken; still tell the client
                logger.exception("abort after a failed step")
            self._finish_pending()
            _put(sink, RuntimeError(f"the engine failed: {error}"))
        self._sinks.clear()

    def _shutdown(self) -> None:
        with self._lock:
            self._stopped = True
        self._fail_all(RuntimeError("the server is shutting down"))
        while True:  # requests still queued: tell their clients
            try:
                command, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if command == "add":
                self._finish_pending()
                sink = _Sink(arg[5], arg[4], arg[6])
                _put(sink, RuntimeError("the server is shutting down"))

    def _finish_pending(self) -> None:
        with self._lock:
            self._pending -= 1


def _put(sink: _Sink, item: RequestOutput | BaseException) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: the client is gone
        sink.loop.call_soon_threadsafe(sink.queue.put_nowait, item)
