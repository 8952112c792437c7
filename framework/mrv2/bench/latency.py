"""``mrv2 bench latency``: time per output token at several batch sizes (greedy decode).

With ``--device cpu`` the run also times HF transformers ``generate`` in the same process on the
same prompts (alternating with mrv2, repeated, medians) and reports the ratio; its defaults suit
a small CPU: the default model with its real weights (SmolLM2-135M-Instruct), float32, batches
1 and 8, 64-token prompts, 64 new tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from mrv2.bench.measure import (
    PARALLEL_VARIANTS,
    QUANT_VARIANTS,
    StepLog,
    instrument,
    int_at_least,
    release_engine_memory,
    report,
    resolve_model,
)
from mrv2.config import EngineConfig
from mrv2.contract.lora import LoRARequest
from mrv2.contract.params import RequestOutputKind, SamplingParams
from mrv2.engine.engine import LLMEngine

#: Defaults of the arguments left unset: on the GPU, and with ``--device cpu``.
GPU_DEFAULTS: dict[str, Any] = {
    "model": "Qwen3-0.6B", "load_format": "dummy", "dtype": "bfloat16",
    "batch_sizes": [1, 8, 64], "prompt_len": 128, "new_tokens": 512, "max_model_len": 4096,
    "repeats": 1,
}
CPU_DEFAULTS: dict[str, Any] = {
    "model": "SmolLM2-135M-Instruct", "load_format": "auto", "dtype": "float32",
    "batch_sizes": [1, 8], "prompt_len": 64, "new_tokens": 64, "max_model_len": 1024,
    "repeats": 3,
}


#: Acceptance rates of the ``synthetic_*`` variants.
SYNTHETIC_RATES = (0.0, 0.3, 0.6, 0.9)
#: Draft lengths of the ``self_draft_*`` variants.
SELF_DRAFT_KS = (1, 2, 3, 4)
#: Draft lengths of the ``eagle3_*`` variants (a drawn EAGLE-3 head: ``mrv2-plugin-eagle``).
EAGLE3_KS = (1, 2, 3, 4)
#: The ``lora_*`` variants: the engine with ``enable_lora`` (4 slots of ``--lora-rank``) and
#: the requests on no adapter, on one, or spread over four (random adapters on every
#: projection: :mod:`mrv2.bench.lora`).
LORA_VARIANTS = {"lora_idle": 0, "lora_1": 1, "lora_4": 4}


def eagle3_head_dir(model_dir: str) -> str:
    """A temporary directory holding only the ``config.json`` of an EAGLE-3 head for the
    target in ``model_dir`` (one midlayer of the target's widths, ``draft_vocab_size`` =
    min(32000, vocab), the default aux layers), whose weights ``load_format="dummy"`` draws:
    a random head accepts little, so its variants time the cost of drafting with it."""
    import atexit
    import shutil
    import tempfile
    from pathlib import Path

    target = json.loads((Path(model_dir) / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_theta",
            "rope_scaling", "rope_parameters", "vocab_size", "hidden_act")
    head = {k: target[k] for k in keep if target.get(k) is not None}
    head.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                num_hidden_layers=1, draft_vocab_size=min(32000, int(target["vocab_size"])),
                tie_word_embeddings=False)
    path = tempfile.mkdtemp(prefix="mrv2-eagle3-head-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    (Path(path) / "config.json").write_text(json.dumps(head, indent=2))
    return path


def bench_prompts(batch: int, prompt_len: int, seed: int, vocab_size: int = 10_001
                  ) -> list[list[int]]:
    """``batch`` random prompts of ``prompt_len`` token ids up to 10000 (below
    ``vocab_size``; a seed per run, so runs share no prefix)."""
    rng = random.Random(seed * 1000 + batch)
    high = min(10_000, vocab_size - 1)
    return [[rng.randint(0, high) for _ in range(prompt_len)] for _ in range(batch)]


def measure(engine: LLMEngine, batch: int, prompt_len: int, new_tokens: int,
            log: StepLog | None = None, seed: int = 0,
            sampling: dict[str, Any] | None = None,
            loras: list[LoRARequest] | None = None) -> dict[str, float]:
    """TTFT and time per output token of ``batch`` requests decoding together (greedy, or
    ``sampling``: :class:`SamplingParams` keywords; request ``i`` through adapter
    ``loras[i % len(loras)]`` when given); with ``log`` (from :func:`instrument`) also the
    host time in ``execute`` and the device time per decode step (medians). TTFT runs until
    every request has its first token, TPOT from there to the end over the
    ``new_tokens - 1`` tokens the last one still makes (a batch whose prompts take several
    steps: those steps are prefill, not the decode's)."""
    first_step = len(log.steps) if log is not None else 0
    params = SamplingParams(**{"temperature": 0.0, **(sampling or {})},
                            max_tokens=new_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)  # (as the server's)
    for i, prompt in enumerate(bench_prompts(batch, prompt_len, seed,
                                             engine.runner.vocab_size)):
        engine.add_request(prompt, params, stream=True,
                           lora_request=loras[i % len(loras)] if loras else None)
    start = time.perf_counter()
    first: float | None = None
    started: set[str] = set()
    while engine.has_unfinished():
        outs = engine.step()
        if first is None and outs:
            started.update(o.request_id for o in outs)
            if len(started) == batch:
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


def _seed(rep: int) -> int:
    """The prompts' seed of repetition ``rep``: 0, then 2, 3, ... (1 is the warm-up's)."""
    return 0 if rep == 0 else rep + 1


def _median_row(batch: int, rows: list[dict[str, float]]) -> dict[str, float]:
    keys = [k for k in rows[0] if k != "batch"]
    return {"batch": batch, **{k: round(statistics.median(r[k] for r in rows), 3) for k in keys}}


def compare_with_hf(engine: LLMEngine, model_dir: str, args: argparse.Namespace,
                    dtype: torch.dtype) -> list[dict[str, float]]:
    """mrv2 and HF ``generate`` on the same prompts, alternating which goes first, ``repeats``
    times per batch size; medians, and ``speedup_vs_hf`` = HF TPOT / mrv2 TPOT."""
    from mrv2.bench.hf_reference import hf_measure, load_hf_model

    hf = load_hf_model(model_dir, args.load_format, dtype)
    vocab = engine.runner.vocab_size  # (measure's prompts: the same token ids)
    for b in args.batch_sizes:  # warm up both on other prompts
        measure(engine, b, args.prompt_len, 8, seed=1)
        hf_measure(hf, bench_prompts(b, args.prompt_len, 1, vocab), 8)
    log = instrument(engine)
    ours: dict[int, list[dict[str, float]]] = {b: [] for b in args.batch_sizes}
    theirs: dict[int, list[dict[str, float]]] = {b: [] for b in args.batch_sizes}
    for rep in range(args.repeats):
        for b in args.batch_sizes:
            prompts = bench_prompts(b, args.prompt_len, _seed(rep), vocab)
            for ours_turn in ([True, False] if rep % 2 == 0 else [False, True]):
                if ours_turn:
                    ours[b].append(measure(engine, b, args.prompt_len, args.new_tokens, log,
                                           seed=_seed(rep)))
                else:
                    theirs[b].append(hf_measure(hf, prompts, args.new_tokens))
    rows = []
    for b in args.batch_sizes:
        row = _median_row(b, ours[b])
        hf_row = _median_row(b, [{"batch": b, **r} for r in theirs[b]])
        row["hf_ttft_ms"], row["hf_tpot_ms"] = hf_row["ttft_ms"], hf_row["tpot_ms"]
        row["speedup_vs_hf"] = round(row["hf_tpot_ms"] / row["tpot_ms"], 3)
        rows.append(row)
    return rows


def _sampling_json(text: str) -> dict[str, Any]:
    """``--sampling-params``: a JSON object of :class:`SamplingParams` keywords, checked here
    (a bad name or value fails before any model loads)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--sampling-params is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--sampling-params must be a JSON object, got "
                                         f"{type(value).__name__}")
    banned = {"max_tokens", "ignore_eos"} & set(value)
    if banned:
        raise argparse.ArgumentTypeError(f"--sampling-params sets {sorted(banned)}: the bench "
                                         "sets them (--new-tokens)")
    try:
        SamplingParams(**{"temperature": 0.0, **value})  # (as the bench builds them: n > 1
    except (TypeError, ValueError) as exc:             # without a temperature is refused)
        raise argparse.ArgumentTypeError(f"--sampling-params: {exc}") from None
    return value


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Latency rows for each batch size and each variant (on the CPU, beside HF's)."""
    cpu = args.device == "cpu"
    for name, value in (CPU_DEFAULTS if cpu else GPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if cpu and args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    variants: dict[str, dict[str, Any]] = {
        "default": {}, "async_off": {"async_scheduling": False},
        "graphs_off": {"enforce_eager": True}, **QUANT_VARIANTS, **PARALLEL_VARIANTS,
        "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
        **{f"synthetic_{rate}": {"speculative_config": {
            "method": "ngram", "num_speculative_tokens": 3,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": rate}}
           for rate in SYNTHETIC_RATES},
        # the target drafting for itself (with dummy weights both draw the same seed): every
        # draft accepted, the machinery's ceiling at k drafts per step
        **{f"self_draft_{k}": {"speculative_config": {
            "method": "draft_model", "model": model_dir, "num_speculative_tokens": k}}
           for k in SELF_DRAFT_KS},
    }
    if any(v.startswith("eagle3_") for v in args.variants):
        if args.load_format != "dummy":
            raise SystemExit("the eagle3_K variants draw the head's weights: they need "
                             "--load-format dummy")
        head_dir = eagle3_head_dir(model_dir)
        variants.update({f"eagle3_{k}": {"speculative_config": {
            "method": "eagle3", "model": head_dir, "num_speculative_tokens": k}}
            for k in EAGLE3_KS})
    loras = []
    if any(v in LORA_VARIANTS for v in args.variants):
        from mrv2.bench.lora import random_adapters

        loras = random_adapters(model_dir, max(LORA_VARIANTS.values()), args.lora_rank)
        variants.update({name: {"enable_lora": True, "max_loras": max(LORA_VARIANTS.values()),
                                "max_lora_rank": max(16, args.lora_rank)}
                         for name in LORA_VARIANTS})
    results: dict[str, Any] = {"model": args.model, "device": args.device,
                               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    if cpu:
        results.update(threads=torch.get_num_threads(), dtype=args.dtype,
                       load_format=args.load_format, repeats=args.repeats)
    for name in ["default", *args.variants]:
        config = EngineConfig.from_kwargs(
            model=model_dir, load_format=args.load_format, dtype=args.dtype, device=args.device,
            max_model_len=args.max_model_len, max_num_seqs=max(args.batch_sizes),
            gpu_memory_utilization=args.gpu_memory_utilization,
            tensor_parallel_size=args.tensor_parallel_size,
            hf_overrides=getattr(args, "hf_overrides", None) or {},
            **{"kv_cache_dtype": args.kv_cache_dtype, **variants[name]},
        )
        engine = LLMEngine(config)
        if cpu and name == "default" and not args.no_hf:
            results[name] = compare_with_hf(engine, model_dir, args, engine.runner.dtype)
        else:
            sampling = args.sampling_params
            adapters = loras[: LORA_VARIANTS.get(name, 0)]
            for b in args.batch_sizes:  # warm up: compile every kernel specialization first
                measure(engine, b, args.prompt_len, 16, seed=1,  # other prompts: no prefix hits
                        sampling=sampling, loras=adapters)
            log = instrument(engine)
            results[name] = [
                _median_row(b, [measure(engine, b, args.prompt_len, args.new_tokens, log,
                                        seed=_seed(rep), sampling=sampling, loras=adapters)
                                for rep in range(args.repeats)])
                for b in args.batch_sizes
            ]
        results.setdefault("kv_blocks", {})[name] = engine.runner.num_kv_blocks
        if engine.runner.num_speculative_tokens:
            stats = engine.stats()
            results[name].append({
                "spec_acceptance_rate": round(stats["spec_acceptance_rate"], 3),
                "spec_acceptance_rate_per_pos": [
                    round(r, 3) for r in stats["spec_acceptance_rate_per_pos"]],
                "spec_mean_accepted_length": round(stats["spec_mean_accepted_length"], 3),
                "spec_num_draft_tokens": stats["spec_num_draft_tokens"],
            })
        engine.shutdown()
        del engine
        release_engine_memory()
    return results


def add_parser(sub: Any) -> None:
    """Register ``mrv2 bench latency``."""
    p = sub.add_parser("latency", help="time per output token at batch 1, 8, 64 (CPU: vs HF)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="cpu: also time HF generate on the same prompts and report the ratio; "
                        "other defaults then suit a CPU (see CPU_DEFAULTS)")
    p.add_argument("--model", default=None,
                   help="checkpoint dir, bundled config or SmolLM2-135M-Instruct "
                        "(default: Qwen3-0.6B; cpu: SmolLM2-135M-Instruct)")
    p.add_argument("--load-format", default=None, choices=["auto", "dummy"],
                   help="default: dummy; cpu: auto (real weights)")
    p.add_argument("--dtype", default=None, help="default: bfloat16; cpu: float32")
    p.add_argument("--batch-sizes", type=int_at_least(1), nargs="+", default=None,
                   help="default: 1 8 64; cpu: 1 8")
    p.add_argument("--prompt-len", type=int_at_least(1), default=None,
                   help="default: 128; cpu: 64")
    p.add_argument("--new-tokens", type=int_at_least(2, " (TPOT is over the tokens after the "
                                                       "first)"), default=None,
                   help="default: 512; cpu: 64")
    p.add_argument("--max-model-len", type=int, default=None, help="default: 4096; cpu: 1024")
    p.add_argument("--repeats", type=int_at_least(1), default=None,
                   help="runs per batch size, medians reported (default: 1; cpu: 3)")
    p.add_argument("--threads", type=int, default=None,
                   help="cpu: torch threads (default: torch's own, e.g. OMP_NUM_THREADS)")
    p.add_argument("--no-hf", action="store_true", help="cpu: skip the HF reference")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV cache element type")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks (GPUs) to split the model over")
    p.add_argument("--sampling-params", type=_sampling_json, default=None, metavar="JSON",
                   help="the requests' SamplingParams keywords, e.g. '{\"temperature\": 0.6, "
                   "\"top_k\": 20, \"top_p\": 0.95, \"seed\": 0}' (default: greedy)")
    p.add_argument("--variants", nargs="*", default=[],
                   choices=["async_off", "graphs_off", *QUANT_VARIANTS, *PARALLEL_VARIANTS,
                            "ngram",
                            *(f"synthetic_{rate}" for rate in SYNTHETIC_RATES),
                            *(f"self_draft_{k}" for k in SELF_DRAFT_KS),
                            *(f"eagle3_{k}" for k in EAGLE3_KS), *LORA_VARIANTS],
                   help="gptq_w4 / awq_w4 / fp8_w8: the linear layers' weights as random "
                        "GPTQ 4-bit (symmetric) / AWQ 4-bit (zero points) / block-FP8 ones "
                        "(--load-format dummy). "
                        "ngram: n-gram speculation, k=3 (random weights: acceptance is whatever "
                        "the random model's greedy loops give; read it as the cost of "
                        "verifying). synthetic_A: SYNTHETIC acceptance, the n-gram drafts kept "
                        "with probability A whatever the model says (the output is not the "
                        "model's): what a drafter of that acceptance rate would give; "
                        "synthetic_0.0: the cost of verifying k drafts, all rejected. "
                        "self_draft_K: the target as its own draft model, K drafts (every one "
                        "accepted: the ceiling of the machinery). eagle3_K: a random EAGLE-3 "
                        "head (one midlayer of the target's widths, mrv2-plugin-eagle; needs "
                        "--load-format dummy), K drafts: the cost of drafting with it. "
                        "lora_idle / lora_1 / lora_4: enable_lora with 4 adapter slots, the "
                        "requests on no adapter / one / four (random adapters of --lora-rank "
                        "on every projection): what serving adapters costs")
    p.add_argument("--lora-rank", type=int, default=16, help="the lora_* variants' rank")
    p.add_argument("--hf-overrides", type=json.loads, default=None, metavar="JSON",
                   help="config.json fields to change, e.g. '{\"num_hidden_layers\": 8}': a "
                        "model too big for the device cut to fewer layers")
    p.add_argument("--json", default=None)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run and print the results."""
    report(bench(args), args.json)
    return 0
