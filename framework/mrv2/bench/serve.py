"""``mrv2 bench serve``: a request-rate sweep (Poisson arrivals) against a running server.

Streams ``/v1/completions`` and reports TTFT, TPOT and inter-token latency percentiles
(p50/p90/p99) and throughput for each rate.

``--duration S --max-concurrency N`` keeps N requests in flight for S seconds instead of
sending ``--num-requests``; ``--mix`` draws each request (seeded): completions or chat, streamed
or not, ``n``, logprobs, stop strings, sampling, and client cancels (``--cancel-prob``), and
checks every answer (:func:`check_response`, :class:`StreamCheck`). ``scripts/soak.py`` runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

DEFAULT_RATES = [1.0, 4.0, 16.0, math.inf]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    values = sorted(values)
    pos = (len(values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def _rate(text: str) -> float:
    """``--rates``: requests per second, above 0 (``inf``: all at once)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a rate must be above 0 (inf: all at once), got "
                                         f"{text}")
    return value


async def run_rate(url: str, model: str, rate: float, num_requests: int, prompt_len: int,
                   max_tokens: int, api_key: str | None, seed: int, samples: bool = False
                   ) -> dict[str, Any]:
    """One row of the sweep: ``num_requests`` streamed greedy completions at Poisson ``rate``
    (req/s; inf: all at once), sent and checked by :func:`run_load`; summarized (``samples``:
    with each request's latencies, :func:`latency_samples`)."""
    load, records = await run_load(url, model, rate=rate, num_requests=num_requests,
                                   prompt_len=prompt_len, max_tokens=max_tokens,
                                   api_key=api_key, seed=seed)
    failed = [r for r in records if not r.ok]  # no cancels outside --mix
    row: dict[str, Any] = {
        "rate": rate, "completed": load["completed"], "failed": len(failed),
        "duration_s": load["duration_s"], "request_throughput": load["request_throughput"],
        "output_throughput": load["output_throughput"],
        "errors": sorted({r.error or "; ".join(r.problems[:3]) for r in failed})[:3],
        "client_cpu_fraction": load["client_cpu_fraction"],
    }
    row.update({key: value for key, value in load.items() if key.endswith("_ms")})
    if samples:  # (scripts/serve_sweep.py merges several clients' into percentiles)
        row["samples_ms"] = latency_samples(records)
    return row


# -- mixed load (--mix, --duration, --max-concurrency) ----------------------------------------

PLAIN_WORDS = ("hello", "world", "the", "capital", "of", "France")
MIX_WORDS = ("the", "of", "a", "is", "in", "and", "to", "hello", "world", "capital", "France",
             "Paris")
STOP_WORDS = ("the", "of", "a", "is", "and")
"""Stop strings: common words of the prompts, so that some fire even on random weights."""
FINISH_REASONS = frozenset({"stop", "length"})


@dataclass
class Spec:
    """One request of the load: what to send, and when its client gives up."""

    chat: bool
    stream: bool
    prompt: str
    max_tokens: int
    n: int = 1
    logprobs: bool = False
    stop: list[str] | None = None
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False
    cancel_after_s: float | None = None
    """Non-streamed: the client cancels the request after this many seconds."""
    cancel_after_chunks: int | None = None
    """Streamed: the client closes the connection after this many content chunks."""

    @property
    def kind(self) -> str:
        parts = ["chat" if self.chat else "cmpl", "stream" if self.stream else "full",
                 f"n{self.n}"]
        parts += ["logprobs"] * self.logprobs + ["stop"] * bool(self.stop)
        return "/".join(parts)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": self.max_tokens, "n": self.n,
                                "stream": self.stream, "temperature": self.temperature}
        if self.seed is not None:
            body["seed"] = self.seed
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.stop:
            body["stop"] = self.stop
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
            if self.logprobs:
                body.update(logprobs=True, top_logprobs=2)
        else:
            body["prompt"] = self.prompt
            if self.logprobs:
                body["logprobs"] = 2
        return body


