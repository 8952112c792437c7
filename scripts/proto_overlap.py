"""Prototype (H200): does a large decode step get faster when its batch runs as two halves on
two streams, so one half's attention (bound by the KV bytes it reads) overlaps the other
half's linear layers and small kernels (bound by launch and ramp, not bytes)?

A Qwen3-0.6B decode step of 128 requests spends 73% of its 4.16 ms in attention, at ~0.95 of
the read ceiling, and most of the rest in GEMMs that move a third of the bytes their time
would allow and in ~2 µs kernels (BENCHMARKS.md, sixteenth session). Attention cannot get
faster; the rest could hide under it. Splitting the batch doubles the weights read (each half
reads them), which is cheap beside the KV on a small model and costly on a large one.

Each variant runs ``layers`` decoder layers in one CUDA graph, each layer with its own weights
and its own KV cache region (random bf16; context lengths drawn uniformly from the workload's
range). The layer is the engine's decode chain without RoPE / QK-norm: ``rms_norm`` (residual
fused) -> qkv (cuBLAS) -> ``paged_attention`` (the engine's decode plan) -> o -> ``rms_norm``
-> gate/up -> ``silu_and_mul`` -> down. Variants:

- ``serial``: the whole batch, one stream (the engine today);
- ``halves``: two halves one after the other on one stream (what splitting costs alone);
- ``overlap``: the two halves as independent chains on two streams, forked and joined once per
  step inside the graph (the best case: no per-layer synchronization);
- ``overlap_skew``: the same, the second half started after the first's first layer's
  attention has been launched (a prologue that offsets the chains, so their attention phases
  alternate rather than coincide).

Usage: ``python scripts/proto_overlap.py [--models 0.6B 8B] [--batches 64 128 256]`` on a GPU
(table last: ms per step, and the KV + weight bytes' floor at ``--bandwidth``); ``--check``
on a GPU: the variants' outputs agree (see :func:`check`).
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: name -> (hidden, query heads, kv heads, head_dim, intermediate, layers)
MODELS = {"0.6B": (1024, 16, 8, 128, 3072, 28), "8B": (4096, 32, 8, 128, 12288, 36)}
BLOCK = 16
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class Layer:
    """One decoder layer's weights and KV cache."""

    qkv: torch.Tensor
    o: torch.Tensor
    gu: torch.Tensor
    down: torch.Tensor
    n1: torch.Tensor
    n2: torch.Tensor
    kv: torch.Tensor


@dataclass
class Half:
    """The attention metadata of a slice of the batch's requests."""

    qsl: torch.Tensor
    seq_lens: torch.Tensor
    table: torch.Tensor
    rows: int
    max_seq: int


def build(name: str, batch: int, layers: int, lo: int, hi: int, seed: int = 0
          ) -> tuple[list[Layer], list[int], torch.Tensor]:
    """Weights, KV caches, the requests' context lengths and the block table."""
    hidden, heads, kv_heads, d, inter, _ = MODELS[name]
    dev, dt = DEVICE, torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (batch,), generator=g).tolist()
    per_req = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(per_req) + 1
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(batch, max(per_req), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_req):
        table[i, :n] = perm[used:used + n]
        used += n
    gd = torch.Generator(device=dev).manual_seed(seed)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, device=dev, generator=gd) / k**0.5).to(dt)

    out = []
    for _ in range(layers):
        kv = torch.empty(2, num_blocks, BLOCK, kv_heads, d, device=dev, dtype=dt)
        kv.normal_(generator=gd)
        out.append(Layer(weight((heads + 2 * kv_heads) * d, hidden), weight(hidden, heads * d),
                         weight(2 * inter, hidden), weight(hidden, inter),
                         torch.rand(hidden, device=dev, generator=gd).to(dt) + 0.5,
                         torch.rand(hidden, device=dev, generator=gd).to(dt) + 0.5, kv))
    return out, lens, table.to(dev)


def half_of(lens: list[int], table: torch.Tensor, start: int, stop: int) -> Half:
    """The metadata of requests ``start:stop``."""
    dev = table.device
    n = stop - start
    return Half(torch.arange(n + 1, dtype=torch.int32, device=dev),
                torch.tensor(lens[start:stop], dtype=torch.int32, device=dev),
                table[start:stop].contiguous(), n, max(lens[start:stop]))


