"""``mrv2 bench pooling``: offline throughput of pooling requests (embeddings, a
classifier's labels, a reranker's pair scores), as an embedding or reranking service sees it.

Workload: ``--num-prompts`` prompts of ``randint(--min-len, --max-len)`` token ids drawn with
``random.seed(--seed)`` (ids below 10,000), all queued at once; each task runs in its own
engine (``embed``: the model as is; ``classify``: the same checkpoint read as an
``XForSequenceClassification`` of one label, its head drawn with ``--load-format dummy``).
Reported per task: prompts and prompt tokens a second, steps, and on CUDA the model's FLOP rate
(``2 x parameters x tokens``, attention left out) against a measured bf16 GEMM's: prefill-only
work is compute-bound, so that ratio is its roofline fraction.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from mrv2.bench.measure import gemm_rate, release_engine_memory, report, resolve_model
from mrv2.config import EngineConfig
from mrv2.contract.params import SamplingParams
from mrv2.contract.pooling import PoolingParams
from mrv2.engine.engine import LLMEngine
from mrv2.model_loader.build import load_hf_config
from mrv2.model_loader.classification import SUFFIX

TASKS = ("embed", "classify")


def workload(num: int, low: int, high: int, seed: int) -> list[list[int]]:
    """The prompts: ``num`` of ``randint(low, high)`` ids below 10,000."""
    rng = random.Random(seed)
    return [[rng.randint(0, 9999) for _ in range(rng.randint(low, high))] for _ in range(num)]


def run(engine: LLMEngine, prompts: list[list[int]], task: str) -> float:
    """Pool every prompt (all queued at once); returns the seconds, to the last vector."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    pooling = PoolingParams(task=task)
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params, pooling_params=pooling)
    done = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.embedding, "a pooling request finished without its vector"
                done += 1
    assert done == len(prompts)
    return time.perf_counter() - start


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run each task; returns the results (also printed)."""
    model_dir = resolve_model(args.model)
    prompts = workload(args.num_prompts, args.min_len, args.max_len, args.seed)
    tokens = sum(map(len, prompts))
    results: dict[str, Any] = {"model": args.model, "prompts": len(prompts),
                               "prompt_tokens": tokens}
    for task in args.tasks:
        overrides: dict[str, Any] = dict(args.hf_overrides or {})
        if task == "classify":  # the checkpoint read as a one-label classifier
            architecture = (overrides.get("architectures")
                            or load_hf_config(model_dir).architectures)
            overrides["architectures"] = [a.replace("ForCausalLM", SUFFIX) for a in architecture]
            overrides.setdefault("num_labels", 1)
        engine = LLMEngine(EngineConfig.from_kwargs(
            model=model_dir, load_format=args.load_format, dtype=args.dtype,
            device=args.device, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            gpu_memory_utilization=args.gpu_memory_utilization, runner="pooling",
            enable_prefix_caching=False, hf_overrides=overrides))
        run(engine, workload(8, args.min_len, args.max_len, args.seed + 1), task)  # warm up
        seconds = run(engine, prompts, task)
        row: dict[str, Any] = {"seconds": round(seconds, 3),
                               "prompts_per_s": round(len(prompts) / seconds, 1),
                               "prompt_tok_s": round(tokens / seconds, 1)}
        if engine.runner.device.type == "cuda":
            params = sum(p.numel() for n, p in engine.runner.model.named_parameters()
                         if "embed_tokens" not in n and "lm_head" not in n)
            rate = 2 * params * tokens / seconds
            gemm = gemm_rate(engine.runner.device)
            row.update(model_TFLOPs=round(rate / 1e12, 1), gemm_TFLOPs=round(gemm / 1e12, 1),
                       flop_fraction=round(rate / gemm, 3))
        results[task] = row
        engine.shutdown()
        del engine
        release_engine_memory()
    return results


def main(args: argparse.Namespace) -> int:
    """Run and print the results as JSON."""
    report(bench(args), args.json)
    return 0


def add_parser(sub: Any) -> None:
    """Register ``mrv2 bench pooling``."""
    import json

    p = sub.add_parser("pooling", help="offline throughput of embedding / classification "
                       "requests")
    p.add_argument("--model", default="Qwen3-0.6B",
                   help="checkpoint dir or bundled config name (default Qwen3-0.6B)")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--hf-overrides", type=json.loads, default=None,
                   help="config.json fields to change, as JSON")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.set_defaults(func=main)
