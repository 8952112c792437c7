"""Micro-benchmark of the Triton paged attention (decode and prefill), for an H100/H200.

    python -m mrv2_kernels.bench_attention            # the tables (Qwen3-0.6B and -8B heads)
    python -m mrv2_kernels.bench_attention --sweep    # also try tile/stage/split variants
    python -m mrv2_kernels.bench_attention --workload # the throughput workload's decode steps
    TRITON_INTERPRET=1 python -m mrv2_kernels.bench_attention --tiny   # CPU smoke test

Decode: batch {1, 8, 32, 64, 128, 256} x context {256, 512, 1024, 2048, 4096}, one query token per
request, head_dim 128, block size 16, random non-contiguous block ids, for the 0.6B head layout
(16 query heads over 8 KV heads) and the 8B one (32 over 8). Prefill: 4 requests x 1024 new
tokens (no earlier context), causal TFLOP/s, for both layouts.

Timing is device time as a decode step sees it: each case's calls are captured in one CUDA
graph (no Python launch cost; a launch-bound ``do_bench`` read ~40 us for any small case), over
enough distinct KV caches (>= 256 MiB per replay) that the keys come from HBM, not L2, as in a
model where every layer reads its own cache. GB/s counts the K and V bytes a call must read,
against ~4.8 TB/s peak on an H200. Outputs are checked against ``paged_attention_ref`` on a few
cases first (exit code 1 on a mismatch).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Shapes:
    layouts: tuple[tuple[str, int, int], ...]
    """``(name, query heads, kv heads)``."""
    head_dim: int
    block_size: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_batch: int
    prefill_len: int


FULL = Shapes((("0.6B", 16, 8), ("8B", 32, 8)), 128, 16, (1, 8, 32, 64, 128, 256),
              (256, 512, 1024, 2048, 4096), 4, 1024)
TINY = Shapes((("tiny", 4, 2),), 16, 4, (1, 3), (24, 40), 2, 20)
#: Decode (batch, context) cases the sweep tries variants on: the throughput workload's steps
#: (many short sequences early, fewer and longer ones later).
SWEEP_CASES = ((8, 2048), (8, 4096), (32, 1024), (32, 2048), (64, 256), (128, 512),
               (128, 1024), (256, 256))
_KV_BYTES_PER_REPLAY = 256 << 20
_MAX_COPIES = 64


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes under the Triton interpreter")
    p.add_argument("--sweep", action="store_true", help="try block/stage/split/warp variants")
    p.add_argument("--layouts", nargs="*", default=None, help="only these head layouts (8B)")
    p.add_argument("--no-decode", action="store_true", help="prefill only")
    p.add_argument("--tiles-last", action="store_true",
                   help="prefill grids with the query-tile axis slowest, beside the default")
    p.add_argument("--mixed-tiles", action="store_true",
                   help="also time a few prefill tiles on the 4 x 1,024 prefill and the mixed "
                        "step")
    p.add_argument("--workload", action="store_true",
                   help="only the throughput workload's decode steps: request order and splits")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8"],
                   help="KV cache element type: the query's (bf16) or fp8 (e4m3)")
    p.add_argument("--decode-warps", type=int, default=None,
                   help="warps of the decode grid's launches (default: the plan's)")
    p.add_argument("--workload-tiles", nargs="+", default=None, metavar="BN:STAGES:WARPS",
                   help="with --workload: time these decode tiles instead (longest first, the "
                        "plan's splits), e.g. 64:2:4 128:3:8")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads the variable when kernels are defined (the package may already have
        # imported some): start again with it set.
        env = dict(os.environ, TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "mrv2_kernels.bench_attention", *(argv or sys.argv[1:])]
        os.execve(sys.executable, cmd, env)
    import torch

    from mrv2_kernels.paged_attention import attention_plan, paged_attention, paged_attention_ref

    shapes = TINY if args.tiny else FULL
    if args.tiny:
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --tiny (and TRITON_INTERPRET=1) for a CPU smoke test")
            return 2
        device = torch.device("cuda")
    dtype = torch.bfloat16
    fp8 = args.kv_dtype == "fp8"
    elem = 1 if fp8 else torch.finfo(dtype).bits // 8  # bytes of a KV element
    d = shapes.head_dim
    scale = d**-0.5
    gen = torch.Generator(device=device).manual_seed(0)

    def timer(fn: Callable[[int], Any], copies: int) -> float:
        """Milliseconds per call of ``fn(i)`` over ``copies`` inputs: the median of 10 replays
        of one CUDA graph of them all (bench_skinny's timer); one timed eager pass under the
        interpreter."""
        if not args.tiny:
            from mrv2_kernels.bench_skinny import time_graph

            return time_graph(fn, copies, repeats=10) / 1e3
        for i in range(copies):
            fn(i)
        t0 = time.perf_counter()
        for i in range(copies):
            fn(i)
        return (time.perf_counter() - t0) * 1e3 / copies

    @dataclass
    class Case:
        """One random batch over ``copies`` KV caches; ``make(**overrides)`` -> ``fn(i)``."""

        query: torch.Tensor
        kvs: list[torch.Tensor]
        qsl: torch.Tensor
        seq_lens: torch.Tensor
        table: torch.Tensor
        bounds: dict[str, Any]

        def make(self, **kw: Any) -> Callable[[int], torch.Tensor]:
            def fn(i: int) -> torch.Tensor:
                return paged_attention(self.query, self.kvs[i], self.qsl, self.seq_lens,
                                       self.table, scale, **self.bounds, **kw)

            return fn

        def ref(self) -> torch.Tensor:
            return paged_attention_ref(self.query, self.kvs[0], self.qsl, self.seq_lens,
                                       self.table, scale, **self.bounds)

    def case(heads: int, kv_heads: int, qlens: list[int], lens: list[int],
             copies: int = 1) -> Case:
        """Random queries, KV caches and non-contiguous block ids."""
        bs = shapes.block_size
        per_req = [-(-s // bs) for s in lens]
        num_blocks = sum(per_req) + 1
        kvs = [torch.randn(2, num_blocks, bs, kv_heads, d, generator=gen, device=device,
                           dtype=dtype) for _ in range(copies)]
        if fp8:
            from mrv2_kernels.kv_cache import FP8_KV_DTYPE, to_cache_dtype

            kvs = [to_cache_dtype(kv, FP8_KV_DTYPE) for kv in kvs]
        perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
        table = torch.zeros(len(lens), max(per_req), dtype=torch.int32, device=device)
        used = 0
        for i, n in enumerate(per_req):
            table[i, :n] = perm[used : used + n]
            used += n
        query = torch.randn(sum(qlens), heads, d, generator=gen, device=device, dtype=dtype)
        starts = [0]
        for q in qlens:
            starts.append(starts[-1] + q)
        qsl = torch.tensor(starts, dtype=torch.int32, device=device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        bounds = {"max_query_len": max(qlens), "max_seq_len": max(lens), "num_reqs": len(lens)}
        return Case(query, kvs, qsl, seq_lens, table, bounds)

    def copies_for(kv_bytes: int) -> int:
        if args.tiny:
            return 1
        return max(2, min(_MAX_COPIES, -(-_KV_BYTES_PER_REPLAY // kv_bytes)))

    layouts = [lay for lay in shapes.layouts if not args.layouts or lay[0] in args.layouts]

    def tma_prefill(lay: str, c: Case, flops: float, what: str) -> list[str]:
        """The same case through the TMA prefill kernel (its step keys and values copied out
        of the cache into one fused QKV buffer, as a model's step has them); checked against
        the paged kernel first. Empty where the kernel does not run (``use_tma_prefill``)."""
        from mrv2_kernels.prefill_attention import prefill_attention_tma, use_tma_prefill

        num_tokens, heads, _ = c.query.shape
        kv_heads, bs = c.kvs[0].shape[3], c.kvs[0].shape[2]
        qsl, lens = c.qsl.tolist(), c.seq_lens.tolist()
        pos = torch.cat([torch.arange(lens[i] - (qsl[i + 1] - qsl[i]), lens[i], device=device)
                         for i in range(len(lens))])
        req = torch.cat([torch.full((qsl[i + 1] - qsl[i],), i, device=device)
                         for i in range(len(lens))])
        blk, off = c.table[req, pos // bs].long(), pos % bs
        steps = []
        for kv in c.kvs:
            qkv = torch.empty(num_tokens, (heads + 2 * kv_heads) * d, device=device, dtype=dtype)
            q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
            q.copy_(c.query.reshape(num_tokens, -1))
            k.copy_(kv[0, blk, off].reshape(num_tokens, -1))
            v.copy_(kv[1, blk, off].reshape(num_tokens, -1))
            steps.append((q.view(num_tokens, heads, d), k, v))
        if not use_tma_prefill(*steps[0]):
            return []
        outs = [torch.empty_like(c.query) for _ in steps]

        def make(**kw: Any) -> Callable[[int], torch.Tensor]:
            def fn(i: int) -> torch.Tensor:
                return prefill_attention_tma(
                    *steps[i], c.kvs[i], c.qsl, c.seq_lens, c.table, scale,
                    max_query_len=c.bounds["max_query_len"], num_reqs=c.bounds["num_reqs"],
                    out=outs[i], **kw)

            return fn

        got, want = make()(0).float(), c.make()(0).float()
        if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
            raise SystemExit(f"TMA prefill {lay} {what}: max error "
                             f"{(got - want).abs().max().item():.3g}")
        ms = timer(make(), len(steps))
        lines = [f"prefill {lay:>4} {what} TMA kernel: {ms * 1e3:.1f} us "
                 f"{flops / ms / 1e9:.1f} TFLOP/s (default tiles)"]
        print(lines[0], flush=True)
        if args.tiles_last:
            if not torch.equal(make(tiles_last=True)(0).clone(), make()(0)):
                raise SystemExit(f"TMA prefill {lay} {what}: tiles_last changed the output")
            ms_last = timer(make(tiles_last=True), len(steps))
            lines.append(f"prefill {lay:>4} {what} TMA kernel, tiles last: {ms_last * 1e3:.1f} us "
                         f"{flops / ms_last / 1e9:.1f} TFLOP/s")
            print(lines[-1], flush=True)
        if args.sweep:
            lines += sweep_tiles(make, len(steps), flops, "TMA ")
        return lines

    def sweep_tiles(make: Callable[..., Callable[[int], Any]], copies: int, flops: float,
                    label: str) -> list[str]:
        """Every prefill tile (block_m, block_n, warps, stages) through ``make(**tile)``;
        prints and returns the best three lines."""
        results = []
        for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8),
                                                       (2, 3, 4)):
            tag = f"bm={bm} bn={bn} warps={warps} stages={stages}"
            try:
                msv = timer(make(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages),
                            copies)
            except Exception as e:  # noqa: BLE001 (out of resources: skip the tile)
                print(f"      {label}{tag}: failed ({type(e).__name__})")
                continue
            results.append((msv, tag))
        lines = []
        for msv, tag in sorted(results)[:3]:
            lines.append(f"      {label}{tag}: {msv * 1e3:.1f} us {flops / msv / 1e9:.1f} TFLOP/s")
            print(lines[-1], flush=True)
        return lines

    def grid_orders(lay: str, c: Case, what: str, flops: float | None) -> list[str]:
        """``c`` through the paged kernel's prefill grids (flat and not) in both orders
        (``tiles_last``): the same output, and each one's time."""
        lines = []
        for flat in (True, False):
            base = c.make(flat_grid=flat)(0).clone()
            for last in (False, True):
                fn = c.make(flat_grid=flat, tiles_last=last)
                if last and not torch.equal(fn(0), base):
                    raise SystemExit(f"{lay} {what}: tiles_last changed the output")
                ms = timer(fn, len(c.kvs))
                rate = f" {flops / ms / 1e9:.1f} TFLOP/s" if flops else ""
                lines.append(f"order {lay:>4} {what}: {'flat' if flat else 'grid'} "
                             f"{'tiles last' if last else 'default'} {ms * 1e3:.1f} us{rate}")
                print(lines[-1], flush=True)
        return lines

    def mixed_case(heads: int, kv_heads: int) -> tuple[Case, list[int], list[int]]:
        """The mixed step of :func:`mixed_step`: its case, prompt and decode lengths."""
        import random

        rng = random.Random(0)
        if args.tiny:
            prompts, decodes = [rng.randint(5, 40) for _ in range(3)], [9, 30, 61, 4]
        else:
            decodes = [rng.randint(100, 1500) for _ in range(128)]
            prompts = []
            while sum(prompts) < 8192 - len(decodes):
                prompts.append(min(rng.randint(100, 1024), 8192 - len(decodes) - sum(prompts)))
        lens = decodes + prompts  # the running requests first, as the scheduler orders them
        kv_bytes = sum(lens) * kv_heads * d * 2 * elem
        c = case(heads, kv_heads, [1] * len(decodes) + prompts, lens, copies_for(kv_bytes))
        return c, prompts, decodes

    def mixed_tiles(lay: str, heads: int, kv_heads: int, pre: Case, flops: float
                    ) -> list[str]:
        """Prefill tiles on both the 4 x 1,024 prefill ``pre`` and the mixed step (flat grid):
        a tile that serves both."""
        mixed = mixed_case(heads, kv_heads)[0]
        lines = []
        tiles = [(64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 3), (128, 32, 8, 2),
                 (128, 64, 8, 2), (32, 64, 4, 2), (32, 32, 4, 2), (64, 128, 8, 2)]
        for bm, bn, warps, stages in tiles:
            kw = {"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages}
            try:
                t_pre = timer(pre.make(**kw), len(pre.kvs))
                t_mix = timer(mixed.make(flat_grid=True, **kw), len(mixed.kvs))
            except Exception as e:  # noqa: BLE001 (out of resources: skip the tile)
                print(f"tiles {lay:>4} bm={bm} bn={bn} warps={warps} stages={stages}: failed "
                      f"({type(e).__name__})")
                continue
            lines.append(f"tiles {lay:>4} bm={bm} bn={bn} warps={warps} stages={stages}: "
                         f"prefill {flops / t_pre / 1e9:.1f} TFLOP/s, mixed step "
                         f"{t_mix * 1e3:.1f} us")
            print(lines[-1], flush=True)
        return lines

    def mixed_step(lay: str, heads: int, kv_heads: int) -> list[str]:
        """A mixed step like the throughput workload's first ones: prompts of 100-1,024
        tokens filling the 8,192-token budget beside 128 decoding requests (contexts
        100-1,500), through the (query tile, request) grid and the flat grid (same bits), both
        with the decoding requests in query tiles, then with them apart (the default); then
        its halves alone."""
        c, prompts, decodes = mixed_case(heads, kv_heads)
        # one launch (the one-token requests in query tiles), then the default's two
        grid = c.make(flat_grid=False, one_token_apart=False)
        flat = c.make(flat_grid=True, one_token_apart=False)
        if not torch.equal(grid(0), flat(0)):
            raise SystemExit(f"mixed step {lay}: the flat grid's output differs")
        ms, msf = timer(grid, len(c.kvs)), timer(flat, len(c.kvs))
        apart = c.make(flat_grid=True, one_token_apart=True)
        torch.testing.assert_close(apart(0).float(), flat(0).float(), atol=2e-2, rtol=2e-2)
        ms_apart = timer(apart, len(c.kvs))
        line = (f"mixed step {lay:>4}: {len(prompts)} prompts ({sum(prompts)} tokens) + "
                f"{len(decodes)} decodes: grid {ms * 1e3:.1f} us, flat grid {msf * 1e3:.1f} us"
                f", one-token requests apart {ms_apart * 1e3:.1f} us")
        print(line, flush=True)
        # its two halves apart: the decoding requests in the prefill plan (as inside the mixed
        # step) and in the decode plan, then the prompts alone
        dec = case(heads, kv_heads, [1] * len(decodes), decodes,
                   copies_for(sum(decodes) * kv_heads * d * 2 * elem))
        pro = case(heads, kv_heads, prompts, prompts,
                   copies_for(sum(prompts) * kv_heads * d * 2 * elem))
        dec_pf = replace(dec, bounds={**dec.bounds, "max_query_len": max(prompts)})
        t_dec_pf = timer(dec_pf.make(flat_grid=True, one_token_apart=False), len(dec.kvs))
        t_dec = timer(dec.make(uniform_decode=True), len(dec.kvs))
        t_dec1 = timer(dec.make(uniform_decode=True, num_splits=1), len(dec.kvs))
        t_pro = timer(pro.make(flat_grid=True), len(pro.kvs))
        line2 = (f"mixed step {lay:>4} apart: decodes in the prefill plan {t_dec_pf * 1e3:.1f} "
                 f"us, in the decode plan "
                 f"{t_dec * 1e3:.1f} us (1 split {t_dec1 * 1e3:.1f}), prompts alone "
                 f"{t_pro * 1e3:.1f} us")
        print(line2, flush=True)
        return [line, line2]

    # ---- correctness first ----------------------------------------------------------------
    ctx0 = shapes.contexts[0]
    lens_mixed = torch.randint(1, 4 * ctx0, (8,), generator=torch.Generator().manual_seed(1))
    pl = shapes.prefill_len
    checks: list[tuple[str, list[int], list[int], dict[str, Any]]] = [
        (f"decode b8 ctx{ctx0}", [1] * 8, [ctx0] * 8, {"uniform_decode": True}),
        ("decode b8 mixed lens", [1] * 8, lens_mixed.tolist(), {"uniform_decode": True}),
        ("decode b1 no split", [1], [ctx0], {"uniform_decode": True, "num_splits": 1}),
        ("prefill b2", [pl] * 2, [pl] * 2, {}),
        ("chunked prefill", [pl // 2], [2 * pl], {}),
    ]
    ok = True
    for (lay, heads, kv_heads), (name, qlens, lens, kw) in itertools.product(layouts, checks):
        c = case(heads, kv_heads, qlens, lens)
        got, want = c.make(**kw)(0).float(), c.ref().float()
        err = (got - want).abs().max().item()
        good = bool(((got - want).abs() <= 2e-2 + 2e-2 * want.abs()).all())  # bf16 tolerance
        ok &= good
        print(f"check {lay:>4} {name:<22} max|err| {err:.2e} {'ok' if good else 'MISMATCH'}")
        del c
    if not ok:
        return 1
    summary: list[str] = []
    if args.workload and not args.tiny:
        for lay, heads, kv_heads in layouts:
            summary += workload_steps(lay, heads, kv_heads, case, copies_for, timer,
                                      args.workload_tiles, elem)
        print("\nsummary:\n" + "\n".join(summary))
        return 0

    # ---- decode table ---------------------------------------------------------------------
    for lay, heads, kv_heads in [] if args.no_decode else layouts:
        print(f"\ndecode, {lay} heads: H={heads} Hk={kv_heads} D={d} bf16 "
              f"block_size={shapes.block_size} (splits and block_n from attention_plan)")
        header = (f"{'batch':>5} {'ctx':>5} {'splits':>6} {'bn':>4} {'time us':>9} "
                  f"{'KV MB':>9} {'GB/s':>7} {'no split us':>11} {'GB/s':>7}")
        print(header)
        print("-" * len(header))
        for b, ctx in itertools.product(shapes.batches, shapes.contexts):
            kv_bytes = b * ctx * kv_heads * d * 2 * elem
            c = case(heads, kv_heads, [1] * b, [ctx] * b, copies_for(kv_bytes))
            plan = attention_plan(c.query, c.kvs[0], **c.bounds, uniform_decode=True)
            dw = {"num_warps": args.decode_warps} if args.decode_warps else {}
            ms = timer(c.make(uniform_decode=True, **dw), len(c.kvs))
            ms1 = timer(c.make(uniform_decode=True, num_splits=1, **dw), len(c.kvs))
            print(f"{b:>5} {ctx:>5} {plan.num_splits:>6} {plan.block_n:>4} {ms * 1e3:>9.1f} "
                  f"{kv_bytes / 1e6:>9.2f} {kv_bytes / ms / 1e6:>7.0f} {ms1 * 1e3:>11.1f} "
                  f"{kv_bytes / ms1 / 1e6:>7.0f}", flush=True)
            if (b, ctx) in SWEEP_CASES:
                summary.append(f"decode {lay:>4} b{b:<3} ctx{ctx:<5} {ms * 1e3:7.1f} us "
                               f"{kv_bytes / ms / 1e6:5.0f} GB/s")
            if args.sweep and (b, ctx) in SWEEP_CASES:
                best: tuple[float, str] = (ms, "default")
                for bn, stages, warps, mult in itertools.product(
                        (32, 64, 128), (2, 3), (2, 4), (1, 2, 4)):
                    splits = max(1, plan.num_splits * mult)
                    tag = f"bn={bn} stages={stages} warps={warps} splits={splits}"
                    try:
                        msv = timer(c.make(uniform_decode=True, block_n=bn, num_stages=stages,
                                           num_warps=warps, num_splits=splits), len(c.kvs))
                    except Exception as e:  # noqa: BLE001 (e.g. out of shared memory)
                        print(f"      {tag}: failed ({type(e).__name__})")
                        continue
                    if msv < best[0]:
                        best = (msv, tag)
                line = (f"      best: {best[1]} {best[0] * 1e3:.1f} us "
                        f"({kv_bytes / best[0] / 1e6:.0f} GB/s)")
                print(line, flush=True)
                summary.append(line)
            del c
            if device.type == "cuda":
                torch.cuda.empty_cache()

    # ---- prefill --------------------------------------------------------------------------
    pb = shapes.prefill_batch
    for lay, heads, kv_heads in layouts:
        c = case(heads, kv_heads, [pl] * pb, [pl] * pb, 1 if args.tiny else 4)
        flops = 4 * heads * d * pb * (pl * (pl + 1) // 2)
        plan = attention_plan(c.query, c.kvs[0], **c.bounds)
        ms = timer(c.make(), len(c.kvs))
        line = (f"prefill {lay:>4} {pb} x {pl} causal: {ms * 1e3:.1f} us "
                f"{flops / ms / 1e9:.1f} TFLOP/s (bm={plan.block_m} bn={plan.block_n} "
                f"warps={plan.num_warps} stages={plan.num_stages})")
        print("\n" + line, flush=True)
        summary.append(line)
        summary += tma_prefill(lay, c, flops, f"{pb} x {pl}")
        if args.tiles_last:
            summary += grid_orders(lay, c, f"{pb} x {pl}", flops)
            summary += grid_orders(lay, mixed_case(heads, kv_heads)[0], "mixed step", None)
        # a chunk after a prefix (a long prompt's later chunk): prefix keys from the cache
        cc = case(heads, kv_heads, [pl], [3 * pl + pl], 1 if args.tiny else 4)
        chunk_flops = 4 * heads * d * pl * (3 * pl + (pl + 1) / 2)
        msc = timer(cc.make(), len(cc.kvs))
        line = (f"prefill {lay:>4} 1 x {pl} after {3 * pl}: {msc * 1e3:.1f} us "
                f"{chunk_flops / msc / 1e9:.1f} TFLOP/s")
        print(line, flush=True)
        summary.append(line)
        summary += tma_prefill(lay, cc, chunk_flops, f"1 x {pl} after {3 * pl}")
        del cc
        summary += mixed_step(lay, heads, kv_heads)
        if args.sweep:
            summary += sweep_tiles(c.make, len(c.kvs), flops, "")
        if args.mixed_tiles:
            summary += mixed_tiles(lay, heads, kv_heads, c, flops)
        del c
    print("\nsummary:\n" + "\n".join(summary))
    return 0


def workload_steps(lay: str, heads: int, kv_heads: int, case: Any, copies_for: Any,
                   timer: Any, tiles: list[str] | None = None, elem: int = 2) -> list[str]:
    """Device time of the throughput workload's decode attention, every 64th step, per layer.

    ``mrv2 bench throughput``'s 256 requests (prompts and outputs of 100-1,024 tokens) decode
    together; step ``t`` holds the requests with more than ``t`` tokens to go, at context
    ``prompt + t + 1``. Their lengths differ up to 10x, so one program per (request, kv head)
    finishes at very different times: the step is timed with the requests in arrival order
    (the scheduler's) and longest first, at the plan's split count (``max_seq_len`` 4,096, a
    decode graph's bound) and at fixed ones; or, with ``tiles`` (``"BN:STAGES:WARPS"`` each),
    longest first at the plan's splits with each of those decode tiles. ``elem``: bytes of a KV
    element (1: an fp8 cache, ``--kv-dtype fp8``), for the floor.
    """
    import random

    import torch

    rng = random.Random(0)  # mrv2.bench.throughput.workload(256)'s lengths
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    max_tokens = [rng.randint(100, 1024) for _ in range(256)]
    d = 128
    variants: list[tuple[str, bool, int | None]] = [
        ("arrival", False, None), ("arrival", False, 2), ("arrival", False, 4),
        ("longest first", True, None), ("longest first", True, 2), ("longest first", True, 4)]
    overrides: list[dict[str, int]] = [{} for _ in variants]
    if tiles:
        variants, overrides = [], []
        for tile in tiles:
            bn, stages, warps = (int(v) for v in tile.split(":"))
            variants.append((f"n{bn} st{stages} w{warps}", True, None))
            overrides.append({"block_n": bn, "num_stages": stages, "num_warps": warps})
    totals = [0.0] * len(variants)
    ideal = 0.0
    print(f"\nworkload decode steps, {lay} heads (us per layer; splits None = the plan's)")
    print(f"{'step':>5} {'batch':>5} {'mean ctx':>8} {'max':>5} {'floor':>6}  "
          + "  ".join(f"{o[:7]}/{s}" for o, _, s in variants))
    for t in range(0, 1024, 64):
        lens = [len(p) + t + 1 for p, m in zip(prompts, max_tokens, strict=True) if m > t]
        if not lens:
            break
        kv_bytes = sum(lens) * kv_heads * d * 2 * elem
        floor_us = kv_bytes / 4.2e6
        ideal += floor_us
        row = []
        for i, (_, longest, splits) in enumerate(variants):
            ordered = sorted(lens, reverse=True) if longest else lens
            c = case(heads, kv_heads, [1] * len(lens), ordered, copies_for(kv_bytes))
            c.bounds["max_seq_len"] = 4096
            ms = timer(c.make(uniform_decode=True, num_splits=splits, **overrides[i]),
                       len(c.kvs))
            totals[i] += ms * 1e3
            row.append(ms * 1e3)
            del c
            torch.cuda.empty_cache()
        print(f"{t:>5} {len(lens):>5} {sum(lens) / len(lens):>8.0f} {max(lens):>5} "
              f"{floor_us:>6.1f}  " + "  ".join(f"{v:>9.1f}" for v in row), flush=True)
    out = [f"workload {lay} attention over 16 steps: floor {ideal:.0f} us (4.2 TB/s)"]
    for (order, _, splits), tot in zip(variants, totals, strict=True):
        out.append(f"   {order:<13} splits {str(splits):<4} {tot:8.0f} us  "
                   f"{ideal / tot:.2f} of floor")
    return out


if __name__ == "__main__":
    sys.exit(main())
