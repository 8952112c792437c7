"""How fast can a kernel *read* HBM in decode attention's access patterns?

The byte floors in BENCHMARKS.md divide by the device-to-device copy bandwidth (~4.1-4.2 TB/s,
bytes read plus written). Decode attention only reads, and Nsight Compute put the bf16 decode
kernel at 3.99 TB/s, "83%" of the DRAM peak. This script asks whether the remaining ~17% is
reachable by any Triton kernel that reads the same bytes the same way, with no arithmetic but a
sum, so that the decode kernel's headroom is known before anything is built for it:

- ``contig``: each program streams a contiguous slab ``[ROWS, 128]`` at a time (the best case);
- ``head``: the cache's layout ``[blocks, 16 slots, kv heads, 128]`` read as the decode kernel
  reads it: a program per (request, kv head), tiles of ``ROWS`` keys gathered through a block
  table (256 contiguous bytes a key, the next key 2 KB further), keys and values;
- ``block``: the same cache read a whole block at a time (every kv head of a slot together:
  32 KB contiguous a block) by a program per (request, eighth of its blocks), keys and values.

Each program adds its tiles into an accumulator of the tile's shape (no reduction across
threads inside the loop; one at the end: the first version reduced every tile and measured
that instead of the bytes). Prints one line per (pattern, tile): µs, TB/s of bytes read.
CUDA only; ``--tiny`` runs small shapes under the interpreter as a smoke check.

What it showed (H200, 2026-12-03, 128 requests x 2,048 keys, 8 kv heads, 1.07 GB): contiguous
reads 4.27-4.50 TB/s, the decode kernel's gather 4.24-4.38 TB/s (``evict_first`` changes
nothing), whole blocks 4.19; ``torch.sum`` 4.17. The bf16 decode kernel reads ~4.1-4.16 TB/s
over a workload-shaped step: ~0.95 of what a read-only kernel reaches in its own pattern.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from functools import partial

if "--tiny" in sys.argv:  # before triton reads it
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _contig(x_ptr, out_ptr, rows_per_prog, ROWS: tl.constexpr, D: tl.constexpr,
            STAGES: tl.constexpr):
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * rows_per_prog * D
    offs = tl.arange(0, ROWS)[:, None] * D + tl.arange(0, D)[None, :]
    acc = tl.zeros([ROWS, D], tl.float32)
    for r in tl.range(0, rows_per_prog, ROWS, num_stages=STAGES):
        acc += tl.load(base + r * D + offs).to(tl.float32)
    tl.store(out_ptr + pid * D + tl.arange(0, D), tl.sum(acc, 0))


@triton.jit
def _head(k_ptr, v_ptr, bt_ptr, out_ptr, seq_len, bt_stride, s_blk, s_slot,
          H: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
          STAGES: tl.constexpr, EVICT: tl.constexpr = ""):
    req = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([ROWS, D], tl.float32)
    for start in tl.range(0, seq_len, ROWS, num_stages=STAGES):
        n = start + tl.arange(0, ROWS)
        blk = tl.load(bt_ptr + req * bt_stride + n // BS).to(tl.int64)
        off = (blk * s_blk + (n % BS) * s_slot + h * D)[:, None] + offs_d[None, :]
        acc += tl.load(k_ptr + off, eviction_policy=EVICT).to(tl.float32)
        acc += tl.load(v_ptr + off, eviction_policy=EVICT).to(tl.float32)
    tl.store(out_ptr + (req * H + h) * D + offs_d, tl.sum(acc, 0))


@triton.jit
def _block(k_ptr, v_ptr, bt_ptr, out_ptr, num_blocks, bt_stride, s_blk,
           ROWS: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr):
    """ROWS = slots x kv heads of one cache block (16 x 8 = 128 rows of D)."""
    req = tl.program_id(0)
    split = tl.program_id(1)
    per = num_blocks // tl.num_programs(1)
    offs = tl.arange(0, ROWS)[:, None] * D + tl.arange(0, D)[None, :]
    acc = tl.zeros([D], tl.float32)
    for i in tl.range(split * per, split * per + per, num_stages=STAGES):
        blk = tl.load(bt_ptr + req * bt_stride + i).to(tl.int64)
        acc += tl.sum(tl.load(k_ptr + blk * s_blk + offs).to(tl.float32), 0)
        acc += tl.sum(tl.load(v_ptr + blk * s_blk + offs).to(tl.float32), 0)
    tl.store(out_ptr + (req * tl.num_programs(1) + split) * D + tl.arange(0, D), acc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--keys", type=int, default=2048)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--tiles", nargs="+", default=["64:2:4", "64:3:4", "64:2:2", "64:3:2",
                                                     "32:4:4", "32:3:2", "128:2:8"],
                    help="ROWS:STAGES:WARPS")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        args.batch, args.keys, args.tiles = 2, 64, ["32:1:4"]
    import torch

    dev = "cpu" if args.tiny else "cuda"
    D, BS, H = 128, 16, args.kv_heads
    nblk = args.keys // BS
    total_blocks = args.batch * nblk
    g = torch.Generator().manual_seed(0)
    k = torch.randn(total_blocks, BS, H, D, generator=g).to(torch.bfloat16).to(dev)
    v = torch.randn(total_blocks, BS, H, D, generator=g).to(torch.bfloat16).to(dev)
    bt = torch.randperm(total_blocks, generator=g).view(args.batch, nblk).to(torch.int32).to(dev)
    nbytes = 2 * k.numel() * k.element_size()
    flat = torch.cat([k.view(-1), v.view(-1)])

    def timed(fn: Callable[[], object]) -> float:
        """µs: the median of graph replays (CUDA), NaN under the interpreter (one call)."""
        if args.tiny:
            fn()
            return float("nan")
        return float(triton.testing.do_bench_cudagraph(fn, rep=100)) * 1e3

    expected = float(flat.float().sum())

    def check(out: torch.Tensor, name: str) -> None:
        """Every block is in one table row once, so the sums must cover the whole cache."""
        got = float(out.sum())
        if abs(got - expected) > 1e-3 * flat.numel() ** 0.5 + 1e-4 * abs(expected):
            raise SystemExit(f"{name}: read sum {got} != the cache's {expected}")

    if not args.tiny:
        dst = torch.empty_like(flat)
        us = timed(lambda: dst.copy_(flat))
        print(f"{'copy (read + write)':24s} {us:9.1f} us {2 * nbytes / us / 1e6:6.2f} TB/s")
        del dst
        us = timed(lambda: flat.sum(dtype=torch.float32))
        print(f"{'torch sum':24s} {us:9.1f} us {nbytes / us / 1e6:6.2f} TB/s")
    for tile in args.tiles:
        rows, stages, warps = (int(x) for x in tile.split(":"))
        rows_total = flat.numel() // D
        progs = 132 * 8
        per = (rows_total // progs) // rows * rows
        out = torch.empty(progs * D, device=dev)
        us = timed(partial(_contig[(progs,)], flat, out, per, ROWS=rows, D=D, STAGES=stages,
                           num_warps=warps))
        read = progs * per * D * 2
        print(f"{'contig ' + tile:24s} {us:9.1f} us {read / us / 1e6:6.2f} TB/s")
        out = torch.empty(args.batch * H * D, device=dev)
        us = timed(partial(
            _head[(args.batch, H)], k, v, bt, out, args.keys, bt.stride(0), k.stride(0),
            k.stride(1), H=H, ROWS=rows, D=D, BS=BS, STAGES=stages, num_warps=warps))
        check(out, "head")
        print(f"{'head ' + tile:24s} {us:9.1f} us {nbytes / us / 1e6:6.2f} TB/s")
        us = timed(partial(
            _head[(args.batch, H)], k, v, bt, out, args.keys, bt.stride(0), k.stride(0),
            k.stride(1), H=H, ROWS=rows, D=D, BS=BS, STAGES=stages, EVICT="evict_first",
            num_warps=warps))
        check(out, "head, evict_first")
        print(f"{'head evict_first ' + tile:24s} {us:9.1f} us {nbytes / us / 1e6:6.2f} TB/s")
    for stages, warps in ((1, 4), (2, 4), (2, 8), (3, 8)):
        if args.tiny and stages > 1:
            break
        splits = 1 if args.tiny else 8
        out = torch.empty(args.batch * splits * D, device=dev)
        us = timed(partial(
            _block[(args.batch, splits)], k, v, bt, out, nblk, bt.stride(0), k.stride(0),
            ROWS=BS * H, D=D, STAGES=stages, num_warps=warps))
        check(out, "block")
        print(f"{f'block 1:{stages}:{warps}':24s} {us:9.1f} us {nbytes / us / 1e6:6.2f} TB/s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
