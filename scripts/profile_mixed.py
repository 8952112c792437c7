"""Profile the throughput workload's mixed steps on the GPU: steps that prefill new prompts
(lengths drawn like ``mrv2 bench throughput``'s, 100-1,024 tokens, as many as fill
``max_num_batched_tokens``) next to ``--decoding`` requests already decoding.

Prints the time a step back to back (the prompts' generation included, ~5 ms a step), the
host's phases (schedule, execute and the model forward in it, process), with
``--host-modules`` the host's own time in each module class's forward (the GPU runs behind,
so that is Python and launch cost), with ``--cprofile`` the Python profile, and last the GPU
time by kernel under the torch profiler (each step synchronized there). Each call adds
~14 requests a step: keep ``--decoding`` + 14 x (4 x ``--steps`` + 2) under ``max_num_seqs``
(256), or the last steps prefill nothing.

Usage (GPU machine): python scripts/profile_mixed.py [--model Qwen3-0.6B] [--decoding 16]
[--steps 3] [--host-modules] [--cprofile] [--trace DIR]
"""

import argparse
import os
import random
import time

import torch

from mrv2.bench.measure import resolve_model, time_host_parts
from mrv2.config import EngineConfig
from mrv2.contract.params import SamplingParams
from mrv2.engine.engine import LLMEngine
from mrv2.model_loader.build import text_config_of

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="Qwen3-0.6B", help="bundled config name or checkpoint")
parser.add_argument("--decoding", type=int, default=16, help="requests decoding beside prefills")
parser.add_argument("--steps", type=int, default=3, help="mixed steps profiled")
parser.add_argument("--max-num-batched-tokens", type=int, default=None)
parser.add_argument("--max-model-len", type=int, default=4096)
parser.add_argument("--max-mixed-graph-tokens", type=int, default=None,
                    help="the engine's cap on mixed steps in CUDA graphs (0: eager)")
parser.add_argument("--prompt-lens", type=int, nargs=2, default=(100, 1024), metavar=("LO", "HI"))
parser.add_argument("--trace", default=None, help="folder for a Chrome trace")
parser.add_argument("--cprofile", action="store_true",
                    help="also print the host's Python profile of the mixed steps")
parser.add_argument("--host-modules", action="store_true",
                    help="also time the host in each module's forward (hooks; the GPU runs "
                         "behind, so this is Python and launch cost), by module class")
args = parser.parse_args()

engine = LLMEngine(EngineConfig.from_kwargs(
    model=resolve_model(args.model), load_format="dummy", dtype="bfloat16",
    max_model_len=args.max_model_len,
    max_num_seqs=256, **({"max_num_batched_tokens": args.max_num_batched_tokens}
                         if args.max_num_batched_tokens else {}),
    **({"max_mixed_graph_tokens": args.max_mixed_graph_tokens}
       if args.max_mixed_graph_tokens is not None else {})))
def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


budget = engine.config.scheduler.max_num_batched_tokens
rng = random.Random(0)
params = SamplingParams(temperature=0.6, max_tokens=args.max_model_len - args.prompt_lens[1],
                        ignore_eos=True)
vocab = min(10000, text_config_of(engine.runner.hf_config).vocab_size)


def prompt() -> list[int]:
    return [rng.randint(0, vocab - 1) for _ in range(rng.randint(*args.prompt_lens))]


def add_prefills(tokens: int) -> None:
    """Prompts until ``tokens`` prompt tokens are waiting (the last one may be chunked)."""
    while tokens > 0:
        p = prompt()
        engine.add_request(p, params)
        tokens -= len(p)


for _ in range(args.decoding):
    engine.add_request(prompt(), params)
for _ in range(8):  # prefill the decoding requests, compile, warm up
    engine.step()
for _ in range(2):  # warm the mixed shapes up too
    add_prefills(budget)
    engine.step()
    engine.step()
sync()


def mixed_steps() -> float:
    """``args.steps`` mixed steps back to back (not synchronized); seconds a step."""
    sync()
    begin = time.perf_counter()
    for _ in range(args.steps):
        add_prefills(budget)
        engine.step()
    sync()
    return (time.perf_counter() - begin) / args.steps


unsynced = mixed_steps()
# the host's phases of a mixed step (the GPU runs behind: Python and launch cost)
phases: dict[str, float] = {}


restore = time_host_parts({attr: (owner, attr) for owner, attr in (
    (engine.scheduler, "schedule"), (engine.runner, "execute"), (engine.runner, "_forward"),
    (engine, "_process"))}, phases)
phased = mixed_steps()
restore()
print(f"host phases, ms a mixed step ({phased * 1e3:.2f} ms a step): "
      + ", ".join(f"{k} {v / args.steps * 1e3:.2f}" for k, v in phases.items()))
if args.cprofile:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    mixed_steps()
    profiler.disable()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)

if args.host_modules:
    from collections import defaultdict

    own: dict[str, float] = defaultdict(float)  # host seconds by class, children excluded
    stack: list[list[float]] = []  # [start, children's seconds] of the open forwards

    def pre(module: torch.nn.Module, _inputs: object) -> None:
        stack.append([time.perf_counter(), 0.0])

    def post(module: torch.nn.Module, _inputs: object, _output: object) -> None:
        start, children = stack.pop()
        total = time.perf_counter() - start
        own[type(module).__name__] += total - children
        if stack:
            stack[-1][1] += total

    handles = []
    for module in engine.runner.model.modules():
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    hooked = mixed_steps()
    for h in handles:
        h.remove()
    print(f"host by module class (own time, ms a mixed step; {hooked * 1e3:.2f} ms a step "
          f"with the hooks):")
    for name, sec in sorted(own.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {name:32s} {sec / args.steps * 1e3:8.3f}")

host = []
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                        torch.profiler.ProfilerActivity.CPU]) as prof:
    for _ in range(args.steps):
        add_prefills(budget)
        begin = time.perf_counter()
        engine.step()
        host.append(time.perf_counter() - begin)
        sync()
if args.trace:
    prof.export_chrome_trace(os.path.join(args.trace, f"mixed_{args.model}.json"))
kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
n = args.steps
if not kernels:
    raise SystemExit("no CUDA kernels profiled (this script needs a GPU)")
span = kernels[-1].time_range.end - kernels[0].time_range.start
busy = sum(e.time_range.end - e.time_range.start for e in kernels)
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=28, max_name_column_width=60))
print(f"{args.model}, {budget} tokens a step, {args.decoding} decoding: back to back "
      f"{unsynced * 1e3:.2f} ms/step; under the profiler: host "
      f"{sum(host) / n * 1e3:.2f} ms/step (steps synchronized), GPU span {span / n / 1e3:.2f} ms, "
      f"busy {busy / n / 1e3:.2f} ms, {len(kernels) / n:.0f} kernels/step")
engine.shutdown()