def chain(name: str, ws: list[Layer], half: Half
          ) -> Callable[[int, int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``run(first, last, x, res)``: layers ``first:last`` of one half's decode chain."""
    from mrv2_kernels.norm import rms_norm, silu_and_mul
    from mrv2_kernels.paged_attention import paged_attention

    _, heads, kv_heads, d, _, _ = MODELS[name]
    scale = d**-0.5

    def run(first: int, last: int, x: torch.Tensor, res: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        for w in ws[first:last]:
            h, res = rms_norm(x, w.n1, 1e-6, res)
            qkv = F.linear(h, w.qkv)
            q = qkv[:, :heads * d].view(half.rows, heads, d)
            attn = paged_attention(q, w.kv, half.qsl, half.seq_lens, half.table, scale,
                                   max_query_len=1, max_seq_len=4096, num_reqs=half.rows,
                                   uniform_decode=True)
            o = F.linear(attn.reshape(half.rows, heads * d), w.o)
            h2, res = rms_norm(o, w.n2, 1e-6, res)
            x = F.linear(silu_and_mul(F.linear(h2, w.gu)), w.down)
        return x, res

    return run


def graph_ms(fn: Callable[[], torch.Tensor], repeats: int = 10) -> float:
    """Median ms of a replay of a CUDA graph of ``fn()`` (the kernel benches' timer)."""
    from mrv2_kernels.bench_skinny import time_graph

    return time_graph(lambda _: fn(), 1, repeats=repeats) / 1e3


def variants(name: str, ws: list[Layer], lens: list[int], table: torch.Tensor
             ) -> dict[str, Callable[[], torch.Tensor]]:
    """Each variant's step (see the module doc); each returns the step's hidden state."""
    hidden = MODELS[name][0]
    batch, n = len(lens), len(ws)
    g = torch.Generator(device=DEVICE).manual_seed(1)
    x0 = torch.randn(batch, hidden, device=DEVICE, generator=g).to(ws[0].n1.dtype)
    r0 = torch.randn(batch, hidden, device=DEVICE, generator=g).to(ws[0].n1.dtype)
    mid = batch // 2
    whole = chain(name, ws, half_of(lens, table, 0, batch))
    a = chain(name, ws, half_of(lens, table, 0, mid))
    b = chain(name, ws, half_of(lens, table, mid, batch))
    cuda = DEVICE.type == "cuda"
    side = torch.cuda.Stream() if cuda else None

    def serial() -> torch.Tensor:
        return whole(0, n, x0, r0)[0]

    def halves() -> torch.Tensor:
        return torch.cat([a(0, n, x0[:mid], r0[:mid])[0], b(0, n, x0[mid:], r0[mid:])[0]])

    def overlap(skew: int = 0) -> torch.Tensor:
        xa, ra = a(0, skew, x0[:mid], r0[:mid])
        if side is None:  # the CPU (--check under the interpreter): one stream
            xb, _ = b(0, n, x0[mid:], r0[mid:])
            return torch.cat([a(skew, n, xa, ra)[0], xb])
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            xb, _ = b(0, n, x0[mid:], r0[mid:])
        xa, _ = a(skew, n, xa, ra)
        main.wait_stream(side)
        return torch.cat([xa, xb])

    return {"serial": serial, "halves": halves, "overlap": overlap,
            "overlap_skew": lambda: overlap(1)}


def floor_ms(name: str, lens: list[int], halves: bool, bandwidth: float) -> float:
    """Bytes of the step (KV read once, weights once or twice) over ``bandwidth`` TB/s."""
    hidden, heads, kv_heads, d, inter, layers = MODELS[name]
    weights = 2 * ((heads + 2 * kv_heads) * d * hidden + heads * d * hidden + 3 * inter * hidden)
    kv = 2 * 2 * kv_heads * d * sum(lens)
    return layers * ((2 if halves else 1) * weights + kv) / (bandwidth * 1e12) * 1e3


def check(name: str, batch: int) -> str:
    """The variants' outputs agree within bf16 (two layers). Bits may differ: on the H200 the
    second stream's half did not give the one-stream half's bits (cuBLAS may pick another
    kernel for a stream of its own), so the check is on values."""
    ws, lens, table = build(name, batch, 2, 50, 400)
    v = variants(name, ws, lens, table)
    out = {k: f().float() for k, f in v.items()}
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
    scale = out["halves"].abs().max().item()
    errs = {k: (out[k] - out["halves"]).abs().max().item() for k in out if k != "halves"}
    for key, err in errs.items():
        assert err <= 0.05 * scale, f"{key} against halves: {err} of {scale}"
    same = [k for k in out if k != "halves" and torch.equal(out[k], out["halves"])]
    return (f"check {name} {batch}: largest difference from halves "
            + ", ".join(f"{k} {e:.3g}" for k, e in errs.items())
            + f" (of {scale:.3g}); bit-identical: {same or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["0.6B", "8B"], choices=list(MODELS))
    parser.add_argument("--batches", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--context", nargs=2, type=int, default=[200, 1600],
                        help="context lengths drawn uniformly from this range")
    parser.add_argument("--layers", type=int, default=0, help="0: the model's")
    parser.add_argument("--bandwidth", type=float, default=4.18, help="TB/s, the floor's")
    parser.add_argument("--check", action="store_true", help="outputs only (see check)")
    args = parser.parse_args()
    if args.check:
        for name in args.models:
            print(check(name, 16))
        return
    rows = []
    for name, batch in itertools.product(args.models, args.batches):
        layers = args.layers or MODELS[name][5]
        ws, lens, table = build(name, batch, layers, *args.context)
        v = variants(name, ws, lens, table)
        times = {key: graph_ms(fn) for key, fn in v.items()}
        fl1, fl2 = (floor_ms(name, lens, h, args.bandwidth) * layers / MODELS[name][5]
                    for h in (False, True))
        line = (f"{name:5s} {batch:4d} " + " ".join(f"{times[k]:8.3f}" for k in v)
                + f"  {fl1:7.3f} {fl2:7.3f}")
        print(line, flush=True)
        rows.append(line)
        del ws, v
        torch.cuda.empty_cache()
    print(f"\nmodel batch {'serial':>8s} {'halves':>8s} {'overlap':>8s} {'ov_skew':>8s}"
          f"  floor1  floor2   (ms per step; floors: KV + weights once / twice)")
    for line in rows:
        print(line)


if __name__ == "__main__":
    main()
