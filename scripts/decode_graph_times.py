"""Does a larger decode graph ever replay faster than a smaller one?

A decode step of ``B`` requests replays the graph of the smallest captured size ``>= B``
(every 8 up to 256). The linear layers' cost at a size is cuBLAS's kernel choice for that
many rows, which need not grow with the rows: if the graph of 120 replays slower than the
graph of 128, a step of 113-120 requests would be faster padded to 128 (the padding rows have
empty queries: attention reads nothing for them; only the per-row kernels grow).

What it found (H200, BENCHMARKS.md twenty-first session): the skinny kernel at 3-16 rows lost
to what runs at 24 (its limit is now 2 rows); after that fix a few sizes are still beaten by a
larger one (Qwen3-8B 8 by 16, 112-120 by 128; Qwen3-0.6B 16 by 24, 40 by 48). The engine does
not pad past them: a larger graph also bakes another attention plan (fewer splits for more
requests), and at long contexts that costs more than the products gain (Qwen3-0.6B, 16
requests of 3,072-token prompts padded to 24: 2.74 against 2.40 ms a step).

This builds the engine (random weights), then times every captured one-token decode graph's
replay (the forward and the logits, over the capture's dummy batch: contexts of a few tokens,
so it is the step's fixed, row-dependent part) in interleaved passes, and prints, per size,
the replay time, the best time of any size at or above it, and what padding to that size
would save over the throughput workload's decode steps (256 requests of 100-1,024 output
tokens: the step after ``t`` tokens holds the requests with more than ``t`` to go).

Usage (GPU): ``python scripts/decode_graph_times.py --model Qwen3-8B [--passes 5]``; the
table prints last. ``--max-size 64`` captures fewer graphs; ``--skinny-max-m`` /
``--pdl-gemm-max-weight`` / ``--pdl-gemm-min-m`` / ``--norm-gemv-max-m`` change those dispatch
limits for the run (module globals, read at each call); ``--profile 8 16`` lists each of those
graphs' kernels (torch profiler, µs a replay).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch

from mrv2.bench.measure import resolve_model
from mrv2.bench.throughput import workload
from mrv2.config import EngineConfig
from mrv2.engine.engine import LLMEngine
from mrv2_kernels._backend import cuda_event_ms


def workload_batches(num_requests: int = 256) -> list[int]:
    """The throughput workload's decode batch sizes, one per step (``mrv2 bench throughput``'s
    output lengths, every request decoding from the first step)."""
    outs = workload(num_requests)[1]
    return [sum(o > t for o in outs) for t in range(max(outs))]


def profile(graphs: Any, size: int, replays: int = 5) -> None:
    """Each kernel of the ``size`` graph's replay, µs a replay, longest first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graphs.replay(1, size)
        torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        total = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        if total > 0:
            rows.append((total / replays, ev.count // replays, ev.key))
    rows.sort(reverse=True)
    print(f"-- size {size}: kernels, us a replay (calls a replay)")
    for us, calls, name in rows[:14]:
        print(f"   {us:8.1f} ({calls:3d})  {name[:90]}")
    print(f"   {sum(r[0] for r in rows):8.1f} in all")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="Qwen3-0.6B")
    ap.add_argument("--passes", type=int, default=5, help="interleaved passes over the sizes")
    ap.add_argument("--replays", type=int, default=10, help="replays timed per size and pass")
    ap.add_argument("--max-size", type=int, default=256, help="largest decode graph")
    ap.add_argument("--skinny-max-m", type=int, default=None)
    ap.add_argument("--pdl-gemm-max-weight", type=int, default=None)
    ap.add_argument("--pdl-gemm-min-m", type=int, default=None,
                    help="fewest rows the PDL GEMM takes (default 3)")
    ap.add_argument("--norm-gemv-max-m", type=int, default=None,
                    help="most rows the fused norm + GEMV takes (default 2; 1: cuBLAS or the "
                         "PDL GEMM at 2 rows)")
    ap.add_argument("--profile", type=int, nargs="*", default=[], help="sizes to profile")
    args = ap.parse_args()
    import mrv2_kernels.norm_gemv as norm_gemv_mod
    import mrv2_kernels.pdl_gemm as pdl_gemm_mod
    import mrv2_kernels.skinny_gemm as skinny_mod

    if args.skinny_max_m is not None:
        skinny_mod.SKINNY_MAX_M = args.skinny_max_m
    if args.pdl_gemm_max_weight is not None:
        pdl_gemm_mod.PDL_GEMM_MAX_WEIGHT = args.pdl_gemm_max_weight
    if args.norm_gemv_max_m is not None:
        norm_gemv_mod.NORM_GEMV_MAX_M = args.norm_gemv_max_m
    if args.pdl_gemm_min_m is not None:
        pdl_gemm_mod.PDL_GEMM_MIN_M = args.pdl_gemm_min_m
    print(f"SKINNY_MAX_M {skinny_mod.SKINNY_MAX_M}, PDL_GEMM_MAX_WEIGHT "
          f"{pdl_gemm_mod.PDL_GEMM_MAX_WEIGHT}, NORM_GEMV_MAX_M {norm_gemv_mod.NORM_GEMV_MAX_M}")
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=resolve_model(args.model), load_format="dummy", dtype="bfloat16",
        max_model_len=4096, max_num_seqs=args.max_size, max_mixed_graph_tokens=0))
    runner: Any = engine.runner
    graphs = runner.graphs
    sizes = sorted(s for (q, s) in graphs.graphs if q == 1)
    times: dict[int, list[float]] = {s: [] for s in sizes}

    def replays(size: int) -> None:
        for _ in range(args.replays):
            graphs.replay(1, size)

    for _ in range(3):  # warm
        for s in sizes:
            graphs.replay(1, s)
    torch.cuda.synchronize()
    for p in range(args.passes):
        for s in (sizes if p % 2 == 0 else reversed(sizes)):
            times[s].append(cuda_event_ms(functools.partial(replays, s)) / args.replays)
    med = {s: sorted(v)[len(v) // 2] for s, v in times.items()}
    for size in args.profile:
        if size in sizes:
            profile(graphs, size)
    best_above = {}
    for i, s in enumerate(sizes):
        best_above[s] = min((med[t], t) for t in sizes[i:])
    steps = [b for b in workload_batches() if b <= sizes[-1]]
    base = padded = 0.0
    for b in steps:
        s = next(t for t in sizes if t >= b)
        base += med[s]
        padded += best_above[s][0]
    print(f"\n{args.model}: decode graph replay (forward + logits), ms, median of "
          f"{args.passes} passes x {args.replays} replays")
    print(f"{'size':>5} {'ms':>8} {'spread':>7} {'best>=':>8} {'at':>5}")
    for s in sizes:
        spread = max(times[s]) - min(times[s])
        b_ms, b_at = best_above[s]
        mark = " <-" if b_at != s else ""
        print(f"{s:5d} {med[s]:8.3f} {spread:7.3f} {b_ms:8.3f} {b_at:5d}{mark}")
    print(f"workload's {len(steps)} decode steps, fixed part: {base:.1f} ms at the next size, "
          f"{padded:.1f} ms padded to the fastest size at or above ({base - padded:.1f} ms "
          f"less)")


if __name__ == "__main__":
    main()
