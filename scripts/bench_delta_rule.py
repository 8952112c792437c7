"""Time the gated delta rule's token-serial kernel against the chunked one on prefill-shaped
steps (Qwen3-Next-80B's Gated DeltaNet per rank: 16 key heads, 32 value heads of 128; the
Mamba-2 form at Nemotron-H-8B's sizes), each checked against the other first.

Usage (GPU machine): python scripts/bench_delta_rule.py [--tp 1]
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch

from mrv2_kernels.chunk_delta_rule import chunk_gated_delta_rule_triton
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1, help="heads divided by this (a rank's)")
    args = parser.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"{'case':34s} {'tokens':>7s} {'serial ms':>10s} {'chunked ms':>11s} {'speed-up':>9s}"
          f" {'max err':>9s}")
    # (name, key heads, v heads, K, V, delta, l2norm, per-sequence lengths)
    cases = [
        ("qwen3-next 1 x 4096", 16, 32, 128, 128, True, True, [4096]),
        ("qwen3-next 8 x 512", 16, 32, 128, 128, True, True, [512] * 8),
        ("qwen3-next 1 x 512 + 63 decodes", 16, 32, 128, 128, True, True, [512] + [1] * 63),
        ("qwen3-next 1 x 64", 16, 32, 128, 128, True, True, [64]),
        ("mamba2 (nemotron-h 8b) 1 x 4096", 8, 128, 128, 64, False, False, [4096]),
    ]
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
        o2 = chunk_gated_delta_rule_triton(q, k, v, g, beta, s2, *meta, delta=delta)
        err = float((o1.float() - o2.float()).abs().max())
        # (every sequence starts at 0: the kernels ignore what the rows hold)
        serial = timed(functools.partial(gated_delta_rule_triton, q, k, v, g, beta, s1, *meta,
                                         delta=delta))
        chunked = timed(functools.partial(chunk_gated_delta_rule_triton, q, k, v, g, beta, s2,
                                          *meta, delta=delta))
        print(f"{name:34s} {t:7d} {serial:10.3f} {chunked:11.3f} {serial / chunked:8.1f}x"
              f" {err:9.2e}")


if __name__ == "__main__":
    main()
