"""``mrv2 bench throughput``: the peers' public offline workload, plus its floor and ratios.

Workload (as nano-vllm / vLLM publish it): 256 requests, ``random.seed(0)``; each prompt
``randint(100, 1024)`` token ids drawn with ``randint(0, 10000)``; then each
``max_tokens = randint(100, 1024)``; temperature 0.6, ignore_eos, max_model_len 4096.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Any

import torch

from mrv2.bench.measure import (
    PARALLEL_VARIANTS,
    QUANT_VARIANTS,
    breakdown,
    busy_fraction,
    copy_bandwidth,
    expert_read_bytes,
    expert_reads,
    floor_seconds,
    gemm_rate,
    instrument,
    int_at_least,
    release_engine_memory,
    report,
    resolve_model,
    roofline_seconds,
)
from mrv2.config import EngineConfig
from mrv2.contract.params import SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.engine.gc_pauses import GCPauses
from mrv2.layers.moe import COUNT_READS_ENV


def workload(
    num_requests: int, seed: int = 0, shared_prefix: int = 0
) -> tuple[list[list[int]], list[int]]:
    """Prompts and max_tokens of the public benchmark; ``shared_prefix`` random tokens (drawn
    after everything else) are put in front of every prompt."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))]
               for _ in range(num_requests)]
    max_tokens = [rng.randint(100, 1024) for _ in range(num_requests)]
    prefix = [rng.randint(0, 10000) for _ in range(shared_prefix)]
    return [prefix + p for p in prompts], max_tokens


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int],
               temperature: float) -> tuple[int, float]:
    """Generate everything; returns (output tokens, seconds)."""
    for prompt, n in zip(prompts, max_tokens, strict=True):
        engine.add_request(prompt, SamplingParams(temperature=temperature, max_tokens=n,
                                                  ignore_eos=True))
    produced = 0
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                produced += len(out.outputs[0].token_ids)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return produced, time.perf_counter() - start


def warm_up(engine: LLMEngine, temperature: float) -> None:
    """Four short requests (other prompts than the timed ones): the kernels compile here."""
    prompts, _ = workload(4, seed=1)
    run_engine(engine, prompts, [8] * 4, temperature)


def mrv2_tok_s(config: EngineConfig, prompts: list[list[int]], max_tokens: list[int],
               temperature: float) -> float:
    """Output tokens a second of the requests through a fresh engine, warmed up first (as
    :func:`hf_generate_tok_s` warms HF up)."""
    engine = LLMEngine(config)
    try:
        warm_up(engine, temperature)
        produced, seconds = run_engine(engine, prompts, max_tokens, temperature)
    finally:
        engine.shutdown()
    return produced / seconds


