"""Micro-benchmark of the MLA decode kernels (absorbed form) at DeepSeek-V2-Lite shapes, H200.

    python -m mrv2_kernels.bench_mla            # the table
    python -m mrv2_kernels.bench_mla --sweep    # also try tile/warp/stage/split variants
    python -m mrv2_kernels.bench_mla --tiny     # CPU smoke test under the Triton interpreter

Per layer and decode step: 16 query heads, kv_lora_rank 512, rope dim 64 (a 1152-byte bf16
row per cached token), block size 16, random non-contiguous block ids, one query token per
request, batch {1, 8, 64} x context {1024, 4096}. Each timing replays a CUDA graph of the call
over enough separate caches (up to 128) that they do not fit in L2 (the KV of a real layer
comes from HBM), then divides by the number of calls. The floor is the latent + rope bytes a
step must read over the measured device-to-device copy bandwidth (1 GiB, read + write,
:func:`~mrv2_kernels.bench_fp8.copy_bandwidth`).
Outputs are checked against ``mla_decode_attention_ref`` first (exit code 1 on a mismatch).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

HEADS, RANK, ROPE, BLOCK = 16, 512, 64, 16
TINY = (4, 32, 16, 4)
BATCHES, CONTEXTS = (1, 8, 64), (1024, 4096)
L2_BYTES = 256 << 20  # spread the copies over this much KV at least (H200 L2: 50 MiB)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes under the Triton interpreter")
    p.add_argument("--sweep", action="store_true", help="try block_n/warps/stages/split variants")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        env = dict(os.environ, TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "mrv2_kernels.bench_mla", *(argv or sys.argv[1:])]
        os.execve(sys.executable, cmd, env)
    import torch

    from mrv2_kernels._backend import cuda_event_ms
    from mrv2_kernels.mla_attention import (
        mla_decode_attention_ref,
        mla_decode_attention_triton,
        mla_decode_plan,
    )

    heads, rank, rope, block = TINY if args.tiny else (HEADS, RANK, ROPE, BLOCK)
    batches, contexts = ((1, 3), (24, 40)) if args.tiny else (BATCHES, CONTEXTS)
    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA device: run with --tiny for a CPU smoke test under the interpreter")
        return 2
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.bfloat16
    row_bytes = (rank + rope) * 2
    scale = (128 + rope) ** -0.5  # qk_nope_head_dim 128 + rope
    gen = torch.Generator(device=device).manual_seed(0)

    Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                   torch.Tensor]  # fmt: skip

    def inputs(batch: int, ctx: int) -> Inputs:
        per_req = math.ceil(ctx / block)
        num_blocks = batch * per_req
        cache = torch.randn(num_blocks, block, rank + rope, generator=gen, device=device,
                            dtype=dtype)  # fmt: skip
        table = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
        table = table.view(batch, per_req)
        q_latent = torch.randn(batch, heads, rank, generator=gen, device=device, dtype=dtype)
        q_pe = torch.randn(batch, heads, rope, generator=gen, device=device, dtype=dtype)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
        return q_latent, q_pe, cache, table, seq_lens, qsl

    def call(x: Inputs, out: torch.Tensor, **kw: Any) -> None:
        mla_decode_attention_triton(*x, 1, scale, out, max_seq_len=x[3].shape[1] * block, **kw)

    def median_us(fn: Callable[[], object], per_call: int) -> float:
        if args.tiny:
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e6 / per_call
        fn()  # compile and warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        times = []
        for _ in range(20):
            times.append(cuda_event_ms(graph.replay) * 1e3 / per_call)
        return statistics.median(times)

    def timer(batch: int, ctx: int) -> Callable[..., float]:
        copies = 1 if args.tiny else max(1, min(128, L2_BYTES // (batch * ctx * row_bytes)))
        sets = [inputs(batch, ctx) for _ in range(copies)]
        outs = [torch.empty_like(s[0]) for s in sets]

        def run(**kw: Any) -> float:
            def fn() -> None:
                for x, out in zip(sets, outs, strict=True):
                    call(x, out, **kw)

            return median_us(fn, copies)

        return run

    # ---- correctness first ----------------------------------------------------------------
    ok = True
    for batch, ctx, kw in [(3, contexts[0], {}), (2, contexts[-1], {"num_splits": 1})]:
        x = inputs(batch, ctx)
        got = torch.empty_like(x[0])
        call(x, got, **kw)
        want = mla_decode_attention_ref(*x, 1, scale, torch.empty_like(x[0]))
        err = (got.float() - want.float()).abs().max().item()
        good = bool(((got.float() - want.float()).abs() <= 2e-2 + 2e-2 * want.float().abs()).all())
        ok &= good
        print(f"check b{batch} ctx{ctx} {kw}: max|err| {err:.2e} {'ok' if good else 'MISMATCH'}")
    if not ok:
        return 1

    # ---- timings ----------------------------------------------------------------------------
    if args.tiny:
        bandwidth = 1e9
    else:
        from mrv2_kernels.bench_fp8 import copy_bandwidth

        # eager copies, as the other kernel benches (a copy captured in a graph measured
        # 2.7 TB/s on the H200 against 4.2 TB/s eager)
        bandwidth = copy_bandwidth()
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; H={heads} R={rank} P={rope} bf16 "
          f"block_size={block}")  # fmt: skip
    rows = []
    for batch, ctx in itertools.product(batches, contexts):
        run = timer(batch, ctx)
        plan = mla_decode_plan(num_heads=heads, kv_lora_rank=rank, max_query_len=1,
                               max_seq_len=ctx, num_reqs=batch, on_gpu=not args.tiny,
                               num_sms=torch.cuda.get_device_properties(0).multi_processor_count
                               if not args.tiny else 8)  # fmt: skip
        kv_bytes = batch * ctx * row_bytes
        floor = kv_bytes / bandwidth * 1e6
        us, us1 = run(), run(num_splits=1)
        rows.append((batch, ctx, plan.num_splits, plan.block_n, us, us1, kv_bytes, floor))
        print(f"b{batch:<3} ctx{ctx:<5} splits {plan.num_splits:<3} {us:8.1f} us "
              f"(no split {us1:8.1f})  floor {floor:7.1f} us", flush=True)  # fmt: skip
        if args.sweep and not args.tiny:
            best = (us, "default")
            for bn, warps, stages, mult in itertools.product(
                (16, 32, 64), (4, 8), (2, 3, 4), (0.5, 1.0, 2.0)
            ):
                tag = f"bn={bn} w={warps} s={stages} splits={max(1, int(plan.num_splits * mult))}"
                try:
                    t = run(block_n=bn, num_warps=warps, num_stages=stages,
                            num_splits=max(1, int(plan.num_splits * mult)))  # fmt: skip
                except Exception as e:  # noqa: BLE001 (out of resources: skip the variant)
                    print(f"    {tag}: failed ({type(e).__name__})")
                    continue
                best = min(best, (t, tag))
            print(f"    best: {best[1]} {best[0]:.1f} us ({floor / best[0]:.0%} of the floor)")
        del run
        if not args.tiny:
            torch.cuda.empty_cache()

    print()
    header = (f"{'batch':>5} {'ctx':>5} {'splits':>6} {'bn':>3} {'us':>8} {'no-split':>8} "
              f"{'KV MB':>7} {'floor us':>8} {'floor%':>6} {'GB/s':>6}")  # fmt: skip
    print(header)
    print("-" * len(header))
    for batch, ctx, splits, bn, us, us1, kv_bytes, floor in rows:
        print(f"{batch:>5} {ctx:>5} {splits:>6} {bn:>3} {us:>8.1f} {us1:>8.1f} "
              f"{kv_bytes / 1e6:>7.2f} {floor:>8.1f} {floor / us:>6.0%} "
              f"{kv_bytes / us / 1e3:>6.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