def draw_spec(rng: random.Random, i: int, prompt_len: int, max_tokens: int, mix: bool,
              cancel_prob: float) -> Spec:
    """Request ``i``: the sweep's streamed greedy completion, or (``mix``) a random kind."""
    if not mix:
        prompt = " ".join(rng.choice(PLAIN_WORDS) for _ in range(prompt_len)) + f" {i}"
        return Spec(chat=False, stream=True, prompt=prompt, max_tokens=max_tokens,
                    ignore_eos=True)
    length = rng.randint(max(1, prompt_len // 2), max(1, prompt_len * 3 // 2))
    stream = rng.random() < 0.5
    spec = Spec(
        chat=rng.random() < 0.5, stream=stream,
        prompt=" ".join(rng.choice(MIX_WORDS) for _ in range(length)) + f" {i}",
        max_tokens=rng.randint(max(1, max_tokens // 4), max_tokens),
        n=rng.choices((1, 2, 4), (0.8, 0.15, 0.05))[0], logprobs=rng.random() < 0.25,
        stop=[rng.choice(STOP_WORDS)] if rng.random() < 0.3 else None,
        temperature=rng.choice((0.0, 0.8)), seed=rng.randrange(2**31),
    )
    if spec.temperature == 0.0:
        spec.n = 1  # (a greedy request takes n=1 only, as vLLM's: a 400 otherwise)
    if rng.random() < cancel_prob:
        if stream:
            spec.cancel_after_chunks = rng.randint(1, 8)
        else:
            spec.cancel_after_s = rng.uniform(0.05, 2.0)
    return spec


@dataclass
class Record:
    """What happened to one request."""

    kind: str
    stream: bool
    n: int
    status: int = 0
    ok: bool = False
    """Completed (not cancelled), HTTP 200, and every check passed."""
    cancelled: bool = False
    """The client left before the answer was complete."""
    server_error: bool = False
    """A 5xx status, or an error event inside a 200 stream."""
    finish_reasons: list[str] = field(default_factory=list)
    output_tokens: int = 0
    start: float = 0.0
    """Wall-clock time (``time.time()``) the request was sent."""
    ttft: float = 0.0
    latency: float = 0.0
    itl: array[float] = field(default_factory=lambda: array("d"))
    error: str = ""
    problems: list[str] = field(default_factory=list)
    """Why a complete 200 answer is not valid."""

    def as_dict(self) -> dict[str, Any]:
        """The record without its inter-token latencies."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "itl"}


@dataclass
class _Tally:
    finish_reason: str | None = None
    logprob_tokens: int = 0
    has_logprobs: bool = False


def _add_logprobs(spec: Spec, tally: _Tally, index: Any, logprobs: Any,
                  problems: list[str]) -> None:
    if logprobs is None:
        return
    entries = logprobs.get("content" if spec.chat else "tokens") \
        if isinstance(logprobs, dict) else None
    if not isinstance(entries, list):
        problems.append(f"choice {index}: malformed logprobs {str(logprobs)[:80]}")
        return
    tally.has_logprobs = True
    tally.logprob_tokens += len(entries)


def _final_checks(spec: Spec, tallies: dict[Any, _Tally], usage: Any,
                  problems: list[str]) -> tuple[list[str], int]:
    """Choices 0..n-1 each finished by stop or length, logprobs per token, usage adds up;
    returns the finish reasons (by index) and the completion tokens (usage)."""
    if sorted(tallies, key=str) != list(range(spec.n)):
        problems.append(f"choice indices {sorted(tallies, key=str)}, expected 0..{spec.n - 1}")
    for index, tally in tallies.items():
        if tally.finish_reason not in FINISH_REASONS:
            problems.append(f"choice {index}: finish_reason {tally.finish_reason!r}")
        if spec.logprobs and not tally.has_logprobs:
            problems.append(f"choice {index}: no logprobs")
        if spec.logprobs and (tally.logprob_tokens > spec.max_tokens or tally.logprob_tokens < 1
                              or (tally.finish_reason == "length"
                                  and tally.logprob_tokens != spec.max_tokens)):
            problems.append(f"choice {index}: {tally.logprob_tokens} logprob entries "
                            f"({tally.finish_reason}, max_tokens {spec.max_tokens})")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(tokens, int):
        problems.append(f"no usage.completion_tokens: {usage!r}")
        tokens = 0
    elif spec.logprobs and tokens != sum(t.logprob_tokens for t in tallies.values()):
        problems.append(f"usage.completion_tokens {tokens} != "
                        f"{sum(t.logprob_tokens for t in tallies.values())} logprob entries")
    else:
        least = sum(spec.max_tokens if t.finish_reason == "length" else 1
                    for t in tallies.values())
        if not least <= tokens <= spec.n * spec.max_tokens:
            problems.append(f"usage.completion_tokens {tokens} not in "
                            f"[{least}, {spec.n * spec.max_tokens}]")
    reasons = [str(tallies[i].finish_reason) for i in sorted(tallies, key=str)]
    return reasons, tokens


def check_response(spec: Spec, data: Any) -> tuple[list[str], list[str], int]:
    """Check a non-streamed answer: (problems, finish reasons, completion tokens)."""
    problems: list[str] = []
    tallies: dict[Any, _Tally] = {}
    choices = data.get("choices") if isinstance(data, dict) else None
    for choice in choices if isinstance(choices, list) else []:
        index = choice.get("index")
        if index in tallies:
            problems.append(f"choice {index} appears twice")
            continue
        tally = tallies[index] = _Tally(choice.get("finish_reason"))
        text = (choice.get("message") or {}).get("content") if spec.chat else choice.get("text")
        if not isinstance(text, str):
            problems.append(f"choice {index}: no text")
        _add_logprobs(spec, tally, index, choice.get("logprobs"), problems)
    reasons, tokens = _final_checks(spec, tallies, data.get("usage") if isinstance(
        data, dict) else None, problems)
    return problems, reasons, tokens


class StreamCheck:
    """Checks a streamed answer line by line; :meth:`finish` gives the verdict."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.tallies: dict[Any, _Tally] = {}
        self.usage: Any = None
        self.done = False
        self.error: str = ""
        self.problems: list[str] = []

    def add_line(self, line: str) -> bool:
        """Take one SSE line; True when it carried generated content (for timing)."""
        if not line.startswith("data: "):
            return False
        payload = line[6:]
        if self.done:
            self.problems.append("data after [DONE]")
            return False
        if payload == "[DONE]":
            self.done = True
            return False
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            self.problems.append(f"bad JSON chunk {payload[:80]!r}")
            return False
        if "error" in chunk:
            self.error = str(chunk["error"])[:300]
            return False
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        content = False
        for choice in chunk.get("choices") or []:
            index = choice.get("index")
            tally = self.tallies.setdefault(index, _Tally())
            if tally.finish_reason is not None:
                self.problems.append(f"choice {index}: a chunk after its finish_reason")
            tally.finish_reason = choice.get("finish_reason") or tally.finish_reason
            _add_logprobs(self.spec, tally, index, choice.get("logprobs"), self.problems)
            content = content or not (self.spec.chat and "role" in (choice.get("delta") or {}))
        return content

    def finish(self) -> tuple[list[str], list[str], int]:
        """(problems, finish reasons, completion tokens) of the whole stream."""
        if not self.done:
            self.problems.append("the stream did not end with data: [DONE]")
        reasons, tokens = _final_checks(self.spec, self.tallies, self.usage, self.problems)
        return self.problems, reasons, tokens


def _judge(rec: Record, verdict: tuple[list[str], list[str], int]) -> None:
    rec.problems, rec.finish_reasons, rec.output_tokens = verdict
    rec.ok = not rec.problems and not rec.error


async def _send_stream(client: Any, model: str, spec: Spec, rec: Record, start: float) -> None:
    async with client.stream("POST", spec.path, json=spec.body(model)) as response:
        rec.status = response.status_code
        if rec.status != 200:
            rec.error = f"HTTP {rec.status}: {(await response.aread())[:300]!r}"
            return
        check, chunks, last = StreamCheck(spec), 0, start
        async for line in response.aiter_lines():
            if not check.add_line(line):
                continue
            now = time.perf_counter()
            if rec.ttft == 0.0:
                rec.ttft = now - start
            else:
                rec.itl.append(now - last)
            last, chunks = now, chunks + 1
            if spec.cancel_after_chunks is not None and chunks >= spec.cancel_after_chunks:
                rec.cancelled = True  # leaving the block closes the connection
                return
        if check.error:
            rec.error, rec.server_error = f"error event: {check.error}", True
        _judge(rec, check.finish())


async def send(client: Any, model: str, spec: Spec, streams: Any = None) -> Record:
    """Send ``spec``, cancel it if it says so, check the answer. A streamed one goes
    through ``streams`` (a :class:`~mrv2.bench.sse_client.StreamClient`) when given, else
    through ``client`` (httpx)."""
    rec = Record(kind=spec.kind, stream=spec.stream, n=spec.n, start=time.time())
    start = time.perf_counter()
    try:
        if spec.stream:
            await _send_stream(streams or client, model, spec, rec, start)
        else:
            try:
                response = await asyncio.wait_for(
                    client.post(spec.path, json=spec.body(model)), spec.cancel_after_s)
            except asyncio.TimeoutError:
                rec.cancelled = True
                return rec
            rec.status = response.status_code
            if rec.status != 200:
                rec.error = f"HTTP {rec.status}: {response.text[:300]}"
            else:
                _judge(rec, check_response(spec, response.json()))
    except Exception as error:  # a failed request is reported, not fatal
        rec.error = repr(error)[:300]
    rec.server_error = rec.server_error or rec.status >= 500
    rec.latency = time.perf_counter() - start
    return rec


def summarize(records: list[Record], duration_s: float) -> dict[str, Any]:
    """Counts, throughput, finish reasons, latency percentiles of the streamed n=1 ones."""
    cancelled = [r for r in records if r.cancelled]
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.cancelled and not r.ok]
    five = [r for r in failed if r.server_error]
    tokens = sum(r.output_tokens for r in ok)
    kinds: dict[str, Counter[str]] = {}
    for r in records:
        state = "cancelled" if r.cancelled else "completed" if r.ok else "failed"
        kinds.setdefault(r.kind, Counter())[state] += 1
    summary: dict[str, Any] = {
        "sent": len(records), "completed": len(ok), "cancelled": len(cancelled),
        "failed": len(failed), "failed_5xx": len(five), "failed_other": len(failed) - len(five),
        "invalid": sum(1 for r in failed if r.problems),
        "errors_5xx": sorted({r.error for r in five})[:5],
        "errors_other": sorted({r.error or "; ".join(r.problems[:3])
                                for r in failed if not r.server_error})[:5],
        "duration_s": duration_s, "output_tokens": tokens,
        "completed_choices": sum(r.n for r in ok),
        "cancelled_choices": sum(r.n for r in cancelled),
        "request_throughput": len(ok) / duration_s, "output_throughput": tokens / duration_s,
        "finish_reasons": dict(Counter(x for r in ok for x in r.finish_reasons)),
        "status_counts": dict(Counter(str(r.status) for r in records)),
        "by_kind": {k: dict(v) for k, v in sorted(kinds.items())},
    }
    summary.update(latency_percentiles(latency_samples(records)))
    return summary


def latency_samples(records: list[Record]) -> dict[str, list[float]]:
    """The streamed n=1 completed requests' TTFTs, TPOTs and inter-token latencies (ms)."""
    timed = [r for r in records if r.ok and r.stream and r.n == 1]
    return {"ttft": [r.ttft * 1000 for r in timed if r.ttft],
            "tpot": [(r.latency - r.ttft) * 1000 / (r.output_tokens - 1)
                     for r in timed if r.output_tokens > 1],
            "itl": [x * 1000 for r in timed for x in r.itl]}


def latency_percentiles(samples: dict[str, list[float]]) -> dict[str, float]:
    """``{name}_p{50,90,99}_ms`` of :func:`latency_samples` (several clients' samples merged
    first give the load's true percentiles, not a median of each client's)."""
    return {f"{name}_p{q}_ms": percentile(values, q)
            for name, values in samples.items() for q in (50, 90, 99)}


def _releaser(slots: asyncio.Semaphore) -> Any:
    return lambda _: slots.release()


async def run_load(url: str, model: str, *, rate: float = math.inf,
                   num_requests: int | None = None, duration: float | None = None,
                   max_concurrency: int | None = None, mix: bool = False,
                   cancel_prob: float = 0.0, prompt_len: int = 32, max_tokens: int = 64,
                   api_key: str | None = None, seed: int = 0,
                   should_stop: Callable[[], bool] | None = None
                   ) -> tuple[dict[str, Any], list[Record]]:
    """Send requests at Poisson ``rate`` with at most ``max_concurrency`` in flight, until
    ``num_requests`` are sent, ``duration`` seconds are over or ``should_stop()``; wait for
    the last ones."""
    import httpx

    from mrv2.bench.sse_client import StreamClient

    if duration is None and num_requests is None:
        raise ValueError("give num_requests or duration")
    if not rate > 0:
        raise ValueError(f"rate={rate} must be above 0 requests a second (inf: all at once)")
    if duration is not None and not math.isfinite(rate) and not max_concurrency:
        raise ValueError("--duration at rate inf needs --max-concurrency")
    rng = random.Random(seed)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=(max_concurrency or num_requests or 1024) + 8)
    streams = StreamClient(url, headers, timeout=600)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600,
                                 limits=limits) as client:
        tasks: list[asyncio.Task[Record]] = []
        start, cpu_start = time.perf_counter(), time.thread_time()
        deadline = start + duration if duration is not None else math.inf
        while num_requests is None or len(tasks) < num_requests:
            if slots is not None:
                await slots.acquire()
            if time.perf_counter() >= deadline or (should_stop and should_stop()):
                if slots is not None:
                    slots.release()
                break
            spec = draw_spec(rng, len(tasks), prompt_len, max_tokens, mix, cancel_prob)
            task = asyncio.create_task(send(client, model, spec, streams))
            if slots is not None:
                task.add_done_callback(_releaser(slots))
            tasks.append(task)
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        records = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    summary = summarize(records, duration)
    # The client's own CPU over the load: near 1 (a core), the client is what was measured.
    summary["client_cpu_fraction"] = (time.thread_time() - cpu_start) / duration
    summary = {"rate": rate, "max_concurrency": max_concurrency, "mix": mix, **summary}
    return summary, records


def _print_load(s: dict[str, Any]) -> None:
    def trio(name: str) -> str:
        return "/".join(f"{s[f'{name}_p{q}_ms']:.1f}" for q in (50, 90, 99))

    print(f"{s['rate']:>6} {str(s['max_concurrency']):>5} {s['sent']:>6} {s['completed']:>6} "
          f"{s['cancelled']:>6} {s['failed']:>5} {s['failed_5xx']:>4} "
          f"{s['request_throughput']:>7.2f} {s['output_throughput']:>8.1f} "
          f"{trio('ttft'):>22} {trio('tpot'):>22}")
    print(f"       finish reasons: {s['finish_reasons']}  statuses: {s['status_counts']}")
    _warn_client_bound(s)
    for error in s["errors_5xx"] + s["errors_other"]:
        print(f"       error: {error}")


#: Client CPU over wall time past which a rate's numbers say more about this client than
#: about the server (the twenty-third session found every earlier serve sweep there).
CLIENT_BOUND_FRACTION = 0.8


def _warn_client_bound(s: dict[str, Any]) -> None:
    fraction = s.get("client_cpu_fraction", 0.0)
    if fraction > CLIENT_BOUND_FRACTION:
        print(f"       warning: this client used {fraction:.0%} of a core over the run: it may "
              "be the limit; split the load over processes (serve_sweep.py --clients N)")


def _model(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()
    return str(data["data"][0]["id"])


def main(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    model = args.model or _model(url, args.api_key)
    if args.start_at is not None:  # several client processes start their loads together
        time.sleep(max(0.0, args.start_at - time.time()))
    if args.mix or args.duration is not None or args.max_concurrency is not None:
        return _main_load(args, url, model)
    rows = []
    print(f"{'rate':>6} {'ok':>4} {'fail':>4} {'req/s':>7} {'tok/s':>8} "
          f"{'TTFT p50/p90/p99 ms':>22} {'TPOT p50/p90/p99 ms':>22} {'ITL p50/p90/p99 ms':>22}")
    for k, rate in enumerate(args.rates or DEFAULT_RATES):
        s = asyncio.run(run_rate(url, model, rate, args.num_requests, args.prompt_len,
                                 args.max_tokens, args.api_key, args.seed + k,
                                 args.json_samples))
        rows.append(s)

        def trio(name: str, s: dict[str, Any] = s) -> str:
            return "/".join(f"{s[f'{name}_p{q}_ms']:.1f}" for q in (50, 90, 99))

        print(f"{rate:>6} {s['completed']:>4} {s['failed']:>4} "
              f"{s['request_throughput']:>7.2f} {s['output_throughput']:>8.1f} "
              f"{trio('ttft'):>22} {trio('tpot'):>22} {trio('itl'):>22}")
        for error in s["errors"]:
            print(f"       error: {error}")
        _warn_client_bound(s)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0


def _main_load(args: argparse.Namespace, url: str, model: str) -> int:
    """``--mix`` / ``--duration`` / ``--max-concurrency``: one load per rate; 1 on a failure."""
    rows = []
    rates = args.rates or ([math.inf] if args.duration is not None else DEFAULT_RATES)
    print(f"{'rate':>6} {'conc':>5} {'sent':>6} {'ok':>6} {'cancel':>6} {'fail':>5} {'5xx':>4} "
          f"{'req/s':>7} {'tok/s':>8} {'TTFT p50/p90/p99 ms':>22} {'TPOT p50/p90/p99 ms':>22}")
    for k, rate in enumerate(rates):
        s, _ = asyncio.run(run_load(
            url, model, rate=rate, num_requests=None if args.duration else args.num_requests,
            duration=args.duration, max_concurrency=args.max_concurrency, mix=args.mix,
            cancel_prob=args.cancel_prob if args.mix else 0.0, prompt_len=args.prompt_len,
            max_tokens=args.max_tokens, api_key=args.api_key, seed=args.seed + k))
        rows.append(s)
        _print_load(s)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return int(any(s["failed"] for s in rows))


def add_parser(sub: Any) -> None:
    """Register ``mrv2 bench serve``."""
    p = sub.add_parser("serve", help="request-rate sweep against a running mrv2 serve")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--rates", type=_rate, nargs="+", default=None,
                   help="requests per second; inf sends all at once (default: 1 4 16 inf; "
                   "with --duration: inf)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32, help="words per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0,
                   help="the k-th rate draws its prompts from seed + k, so no rate meets an "
                   "earlier rate's prompts in the server's prefix cache")
    p.add_argument("--duration", type=float, default=None,
                   help="send for this many seconds (instead of --num-requests), then wait "
                   "for the requests in flight")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (rate inf: always this many)")
    p.add_argument("--mix", action="store_true",
                   help="random request kinds: chat/completions, stream, n, logprobs, stop, "
                   "sampling, client cancels; every answer checked")
    p.add_argument("--cancel-prob", type=float, default=0.1,
                   help="--mix: chance that the client cancels a request")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--json-samples", action="store_true",
                   help="--json rows carry each request's TTFT / TPOT / ITL (samples_ms): "
                   "several clients' merged give the load's percentiles")
    p.add_argument("--start-at", type=float, default=None,
                   help="wait until this time (seconds since the epoch) before sending: "
                   "client processes started one after another send together")
    p.set_defaults(func=main)
