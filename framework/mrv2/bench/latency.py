"""``mrv2 bench latency``: time per output token at several batch sizes (greedy decode)."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import torch

from mrv2.bench.measure import StepLog, instrument, release_engine_memory, report, resolve_model
from mrv2.config import EngineConfig
from mrv2.contract.params import SamplingParams
from mrv2.engine.engine import LLMEngine


def measure(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int,
            log: StepLog | None = None, seed: int = 0) -> dict[str, float]:
    """TTFT and time per output token of ``batch`` requests decoding together; with ``log``
    (from :func:`instrument`) also the host time in ``execute`` and the device time per
    decode step (medians)."""
    first_step = len(log.steps) if log is not None else 0
    rng = random.Random(seed * 1000 + batch)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([rng.randint(0, 10000) for _ in range(prompt_len)], params,
                           stream=True)
    start = time.perf_counter()
    first: float | None = None
    while engine.has_unfinished():
        outs = engine.step()
        if first is None and outs:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    row = {"batch": batch, "ttft_ms": round((first - start) * 1e3, 2),
           "tpot_ms": round((end - first) * 1e3 / (new_tokens - 1), 3)}
    if log is not None:
        k = engine.runner.num_speculative_tokens  # decode steps: 1 (+ k drafts) per request
        decode = [i for i in range(first_step, len(log.steps))
                  if log.steps[i][1] <= log.steps[i][0] * (1 + k)]
        row["host_execute_ms"] = round(statistics.median(log.host_s[i] for i in decode) * 1e3, 3)
        if log.events:
            torch.cuda.synchronize()
            row["gpu_step_ms"] = round(statistics.median(
                log.events[i][0].elapsed_time(log.events[i][1]) for i in decode), 3)
    return row


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Latency rows for each batch size and each variant."""
    model_dir = resolve_model(args.model)
    variants: dict[str, dict[str, Any]] = {
        "default": {}, "async_off": {"async_scheduling": False},
        "graphs_off": {"enforce_eager": True},
        "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    }
    results: dict[str, Any] = {"model": args.model, "prompt_len": args.prompt_len,
                               "new_tokens": args.new_tokens}
    for name in ["default", *args.variants]:
        config = EngineConfig.from_kwargs(
            model=model_dir, load_format=args.load_format, dtype=args.dtype,
            max_model_len=args.max_model_len, max_num_seqs=max(args.batch_sizes),
            gpu_memory_utilization=args.gpu_memory_utilization, **variants[name],
        )
        engine = LLMEngine(config)
        for b in args.batch_sizes:  # warm up: compile every kernel specialization first
            measure(engine, b, args.prompt_len, 16, seed=1)  # other prompts: no prefix hits
        log = instrument(engine)
        results[name] = [measure(engine, b, args.prompt_len, args.new_tokens, log)
                         for b in args.batch_sizes]
        if engine.runner.num_speculative_tokens:
            stats = engine.stats()
            results[name].append({"spec_acceptance_rate": round(stats["spec_acceptance_rate"], 3),
                                  "spec_num_draft_tokens": stats["spec_num_draft_tokens"]})
        del engine
        release_engine_memory()
    return results


def add_parser(sub: Any) -> None:
    """Register ``mrv2 bench latency``."""
    p = sub.add_parser("latency", help="time per output token at batch 1, 8, 64")
    p.add_argument("--model", default="Qwen3-0.6B")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--variants", nargs="*", default=[],
                   choices=["async_off", "graphs_off", "ngram"],
                   help="ngram: n-gram speculation, k=3 (random weights: acceptance is whatever "
                        "the random model's greedy loops give; read it as the cost of verifying)")
    p.add_argument("--json", default=None)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run and print the results."""
    report(bench(args), args.json)
    return 0
