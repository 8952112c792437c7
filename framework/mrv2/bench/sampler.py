"""``mrv2 bench sampler``: time of the sampler stage per step at a large batch and vocabulary.

Each mode fills the batch with requests of one kind, runs the engine until the first pure
decode step, and there times the sampler alone on fresh random bf16 logits of
``[batch, vocab]`` (device events, median). The floor is reading those logits once.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from typing import Any

import torch

from mrv2.bench.measure import copy_bandwidth, release_engine_memory, report, resolve_model
from mrv2.config import EngineConfig
from mrv2.contract.params import SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2_kernels._backend import cuda_event_ms

MODES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top_k_top_p": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    "penalties": {"temperature": 0.8, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                  "repetition_penalty": 1.1},
    "logprobs_5": {"temperature": 0.8, "logprobs": 5},
}


class _Timed:
    """The runner's sampler with its call replaced (every other attribute passes through)."""

    def __init__(self, inner: Any, call: Any) -> None:
        self._inner = inner
        self._call = call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)


def time_mode(engine: LLMEngine, batch: int, params: SamplingParams, repeats: int,
              profile: list[str] | None = None) -> float:
    """Median seconds of one sampler call on the first uniform-decode batch of ``batch``.

    With ``profile`` (a list, CUDA only), one more call runs under the torch profiler and the
    device time of its kernels (and of the whole call: launches from the host included) is
    appended to it as text lines."""
    runner = engine.runner
    original = runner.sampler
    timed: list[float] = []

    def sampler(logits: torch.Tensor, step: Any, table: Any, plan: Any = None) -> Any:
        if step.uniform_decode and step.num_reqs == batch and not timed:
            shape = (step.num_reqs, runner.vocab_size)
            inputs = [torch.randn(shape, device=logits.device, dtype=logits.dtype)
                      for _ in range(4)]  # rotate: do not time the L2 cache
            for i in range(repeats):
                if runner.device.type == "cuda":
                    timed.append(cuda_event_ms(
                        functools.partial(original, inputs[i % 4], step, table, plan)) / 1e3)
                else:
                    begin = time.perf_counter()
                    original(inputs[i % 4], step, table, plan)
                    timed.append(time.perf_counter() - begin)
            if profile is not None and runner.device.type == "cuda":
                profile.extend(_profile_call(
                    functools.partial(original, inputs[0], step, table, plan)))
        return original(logits, step, table, plan)

    runner.sampler = _Timed(original, sampler)
    rng = random.Random(0)
    for _ in range(batch):
        engine.add_request([rng.randint(0, 1000) for _ in range(32)], params)
    while engine.has_unfinished():
        engine.step()
    runner.sampler = original
    if not timed:
        raise RuntimeError("no uniform-decode step of the full batch ran")
    timed.sort()
    return timed[len(timed) // 2]


def _profile_call(call: Any) -> list[str]:
    """One ``call()`` under the torch profiler: its kernels' device time (µs, longest first)
    and the call's span between CUDA events."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        span_ms = cuda_event_ms(call)
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time)
    rows = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))
    busy = sum(sum(times) for _, times in rows)
    lines = [f"  span {span_ms * 1e3:.1f} us (events, host launches included), kernels busy "
             f"{busy:.1f} us in {sum(len(t) for _, t in rows)} launches"]
    lines += [f"  {sum(times):9.1f} us  x{len(times):<3d} {name[:90]}" for name, times in rows]
    return lines


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """One row per mode: sampler time per step and its ratio to the logits-read floor."""
    model_dir = resolve_model(args.model)
    results: dict[str, Any] = {"model": args.model, "batch": args.batch}
    floor = None
    for mode in args.modes:
        config = EngineConfig.from_kwargs(
            model=model_dir, load_format="dummy", dtype=args.dtype, max_model_len=256,
            max_num_seqs=args.batch, enforce_eager=True,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
        engine = LLMEngine(config)
        params = SamplingParams(max_tokens=4, ignore_eos=True, seed=1, **MODES[mode])
        time_mode(engine, args.batch, params, repeats=3)  # warm up / compile
        lines: list[str] | None = [] if args.profile else None
        seconds = time_mode(engine, args.batch, params, args.repeats, lines)
        if lines:
            print(f"{mode}:", *lines, sep="\n", flush=True)
        if floor is None:
            item = torch.empty((), dtype=engine.runner.dtype).element_size()
            nbytes = args.batch * engine.runner.vocab_size * item
            results["vocab"] = engine.runner.vocab_size
            if engine.runner.device.type == "cuda":
                floor = nbytes / copy_bandwidth(engine.runner.device)
                results["floor_us"] = round(floor * 1e6, 1)
        row = {"us": round(seconds * 1e6, 1)}
        if floor:
            row["over_floor"] = round(seconds / floor, 2)
        results[mode] = row
        del engine
        release_engine_memory()
    return results


def add_parser(sub: Any) -> None:
    """Register ``mrv2 bench sampler``."""
    p = sub.add_parser("sampler", help="sampler time per step at batch 256 x vocab 151,936")
    p.add_argument("--model", default="Qwen3-0.6B")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--profile", action="store_true",
                   help="also print each mode's kernels (torch profiler, one call; CUDA)")
    p.add_argument("--json", default=None)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run and print the results."""
    report(bench(args), args.json)
    return 0
