"""The top-k / top-p sampling tail as the decode graph runs it: the filter's thresholds
(:func:`~mrv2_kernels.top_k_top_p.top_k_top_p_keys`) and the Gumbel sampling kernel that
applies them, against that kernel alone (temperature only).

    python -m mrv2_kernels.bench_top_k_top_p [--rows 1 8 64 256] [--chunks 2048 8192]
        [--pivot-blocks 128 256] [--dtype bfloat16] [--kernels]

Each case is captured once in a CUDA graph and replayed (µs per replay, median); the logits are
random normal (``--std``) over Qwen3's 151,936-token vocabulary, divided by temperature 0.6 in
the kernels, as the sampler passes them. ``--chunks`` / ``--pivot-blocks`` time the filter
with other vocabulary slices per program / pivot tiles (0: the module's default);
``--kernels`` adds, per case, each kernel's
device time inside the graph (torch profiler over one replay). The table prints last.
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch

from mrv2_kernels.bench_skinny import time_graph
from mrv2_kernels.gumbel import gumbel_sample
from mrv2_kernels.top_k_top_p import top_k_top_p_keys

#: (name, top_k, top_p): Qwen3's generation defaults, a common pair, top-p alone.
PARAMS = [("k20 p0.95", 20, 0.95), ("k50 p0.9", 50, 0.9), ("p0.95", 0, 0.95)]
VOCAB = 151936


def _tail(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None,
          t: torch.Tensor, seeds: torch.Tensor, greedy: torch.Tensor, out: torch.Tensor,
          tiles: dict[str, int], _: int) -> torch.Tensor:
    cut = None
    if k is not None and p is not None:
        cut = top_k_top_p_keys(logits, k, p, t, **tiles)
    gumbel_sample(logits, seeds, seeds, greedy, out, t, cut)
    return out


def _kernel_times(fn: functools.partial) -> str:
    """Each kernel's device µs in one graph replay of ``fn``, longest first."""
    from torch.profiler import ProfilerActivity, profile

    fn(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(0)
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.name] = times.get(e.name, 0.0) + e.device_time
    return ", ".join(f"{n.strip('_')} {us:.1f}" for n, us in
                     sorted(times.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--chunks", type=int, nargs="+", default=[0],
                    help="vocabulary slice per program; 0 = the module's default")
    ap.add_argument("--pivot-blocks", type=int, nargs="+", default=[0],
                    help="values per pivot-pass tile; 0 = the module's default")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--std", type=float, default=1.0)
    ap.add_argument("--kernels", action="store_true")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    lines = []
    for rows in args.rows:
        g = torch.Generator(device="cuda").manual_seed(rows)
        logits = (torch.randn(rows, VOCAB, device="cuda", generator=g) * args.std).to(dtype)
        t = torch.full((rows,), 0.6, device="cuda")
        seeds = torch.arange(rows, device="cuda", dtype=torch.int64)
        greedy = torch.zeros(rows, dtype=torch.bool, device="cuda")
        out = torch.empty(rows, dtype=torch.int64, device="cuda")
        base = time_graph(functools.partial(_tail, logits, None, None, t, seeds, greedy, out,
                                            {}), 1)
        lines.append(f"{rows:5d}  {'temperature':11s} {'-':>6s} {'-':>6s} {base:8.1f} "
                     f"{0.0:9.1f}")
        for name, k, p in PARAMS:
            tk = torch.full((rows,), k, device="cuda", dtype=torch.int64)
            tp = torch.full((rows,), p, device="cuda")
            for chunk, pb in itertools.product(args.chunks, args.pivot_blocks):
                tiles = {key: v for key, v in (("chunk", chunk), ("pivot_block", pb)) if v}
                fn = functools.partial(_tail, logits, tk, tp, t, seeds, greedy, out, tiles)
                us = time_graph(fn, 1)
                lines.append(f"{rows:5d}  {name:11s} {chunk or 'def':>6} {pb or 'def':>6} "
                             f"{us:8.1f} {us - base:9.1f}")
                if args.kernels:
                    lines.append(f"       kernels: {_kernel_times(fn)}")
    print(f" rows  params       chunk  pivot  tail_us filter_us  ({args.dtype}, std {args.std})")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
