"""``mrv2 bench serve``: a request-rate sweep (Poisson arrivals) against a running server.

Streams ``/v1/completions`` and reports TTFT, TPOT and inter-token latency percentiles
(p50/p90/p99) and throughput for each rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (``q`` in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    values = sorted(values)
    pos = (len(values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


async def _request(client: Any, model: str, prompt: str, max_tokens: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}}
    result, start = Result(), time.perf_counter()
    last = start
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {await response.aread()!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        result.ok = True
    except Exception as error:  # a failed request is reported, not fatal
        result.error = repr(error)
    return result


async def run_rate(url: str, model: str, rate: float, num_requests: int, prompt_len: int,
                   max_tokens: int, api_key: str | None, seed: int) -> dict[str, Any]:
    """Send ``num_requests`` at Poisson ``rate`` (req/s; inf: all at once); summarize."""
    import httpx

    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=num_requests + 8)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600,
                                 limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for i in range(num_requests):
            prompt = " ".join(rng.choice(["hello", "world", "the", "capital", "of", "France"])
                              for _ in range(prompt_len)) + f" {i}"
            tasks.append(asyncio.create_task(_request(client, model, prompt, max_tokens)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    itl = [x for r in ok for x in r.itl]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "rate": rate, "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_throughput": tokens / duration,
        "errors": sorted({r.error for r in results if not r.ok})[:3],
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_ms"] = percentile(values, q) * 1000
    return summary


def _model(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    data = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()
    return str(data["data"][0]["id"])


def main(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    model = args.model or _model(url, args.api_key)
    rows = []
    print(f"{'rate':>6} {'ok':>4} {'fail':>4} {'req/s':>7} {'tok/s':>8} "
          f"{'TTFT p50/p90/p99 ms':>22} {'TPOT p50/p90/p99 ms':>22} {'ITL p50/p90/p99 ms':>22}")
    for rate in args.rates:
        s = asyncio.run(run_rate(url, model, rate, args.num_requests, args.prompt_len,
                                 args.max_tokens, args.api_key, args.seed))
        rows.append(s)

        def trio(name: str, s: dict[str, Any] = s) -> str:
            return "/".join(f"{s[f'{name}_p{q}_ms']:.1f}" for q in (50, 90, 99))

        print(f"{rate:>6} {s['completed']:>4} {s['failed']:>4} "
              f"{s['request_throughput']:>7.2f} {s['output_throughput']:>8.1f} "
              f"{trio('ttft'):>22} {trio('tpot'):>22} {trio('itl'):>22}")
        for error in s["errors"]:
            print(f"       error: {error}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0


def add_parser(sub: Any) -> None:
    """Register ``mrv2 bench serve``."""
    p = sub.add_parser("serve", help="request-rate sweep against a running mrv2 serve")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0, 16.0, math.inf],
                   help="requests per second; inf sends all at once")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32, help="words per prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=main)
