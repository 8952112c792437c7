"""``mrv2 bench tp-channel``: what publishing a step to the tensor-parallel workers costs.

Rank 0 publishes each step's :class:`~mrv2.contract.requests.SchedulerOutput` through the
shared-memory ring (:class:`~mrv2.distributed.channel.ShmRing`) before it runs the step itself.
This times, for realistic steps (decode at 1 / 64 / 256 requests with a few new blocks; a
prefill step adding 8 prompts of 1,000 tokens) and 1 and 3 reader processes:

- ``publish_us``: rank 0's cost per step (pickle + copy), the only cost on its critical path;
- ``latency_us``: from the start of ``publish`` to a reader holding the unpickled step
  (median and p99 over the readers; the clocks are the same monotonic clock), which a worker
  pays before it can launch the step — hidden while the GPU still runs the previous one.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
import time
from typing import Any

from mrv2.contract.params import SamplingParams
from mrv2.contract.requests import NewRequest, SchedulerOutput
from mrv2.distributed.channel import ShmRing

_CAPACITY = 16 << 20


def decode_step(batch: int, step: int) -> SchedulerOutput:
    """A decode step of ``batch`` requests, every 16th taking a new block."""
    ids = [f"cmpl-{i:08x}-{step % 7}" for i in range(batch)]
    return SchedulerOutput({r: 1 for r in ids},
                           new_block_ids={r: [1000 + i] for i, r in enumerate(ids) if i % 16 == 0})


def prefill_step(step: int, prompts: int = 8, length: int = 1000) -> SchedulerOutput:
    """A step adding ``prompts`` new requests of ``length`` tokens each (chunked at 8,192)."""
    new = [NewRequest(f"cmpl-new-{step}-{i}", [(i * 31 + t) % 150_000 for t in range(length)],
                      SamplingParams(max_tokens=256), seed=i, block_ids=list(range(63)))
           for i in range(prompts)]
    return SchedulerOutput({r.req_id: length for r in new}, new_requests=new)


def _reader(name: str, readers: int, reader: int, count: int) -> None:
    ring = ShmRing.attach(name, readers, _CAPACITY, reader, spin_s=float(sys.argv[6]))
    print("ready", flush=True)
    latencies = []
    for _ in range(count):
        sent, _step = ring.receive()
        latencies.append(time.perf_counter() - sent)
    ring.close()
    print(json.dumps(latencies))


def measure(kind: str, make: Any, readers: int, count: int, spin_s: float) -> dict[str, Any]:
    """Publish ``count`` steps from ``make(i)`` to ``readers`` reader processes."""
    ring = ShmRing(readers, _CAPACITY)
    procs = [subprocess.Popen([sys.executable, "-m", "mrv2.bench.tp_channel", "--reader",
                               ring.name, str(readers), str(r), str(count), str(spin_s)],
                              stdout=subprocess.PIPE, text=True) for r in range(readers)]
    steps = [make(i) for i in range(count)]
    for proc in procs:  # every reader attached and waiting
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    publish = []
    for step in steps:
        start = time.perf_counter()
        ring.publish((start, step))
        publish.append(time.perf_counter() - start)
        time.sleep(0.002)  # a step's GPU time: the readers are waiting, as workers are
    latencies: list[float] = []
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        latencies += json.loads(out)
    ring.close()
    latencies.sort()
    return {"step": kind, "readers": readers, "bytes": len(pickle.dumps(steps[0])),
            "publish_us": round(statistics.median(publish) * 1e6, 1),
            "latency_us_p50": round(latencies[len(latencies) // 2] * 1e6, 1),
            "latency_us_p99": round(latencies[int(len(latencies) * 0.99)] * 1e6, 1)}


def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every step kind at every reader count."""
    kinds = [(f"decode b{b}", lambda i, b=b: decode_step(b, i)) for b in (1, 64, 256)]
    kinds.append(("prefill 8x1000", prefill_step))
    return [measure(kind, make, readers, args.steps, args.spin_ms / 1e3)
            for readers in args.readers for kind, make in kinds]


def add_parser(sub: Any) -> None:
    """Register ``mrv2 bench tp-channel``."""
    p = sub.add_parser("tp-channel", help="cost of publishing steps to tensor-parallel workers")
    p.add_argument("--readers", type=int, nargs="+", default=[1, 3],
                   help="worker processes (tensor_parallel_size - 1)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--spin-ms", type=float, default=100.0,
                   help="how long a reader spins before sleeping (a GPU worker's: 100)")
    p.add_argument("--json", default=None, help="write the results here too")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Print a table, then the JSON (last)."""
    from mrv2.bench.measure import report  # not at the top: the reader processes skip it

    rows = bench(args)
    print(f"{'step':<16}{'readers':>8}{'bytes':>10}{'publish us':>12}{'p50 us':>10}{'p99 us':>10}")
    for r in rows:
        print(f"{r['step']:<16}{r['readers']:>8}{r['bytes']:>10}{r['publish_us']:>12}"
              f"{r['latency_us_p50']:>10}{r['latency_us_p99']:>10}")
    report(rows, args.json)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--reader":
        _reader(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
