"""Micro-benchmark of the Triton paged attention (decode and prefill), for an H100/H200.

    python -m mrv2_kernels.bench_attention            # the table (Qwen3-0.6B shapes, bf16)
    python -m mrv2_kernels.bench_attention --sweep    # also try tile/stage/split variants
    TRITON_INTERPRET=1 python -m mrv2_kernels.bench_attention --tiny   # CPU smoke test

Decode: batch {1, 8, 64, 256} x context {512, 2048, 4096}, one query token per request, 16
query heads over 8 KV heads, head_dim 128, block size 16, random non-contiguous block ids.
Times are ``triton.testing.do_bench`` medians (it flushes L2 before each run, so KV comes
from HBM); GB/s counts the K and V bytes each step must read, against ~4.8 TB/s peak on an
H200. Prefill: 4 requests x 1024 new tokens (no earlier context), causal TFLOP/s.
Outputs are checked against ``paged_attention_ref`` on a few cases first (exit code 1 on a
mismatch).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_batch: int
    prefill_len: int


FULL = Shapes(16, 8, 128, 16, (1, 8, 64, 256), (512, 2048, 4096), 4, 1024)
TINY = Shapes(4, 2, 16, 4, (1, 3), (24, 40), 2, 20)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes under the Triton interpreter")
    p.add_argument("--sweep", action="store_true", help="try block_n/num_stages/split variants")
    p.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
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
    elem = torch.finfo(dtype).bits // 8
    scale = shapes.head_dim**-0.5
    gen = torch.Generator(device=device).manual_seed(0)

    def timer(fn: Callable[[], Any]) -> float:
        """Milliseconds per call: do_bench median on GPU, one timed call on the interpreter."""
        if args.tiny:
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=args.rep, return_mode="median"))

    def batch(
        qlens: list[int], lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """query, kv_cache, query_start_loc, seq_lens, block_table with random block ids."""
        bs = shapes.block_size
        per_req = [-(-s // bs) for s in lens]
        max_blocks = max(per_req)
        num_blocks = sum(per_req) + 1
        kv = torch.randn(
            2, num_blocks, bs, shapes.num_kv_heads, shapes.head_dim,
            generator=gen, device=device, dtype=dtype,
        )  # fmt: skip
        perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
        table = torch.zeros(len(lens), max_blocks, dtype=torch.int32, device=device)
        used = 0
        for i, n in enumerate(per_req):
            table[i, :n] = perm[used : used + n]
            used += n
        query = torch.randn(
            sum(qlens), shapes.num_heads, shapes.head_dim,
            generator=gen, device=device, dtype=dtype,
        )  # fmt: skip
        starts = [0]
        for q in qlens:
            starts.append(starts[-1] + q)
        qsl = torch.tensor(starts, dtype=torch.int32, device=device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        return query, kv, qsl, seq_lens, table

    def setup(
        qlens: list[int], lens: list[int]
    ) -> tuple[Callable[..., Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]:
        """(make(**launcher_overrides) -> timed call, reference call) over one random batch."""
        query, kv, qsl, seq_lens, table = batch(qlens, lens)
        bounds: dict[str, Any] = {
            "max_query_len": max(qlens),
            "max_seq_len": max(lens),
            "num_reqs": len(lens),
        }

        def make(**kw: Any) -> Callable[[], torch.Tensor]:
            def fn() -> torch.Tensor:
                return paged_attention(query, kv, qsl, seq_lens, table, scale, **bounds, **kw)

            return fn

        def ref() -> torch.Tensor:
            return paged_attention_ref(query, kv, qsl, seq_lens, table, scale, **bounds)

        return make, ref

    # ---- correctness first ----------------------------------------------------------------
    ctx0 = shapes.contexts[0]
    lens_mixed = torch.randint(1, 4 * ctx0, (8,), generator=torch.Generator().manual_seed(1))
    checks: list[tuple[str, list[int], list[int], dict[str, Any]]] = [
        (f"decode b8 ctx{ctx0}", [1] * 8, [ctx0] * 8, {"uniform_decode": True}),
        ("decode b8 mixed lens", [1] * 8, lens_mixed.tolist(), {"uniform_decode": True}),
        ("decode b1 no split", [1], [ctx0], {"uniform_decode": True, "num_splits": 1}),
        ("prefill b2", [shapes.prefill_len] * 2, [shapes.prefill_len] * 2, {}),
        ("chunked prefill", [shapes.prefill_len // 2], [2 * shapes.prefill_len], {}),
    ]
    ok = True
    for name, qlens, lens, kw in checks:
        make, ref = setup(qlens, lens)
        got, want = make(**kw)().float(), ref().float()
        err = (got - want).abs().max().item()
        good = bool(((got - want).abs() <= 2e-2 + 2e-2 * want.abs()).all())  # bf16 tolerance
        ok &= good
        print(f"check {name:<22} max|err| {err:.2e} {'ok' if good else 'MISMATCH'}")
    if not ok:
        return 1

    # ---- decode table ---------------------------------------------------------------------
    hk, d = shapes.num_kv_heads, shapes.head_dim
    print()
    print(
        f"decode: H={shapes.num_heads} Hk={hk} D={d} bf16 block_size={shapes.block_size} "
        f"(splits and block_n from attention_plan; 'no split' forces num_splits=1)"
    )
    header = (
        f"{'batch':>5} {'ctx':>5} {'splits':>6} {'bn':>4} {'time us':>9} {'KV MB':>9} "
        f"{'GB/s':>7} {'no split us':>11} {'GB/s':>7}"
    )
    print(header)
    print("-" * len(header))
    for b in shapes.batches:
        for ctx in shapes.contexts:
            qlens, lens = [1] * b, [ctx] * b
            make, _ = setup(qlens, lens)
            probe = torch.empty(b, shapes.num_heads, d, dtype=dtype, device=device)
            plan = attention_plan(
                probe,
                torch.empty(2, 1, shapes.block_size, hk, d, dtype=dtype, device=device),
                max_query_len=1,
                max_seq_len=ctx,
                num_reqs=b,
                uniform_decode=True,
            )
            kv_bytes = b * ctx * hk * d * 2 * elem
            ms = timer(make(uniform_decode=True))
            ms1 = timer(make(uniform_decode=True, num_splits=1))
            print(
                f"{b:>5} {ctx:>5} {plan.num_splits:>6} {plan.block_n:>4} {ms * 1e3:>9.1f} "
                f"{kv_bytes / 1e6:>9.2f} {kv_bytes / ms / 1e6:>7.0f} {ms1 * 1e3:>11.1f} "
                f"{kv_bytes / ms1 / 1e6:>7.0f}"
            )
            if args.sweep:
                best: tuple[float, str] = (ms, "default")
                for bn in (32, 64, 128):
                    for stages in (2, 3, 4):
                        for mult in (0.5, 1.0, 2.0):
                            splits = max(1, int(plan.num_splits * mult))
                            tag = f"bn={bn} stages={stages} splits={splits}"
                            fnv = make(
                                uniform_decode=True,
                                block_n=bn,
                                num_stages=stages,
                                num_splits=splits,
                            )
                            try:
                                msv = timer(fnv)
                            except Exception as e:  # e.g. out of shared memory
                                print(f"      {tag}: failed ({type(e).__name__})")
                                continue
                            if msv < best[0]:
                                best = (msv, tag)
                print(
                    f"      best: {best[1]} {best[0] * 1e3:.1f} us "
                    f"({kv_bytes / best[0] / 1e6:.0f} GB/s)"
                )
            del make
            if device.type == "cuda":
                torch.cuda.empty_cache()

    # ---- prefill --------------------------------------------------------------------------
    pb, pl = shapes.prefill_batch, shapes.prefill_len
    make, _ = setup([pl] * pb, [pl] * pb)
    ms = timer(make())
    flops = 4 * shapes.num_heads * d * pb * (pl * (pl + 1) // 2)
    print()
    print(f"prefill: {pb} x {pl} tokens, no context, causal")
    print(f"  time {ms * 1e3:.1f} us   {flops / ms / 1e9:.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
