"""One decode attention step of the throughput workload's shape, for Nsight Compute.

The fourteenth session found decode attention not bound by its KV bytes (BENCHMARKS.md,
2026-12-02): over an fp8 cache (half the bytes) it took as long as over a bf16 one until its
dots moved to fp16. What it spends per key instead needs hardware counters:

    ncu --clock-control none -k regex:_paged_attn_kernel -s 2 -c 1 \\
        --section SpeedOfLight --section WarpStateStats --section InstructionStats \\
        --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \\
        python3 scripts/ncu_decode_attention.py --kv-dtype fp8

(``gpu_session.sh attnncu`` runs it for both caches.) The step: ``--batch`` requests of one
query token at contexts spread evenly over ``--min-ctx``..``--max-ctx``, longest first (the
engine's order), Qwen3-0.6B heads by default; the kernel runs ``--launches`` times (ncu skips
the first ``-s``). Without ncu it prints the step's device time and its byte floor.
Under ``TRITON_INTERPRET=1`` (``--tiny``) it only checks that the script runs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--heads", type=int, nargs=2, default=[16, 8], metavar=("Q", "KV"))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--min-ctx", type=int, default=200)
    ap.add_argument("--max-ctx", type=int, default=2000)
    ap.add_argument("--launches", type=int, default=3)
    ap.add_argument("--num-warps", type=int, default=None)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  dict(os.environ, TRITON_INTERPRET="1"))
    import torch

    from mrv2_kernels._backend import cuda_event_ms
    from mrv2_kernels.kv_cache import FP8_KV_DTYPE, to_cache_dtype
    from mrv2_kernels.paged_attention import paged_attention

    device = "cpu" if args.tiny else "cuda"
    heads, kv_heads = args.heads
    d, bs = (16, 4) if args.tiny else (128, 16)
    batch = 3 if args.tiny else args.batch
    lo, hi = (5, 30) if args.tiny else (args.min_ctx, args.max_ctx)
    lens = sorted((lo + (hi - lo) * i // max(batch - 1, 1) for i in range(batch)), reverse=True)
    per_req = [math.ceil(n / bs) for n in lens]
    gen = torch.Generator(device=device).manual_seed(0)
    num_blocks = sum(per_req) + 1
    kv = torch.randn(2, num_blocks, bs, kv_heads, d, generator=gen, device=device,
                     dtype=torch.bfloat16)
    if args.kv_dtype == "fp8":
        kv = to_cache_dtype(kv, FP8_KV_DTYPE)
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    table = torch.zeros(batch, max(per_req), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(per_req):
        table[i, :n] = perm[used:used + n]
        used += n
    query = torch.randn(batch, heads, d, generator=gen, device=device, dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)

    def step() -> torch.Tensor:
        return paged_attention(query, kv, qsl, seq_lens, table, d**-0.5, max_query_len=1,
                               max_seq_len=4096, num_reqs=batch, uniform_decode=True,
                               num_warps=args.num_warps)

    for _ in range(args.launches):
        step()
    if device == "cuda":
        ms = sorted(cuda_event_ms(step) for _ in range(5))[2]
        kv_bytes = sum(lens) * kv_heads * d * 2 * kv.element_size()
        print(f"decode step, {batch} requests, contexts {lo}-{hi}, {args.kv_dtype} cache: "
              f"{ms * 1e3:.1f} us, KV {kv_bytes / 1e6:.1f} MB, "
              f"{kv_bytes / ms / 1e9:.2f} TB/s")
    else:
        print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
