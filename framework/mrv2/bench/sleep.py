"""``mrv2 bench sleep``: what sleep mode costs an RL loop (``LLM.sleep`` / ``wake_up``).

One engine (random weights by default). Each round: greedy tokens of a few prompts, then
``sleep(1)``, ``wake_up(["weights"])`` (the weights copied back from host memory),
``wake_up(["kv_cache"])`` (the KV cache back and the CUDA graphs captured again), and the
same prompts again, whose tokens must equal the first ones. A last round at level 2 times
``sleep(2)`` and ``wake_up()`` (its weights are then zeros: no tokens are compared).
Reported per round: the seconds of each part, the device memory in use awake and asleep
(every process's, as ``nvidia-smi`` counts it), and the weights' copy rate.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from mrv2.bench.measure import report, resolve_model
from mrv2.config import EngineConfig
from mrv2.contract.params import SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.runner.startup import device_bytes_in_use

_GIB = float(1 << 30)


def _tokens(engine: LLMEngine, prompts: list[list[int]], new: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[i] for i in ids]


def _timed(work: Any) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the rounds; returns the results (also printed)."""
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=resolve_model(args.model), load_format=args.load_format, dtype=args.dtype,
        device=args.device, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization))
    runner = engine.runner
    prompts = [[(7 * i + 3 * j) % 5000 + 10 for j in range(32)] for i in range(8)]
    want = _tokens(engine, prompts, args.new_tokens)
    weights = int(runner.startup.facts.get("weight_bytes", 0))
    results: dict[str, Any] = {"model": args.model, "weight_GiB": round(weights / _GIB, 2),
                               "kv_GiB": round(runner.startup.facts.get("kv_bytes", 0) / _GIB,
                                               2), "rounds": []}
    device = runner.device
    for level in [1] * args.rounds + [2]:
        awake = device_bytes_in_use(device)
        row: dict[str, Any] = {"level": level, "sleep_s": round(_timed(
            lambda level=level: engine.sleep(level)), 3)}
        row["in_use_awake_GiB"] = round(awake / _GIB, 2)
        row["in_use_asleep_GiB"] = round(device_bytes_in_use(device) / _GIB, 2)
        wake_weights = _timed(lambda: engine.wake_up(["weights"]))
        row["wake_weights_s"] = round(wake_weights, 3)
        if level == 1 and wake_weights > 0:
            row["weights_GB_s"] = round(weights / wake_weights / 1e9, 1)
        row["wake_kv_cache_s"] = round(_timed(lambda: engine.wake_up(["kv_cache"])), 3)
        row["graphs_s"] = round(runner.startup.seconds.get("graphs", 0.0), 3)
        if level == 1:
            row["tokens_match"] = _tokens(engine, prompts, args.new_tokens) == want
        results["rounds"].append(row)
    engine.shutdown()
    return results


def main(args: argparse.Namespace) -> int:
    """Run and print the results as JSON."""
    report(bench(args), args.json)
    return 0


def add_parser(sub: Any) -> None:
    """Register ``mrv2 bench sleep``."""
    p = sub.add_parser("sleep", help="sleep mode: sleep and wake_up seconds, memory given back")
    p.add_argument("--model", default="Qwen3-0.6B",
                   help="checkpoint dir or bundled config name (default Qwen3-0.6B)")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--rounds", type=int, default=2, help="level-1 rounds (then one at level 2)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.set_defaults(func=main)