def hf_generate_tok_s(model_dir: str, prompts: list[list[int]], max_tokens: list[int],
                      dtype: torch.dtype, temperature: float) -> float:
    """The same requests through HF transformers ``generate`` (one left-padded batch)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).cuda().eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt)
        mask[i, width - len(prompt):] = 1
    kwargs: dict[str, Any] = dict(
        max_new_tokens=max(max_tokens), min_new_tokens=max(max_tokens), do_sample=True,
        temperature=temperature, top_k=0, top_p=1.0, pad_token_id=0,
    )
    with torch.no_grad():
        model.generate(ids[:2].cuda(), attention_mask=mask[:2].cuda(), max_new_tokens=4,
                       pad_token_id=0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids.cuda(), attention_mask=mask.cuda(), **kwargs)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return sum(max_tokens) / seconds


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run the workload with the given variants; returns a result dict (also printed)."""
    model_dir = resolve_model(args.model)
    if args.count_expert_reads:  # MoE layers count the experts each step reads (the floor)
        os.environ[COUNT_READS_ENV] = "1"
    prompts, max_tokens = workload(args.num_requests, args.seed, args.shared_prefix)
    results: dict[str, Any] = {"model": args.model, "requests": args.num_requests,
                               "shared_prefix": args.shared_prefix,
                               "output_tokens_expected": sum(max_tokens)}
    cache: dict[str, Any] = {}
    if args.kv_fraction is not None:
        # the whole workload's KV at once, in blocks, times the fraction: forces preemption
        need = sum(-(-(len(p) + m) // 16) for p, m in zip(prompts, max_tokens, strict=True))
        cache = {"block_size": 16, "num_gpu_blocks_override": max(1, int(need * args.kv_fraction))}
        results["num_gpu_blocks"] = cache["num_gpu_blocks_override"]
    variants: dict[str, dict[str, Any]] = {
        "default": {}, "async_off": {"async_scheduling": False},
        "graphs_off": {"enforce_eager": True}, "prefix_off": {"enable_prefix_caching": False},
        "mixed_graphs_off": {"max_mixed_graph_tokens": 0},
        "mixed_graphs_512": {"max_mixed_graph_tokens": 512},
        "kv_fp8": {"kv_cache_dtype": "fp8"}, **QUANT_VARIANTS, **PARALLEL_VARIANTS}
    chosen = args.variants if "default" in args.variants else ["default", *args.variants]
    bandwidth = None
    flop_rate = float("nan")
    for name in chosen:
        config = EngineConfig.from_kwargs(
            model=model_dir, load_format=args.load_format, dtype=args.dtype,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            gpu_memory_utilization=args.gpu_memory_utilization,
            tensor_parallel_size=args.tensor_parallel_size,
            **{"kv_cache_dtype": args.kv_cache_dtype, **cache, **variants[name]},
        )
        engine = LLMEngine(config)
        warm_up(engine, args.temperature)
        if args.full_warmup and name == chosen[0]:
            # Triton compiles a kernel variant per new integer specialization (values equal to 1
            # or divisible by 16); one untimed pass compiles them all for every variant after.
            # (other prompts of the same shape, so the prefix cache holds none of the timed ones)
            warm_all, _ = workload(args.num_requests, args.seed + 1, args.shared_prefix)
            run_engine(engine, warm_all, max_tokens, args.temperature)
        log = instrument(engine)
        reads_before = expert_reads(engine.runner)
        before = engine.stats()
        pauses = GCPauses()  # (an offline engine's heap is not frozen: gc_pauses.py)
        try:
            produced, seconds = run_engine(engine, prompts, max_tokens, args.temperature)
        finally:
            pauses.close()
        finished = time.perf_counter()
        row: dict[str, Any] = {"output_tokens": produced, "seconds": round(seconds, 3),
                               "output_tok_s": round(produced / seconds, 1),
                               "steps": len(log.steps),
                               "cpu_execute_ms_per_step": round(
                                   log.cpu_execute_s * 1e3 / len(log.steps), 3),
                               "wait_ms_per_step": round(log.wait_s * 1e3 / len(log.steps), 3)}
        after = engine.stats()
        queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        row["prefix_hit_rate"] = round(hits / queries, 3) if queries else 0.0
        row["gc_pauses"] = pauses.summary()
        row["preemptions"] = after["num_preemptions"] - before["num_preemptions"]
        if engine.runner.device.type == "cuda":
            if bandwidth is None:
                bandwidth = copy_bandwidth(engine.runner.device)
                results["copy_bandwidth_GBs"] = round(bandwidth / 1e9, 1)
                flop_rate = gemm_rate(engine.runner.device)
                results["gemm_TFLOPs"] = round(flop_rate / 1e12, 1)
            reads_after = expert_reads(engine.runner)
            experts = 0
            if reads_after and reads_after[0] >= 0:
                experts = expert_read_bytes(engine.runner, reads_before, reads_after)
                steps = max(1, len(log.steps))
                row["experts_read_per_layer_step"] = round(
                    (sum(reads_after) - sum(reads_before)) / len(reads_after) / steps, 2)
                row["expert_GB_read"] = round(experts / 1e9, 2)
            floor = floor_seconds(log, engine.runner, bandwidth, experts)
            row["floor_seconds"] = round(floor, 3)
            row["floor_fraction"] = round(floor / seconds, 3)
            roofline = roofline_seconds(log, engine.runner, bandwidth, flop_rate, experts)
            row["roofline_seconds"] = round(roofline, 3)
            row["roofline_fraction"] = round(roofline / seconds, 3)
            row["gpu_busy_decode"] = round(busy_fraction(log), 3)
        row["by_step_kind"] = breakdown(log, finished)
        results[name] = row
        engine.shutdown()
        del engine
        release_engine_memory()
    for name in (n for n in chosen if n != "default"):
        results[f"default_over_{name}"] = round(
            results["default"]["output_tok_s"] / results[name]["output_tok_s"], 3)
    if args.hf_requests and torch.cuda.is_available():
        n = args.hf_requests
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(args.dtype,
                                                                            torch.bfloat16)
        hf = hf_generate_tok_s(model_dir, prompts[:n], max_tokens[:n], dtype, args.temperature)
        config = EngineConfig.from_kwargs(model=model_dir, load_format=args.load_format,
                                          dtype=args.dtype, max_model_len=args.max_model_len,
                                          gpu_memory_utilization=args.gpu_memory_utilization)
        ours = mrv2_tok_s(config, prompts[:n], max_tokens[:n], args.temperature)
        results["hf_subset"] = {"requests": n, "hf_output_tok_s": round(hf, 1),
                                "mrv2_output_tok_s": round(ours, 1),
                                "mrv2_over_hf": round(ours / hf, 2)}
    return results


def add_parser(sub: Any) -> None:
    """Register ``mrv2 bench throughput``."""
    p = sub.add_parser("throughput", help="the public offline throughput workload")
    p.add_argument("--model", default="Qwen3-0.6B",
                   help="checkpoint dir or bundled config name (default Qwen3-0.6B)")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int_at_least(1), default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (GPUs) to split the model over")
    p.add_argument("--variants", nargs="*", default=[],
                   choices=["default", "async_off", "graphs_off", "prefix_off",
                            "mixed_graphs_off", "mixed_graphs_512", "kv_fp8",
                            *QUANT_VARIANTS, *PARALLEL_VARIANTS],
                   help="also run with async scheduling off / CUDA graphs off / the prefix "
                   "cache off / steps with prompt tokens eager / in CUDA graphs up to 512 "
                   "tokens only / an fp8 KV cache / random GPTQ 4-bit, AWQ 4-bit or block-FP8 "
                   "linear weights (in this order; name default to place it)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache element type of every variant (kv_fp8 sets fp8)")
    p.add_argument("--hf-requests", type=int, default=0,
                   help="also run the first N requests through HF generate, for a ratio")
    p.add_argument("--shared-prefix", type=int, default=0,
                   help="put the same N random tokens in front of every prompt")
    p.add_argument("--kv-fraction", type=float, default=None,
                   help="limit the KV cache to this fraction of what the whole workload needs "
                        "(counted in blocks of one block table: with sliding-window tables a "
                        "block holds fewer layers, so equal memory is twice the fraction for "
                        "a model of as many sliding as full layers)")
    p.add_argument("--full-warmup", action="store_true",
                   help="run the workload once untimed first, so no variant pays compilation")
    p.add_argument("--no-count-expert-reads", dest="count_expert_reads", action="store_false",
                   help="MoE models: do not count the experts each step reads (the byte floor "
                   "then has no routed experts; counting costs a few small launches per layer)")
    p.add_argument("--json", default=None, help="write the results here too")
    p.set_defaults(func=main)


def format_breakdown(results: dict[str, Any]) -> str:
    """A table of where each variant's time went, per step kind (``by_step_kind``)."""
    lines = [f"{'variant':12s} {'step kind':13s} {'steps':>6s} {'tokens':>8s} {'wall s':>8s} "
             f"{'host ms/step':>12s} {'device s':>9s} {'GPU busy':>8s}"]
    for name, row in results.items():
        if not isinstance(row, dict) or "by_step_kind" not in row:
            continue
        for kind, k in sorted(row["by_step_kind"].items()):
            device = f"{k['device_s']:9.2f}" if "device_s" in k else f"{'-':>9s}"
            busy = f"{k['gpu_busy']:8.2f}" if "gpu_busy" in k else f"{'-':>8s}"
            lines.append(f"{name:12s} {kind:13s} {k['steps']:6d} {k['tokens']:8d} "
                         f"{k['wall_s']:8.2f} {k['host_ms_per_step']:12.2f} {device} {busy}")
        if "gc_pauses" in row:
            gc_row = row["gc_pauses"]
            lines.append(f"{name:12s} garbage collector: {sum(gc_row['ms']):.1f} ms in "
                         f"{sum(gc_row['collections'])} collections ({gc_row['collections'][2]} "
                         f"of the oldest generation, {gc_row['ms'][2]:.1f} ms), longest "
                         f"{gc_row['longest_ms']:.1f} ms")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run and print the results: where the time went, then everything as JSON."""
    results = bench(args)
    print(format_breakdown(results))
    report(results, args.json)
    return 0
