"""Time the gated delta rule's token-serial kernel against the chunked one on prefill-shaped
steps (Qwen3-Next-80B's Gated DeltaNet per rank: 16 key heads, 32 value heads of 128; the
Mamba-2 form at Nemotron-H-8B's sizes), each checked against the other first.

Usage (GPU machine): python scripts/bench_delta_rule.py [--tp 1] [--profile]
    [--variant PREC,WARPS,BLOCK_V,STAGES] [--case NAME] [--serial-below N] [--graph]

``--variant`` also times the chunked kernel with those launch options (the products'
precision, the state scan's warps, V block and stages) on the Qwen3-Next cases, with its error
against the token-serial kernel (a process per variant: a fault stays its own);
``--profile`` prints each chunked kernel's device time per call; ``--graph`` also times each
form replayed in a CUDA graph (the device time alone: an eager call of a short prompt is
bound by its launches) and the host time of an eager call (launching, no sync).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from mrv2_kernels.chunk_delta_rule import CHUNKED_SERIAL_BELOW, chunk_gated_delta_rule_triton
from mrv2_kernels.linear_attention import gated_delta_rule_triton


def timed(fn: Callable[[], object], reps: int = 20) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs (CUDA events)."""
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[3:])[len(times[3:]) // 2]


def timed_graph(fn: Callable[[], object], reps: int = 20) -> float:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm: compiled before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed(graph.replay, reps)


def host_us(fn: Callable[[], object], reps: int = 20) -> float:
    """Median host microseconds of an eager call of ``fn`` (from an idle device, no sync)."""
    times = []
    for _ in range(reps + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return sorted(times[3:])[len(times[3:]) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1, help="heads divided by this (a rank's)")
    parser.add_argument("--variant", default=None, metavar="PREC,WARPS,BLOCK_V,STAGES",
                        help="also time the chunked kernel with these launch options")
    parser.add_argument("--profile", action="store_true", help="device time by kernel")
    parser.add_argument("--graph", action="store_true",
                        help="also each form's time in a CUDA graph and an eager call's host time")
    parser.add_argument("--case", default=None, help="only the cases whose name has this")
    parser.add_argument("--serial-below", type=int, default=CHUNKED_SERIAL_BELOW,
                        help="sequences of fewer tokens token-serial in a chunked step "
                             "(0: every sequence chunked)")
    args = parser.parse_args()
    # the chunked op as the engine runs it (gated_delta_rule_auto: a step's sequences of fewer
    # than CHUNKED_SERIAL_BELOW tokens token-serial), unless --serial-below says otherwise
    chunked_op = functools.partial(chunk_gated_delta_rule_triton, serial_below=args.serial_below)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"{'case':34s} {'tokens':>7s} {'serial ms':>10s} {'chunked ms':>11s} {'speed-up':>9s}"
          f" {'max err':>9s}")
    # (name, key heads, v heads, K, V, delta, l2norm, per-sequence lengths)
    cases = [
        ("qwen3-next 1 x 4096", 16, 32, 128, 128, True, True, [4096]),
        ("qwen3-next 8 x 512", 16, 32, 128, 128, True, True, [512] * 8),
        ("qwen3-next 1 x 512 + 63 decodes", 16, 32, 128, 128, True, True, [512] + [1] * 63),
        ("qwen3-next 1 x 512 + 8 x 12", 16, 32, 128, 128, True, True, [512] + [12] * 8),
        ("qwen3-next 1 x 32", 16, 32, 128, 128, True, True, [32]),
        ("qwen3-next 1 x 64", 16, 32, 128, 128, True, True, [64]),
        ("qwen3-next 1 x 128", 16, 32, 128, 128, True, True, [128]),
        ("qwen3-next 1 x 256", 16, 32, 128, 128, True, True, [256]),
        ("mamba2 (nemotron-h 8b) 1 x 4096", 8, 128, 128, 64, False, False, [4096]),
        ("mamba2 (nemotron-h 8b) 1 x 16", 8, 128, 128, 64, False, False, [16]),
        ("mamba2 (nemotron-h 8b) 1 x 32", 8, 128, 128, 64, False, False, [32]),
        ("mamba2 (nemotron-h 8b) 1 x 128", 8, 128, 128, 64, False, False, [128]),
    ]
    if args.variant:  # the variant on the Qwen3-Next prompts alone, nothing else timed
        cases = [case for case in cases if case[5] and len(case[7]) <= 8]
    cases = [case for case in cases if args.case is None or args.case in case[0]]
    for name, hk, hv, dk, dv, delta, l2, lens in cases:
        hk, hv = max(1, hk // args.tp), max(1, hv // args.tp)
        n, t = len(lens), sum(lens)
        q = torch.randn(t, hk, dk, device=dev, dtype=torch.bfloat16, generator=gen)
        k = torch.randn(t, hk, dk, device=dev, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(t, hv, dv, device=dev, dtype=torch.bfloat16, generator=gen)
        g = -(torch.rand(t, hv, device=dev, generator=gen) * 0.1 + 0.001)
        beta = torch.rand(t, hv, device=dev, generator=gen).to(torch.bfloat16)
        if not l2:
            q, k = q * 0.1, k * 0.1
        qsl = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        qsl[1:] = torch.tensor(lens, device=dev).cumsum(0)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        rows = torch.arange(n, dtype=torch.int32, device=dev)
        state0 = torch.zeros(n, hv, dk, dv, device=dev)
        meta = (qsl, seq_lens, rows, dk ** -0.5, l2)
        s1, s2 = state0.clone(), state0.clone()
        o1 = gated_delta_rule_triton(q, k, v, g, beta, s1, *meta, delta=delta)
        if args.variant:
            variant(chunked_op, args.variant, name, o1, q, k, v, g, beta, s2, meta)
            continue
        o2 = chunked_op(q, k, v, g, beta, s2, *meta, delta=delta)
        err = float((o1.float() - o2.float()).abs().max())
        # (every sequence starts at 0: the kernels ignore what the rows hold)
        serial = timed(functools.partial(gated_delta_rule_triton, q, k, v, g, beta, s1, *meta,
                                         delta=delta))
        chunked = timed(functools.partial(chunked_op, q, k, v, g, beta, s2, *meta, delta=delta))
        print(f"{name:34s} {t:7d} {serial:10.3f} {chunked:11.3f} {serial / chunked:8.1f}x"
              f" {err:9.2e}")
        if args.graph:
            forms = (functools.partial(gated_delta_rule_triton, q, k, v, g, beta, s1, *meta,
                                       delta=delta),
                     functools.partial(chunked_op, q, k, v, g, beta, s2, *meta, delta=delta))
            graphed = [timed_graph(fn) for fn in forms]
            host = [host_us(fn) for fn in forms]
            print(f"  in a CUDA graph: serial {graphed[0]:.3f} ms, chunked {graphed[1]:.3f} ms "
                  f"({graphed[0] / graphed[1]:.1f}x); host per eager call: serial "
                  f"{host[0]:.0f} us, chunked {host[1]:.0f} us")
        if args.profile:
            profile(functools.partial(chunked_op, q, k, v, g, beta, s2, *meta, delta=delta))


def variant(op: Callable[..., torch.Tensor], spec: str, name: str, want: torch.Tensor,
            *inputs: Any) -> None:
    """Times the chunked kernel with the launch options ``spec`` (``PREC,WARPS,BLOCK_V,STAGES``)
    on ``inputs`` (q, k, v, g, beta, state, meta) and prints its error against ``want``."""
    q, k, v, g, beta, state, meta = inputs
    prec, warps, bv, stages = spec.split(",")
    opts: dict[str, Any] = dict(dot_precision=prec, scan_warps=int(warps), block_v=int(bv),
                                scan_stages=int(stages))
    got = op(q, k, v, g, beta, state.clone(), *meta, **opts)
    err = float((want.float() - got.float()).abs().max())
    ms = timed(functools.partial(op, q, k, v, g, beta, state, *meta, **opts))
    print(f"  variant {name:24s} {prec:6s} warps {warps} block_v {bv:2s} stages {stages}: "
          f"{ms:8.3f} ms  max err {err:9.2e}")


def profile(fn: Callable[[], object]) -> None:
    """Device microseconds per call of each kernel ``fn`` launches (torch profiler, 10 calls)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    for evt in prof.key_averages():
        if evt.device_type.name == "CUDA" and evt.count:
            total = getattr(evt, "device_time_total", 0.0) or getattr(evt, "cuda_time_total", 0.0)
            print(f"  kernel {evt.key[:40]:40s} {total / 10:10.1f} us a call")


if __name__ == "__main__":
    main()
