"""Prototype: where an fp8 KV cache's decode attention spends its extra instructions.

Nsight Compute on the production kernel (fifteenth session, BENCHMARKS.md 2026-12-02): one
workload-shaped decode step runs at 0.94 of its byte floor over a bf16 cache (145 µs, 3.99
TB/s) but at 0.55 over an fp8 one (126 µs for half the bytes), executing 45.8M instructions
against 25.5M: the fp8 -> fp16 conversion costs ~2.2 instructions an element, not the half of
one that ``cvt.rn.f16x2.e4m3x2`` needs. The suspect is the value tile: the value product
contracts over keys, but keys are not the contiguous axis of the cache, so 8-bit pairs along
keys must be shuffled together before each conversion.

This one-file kernel (uniform decode, one program per request and kv head, every tile masked)
runs the same step several ways, each checked against fp32 attention over the dequantized
cache:

- ``bf16``: a bf16 cache, bf16 dots (what the byte floor of a bf16 cache looks like here);
- ``f16``: an fp8 cache converted to fp16 for fp16 dots (the production kernel's way);
- ``f16vt``: the same with the values stored transposed per block (``[block, kv head, dim,
  slot]``: keys contiguous), so the value product's operand needs no shuffle;
- ``pv8`` / ``pv8vt``: the value product in fp8 (probabilities rounded to e4m3) on either layout;
- ``all8``: both products in fp8 (queries rounded to e4m3 too: FlashAttention-3's fp8 path).

Prints one line per (mode, tile): µs, fraction of the byte floor (4.2 TB/s) and the error
against the reference. A tile ``BN:STAGES:WARPS:MAXNREG`` also caps registers a thread.
``--tiny`` runs it under the interpreter (a smoke check).

What it showed (H200, 2026-12-02, 128 requests of 200-2,000 keys; BENCHMARKS.md): the value
tile is indeed read from shared memory a byte at a time (``LDS.U8``, the sm_90 SASS), and the
transposed layout cuts the loop from 535 to 418 instructions a warp, but every fp8 variant,
fp8 products included, lands at 101-118 µs (0.58-0.68 of the floor) against 145 µs (0.94)
for bf16. What moves it is resident programs: 2 warps (106 µs) or a 128-register cap (109),
not the instruction count. The production plan takes 2 warps (``decode_warps``).
``--load-hints`` (sixteenth session) sets the key / value loads' ``eviction_policy`` /
``cache_modifier``: ``evict_first`` and ``.cg`` changed nothing (within 0.5 µs, both caches).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import os
import sys

import triton
import triton.language as tl


@triton.jit
def _tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt, kvh, start, seq_len, qk_scale,
          sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, sv_d,
          BLOCK_N: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, MODE: tl.constexpr,
          VT: tl.constexpr, MASKED: tl.constexpr, EVICT: tl.constexpr, CACHE: tl.constexpr):
    offs_d = tl.arange(0, D)
    n = start + tl.arange(0, BLOCK_N)
    ok = n < seq_len
    if MASKED:  # whole cache blocks are read (every slot of an allocated block is memory)
        blk = tl.load(bt + n // BS, mask=(n // BS) * BS < seq_len, other=0).to(tl.int64)
        k = tl.load(k_ptr + (blk * sk_b + (n % BS) * sk_s + kvh * sk_h)[:, None]
                    + offs_d[None, :], mask=ok[:, None], other=0.0,
                    eviction_policy=EVICT, cache_modifier=CACHE)
    else:
        blk = tl.load(bt + n // BS).to(tl.int64)
        k = tl.load(k_ptr + (blk * sk_b + (n % BS) * sk_s + kvh * sk_h)[:, None]
                    + offs_d[None, :], eviction_policy=EVICT, cache_modifier=CACHE)
    if VT:
        vt = tl.load(v_ptr + (blk * sv_b + (n % BS) * sv_s + kvh * sv_h)[None, :]
                     + offs_d[:, None] * sv_d, eviction_policy=EVICT, cache_modifier=CACHE)
        if MASKED:  # slots past seq_len may hold anything, NaN included
            vt = tl.where(ok[None, :], vt, 0.0)
    else:
        if MASKED:
            v = tl.load(v_ptr + (blk * sv_b + (n % BS) * sv_s + kvh * sv_h)[:, None]
                        + offs_d[None, :] * sv_d, mask=ok[:, None], other=0.0,
                        eviction_policy=EVICT, cache_modifier=CACHE)
        else:
            v = tl.load(v_ptr + (blk * sv_b + (n % BS) * sv_s + kvh * sv_h)[:, None]
                        + offs_d[None, :] * sv_d, eviction_policy=EVICT,
                        cache_modifier=CACHE)
    if MODE == 1:
        k = k.to(tl.float16)
        if VT:
            vt = vt.to(tl.float16)
        else:
            v = v.to(tl.float16)
    elif MODE == 2:
        k = k.to(tl.float16)
    if VT:
        v = tl.trans(vt)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        s = tl.where(ok[None, :], s, -1.0e30)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def kernel(q_ptr, k_ptr, v_ptr, out_ptr, seq_lens_ptr, bt_ptr, qk_scale, stride_bt,
           sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, sv_d,
           GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           D: tl.constexpr, BS: tl.constexpr, MODE: tl.constexpr, VT: tl.constexpr,
           EVICT: tl.constexpr = "", CACHE: tl.constexpr = ""):
    kvh = tl.program_id(0)
    req = tl.program_id(1)
    nh = tl.num_programs(0) * GROUP
    seq_len = tl.load(seq_lens_ptr + req)
    rows = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    rv = rows < GROUP
    head = kvh * GROUP + rows
    q = tl.load(q_ptr + (req * nh + head)[:, None] * D + offs_d[None, :], mask=rv[:, None],
                other=0.0).to(tl.float32)
    if MODE == 0:
        q = q.to(tl.bfloat16)
    elif MODE == 3:
        q = tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv)
    else:
        q = tl.minimum(tl.maximum(q, -65504.0), 65504.0).to(tl.float16)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    bt = bt_ptr + req.to(tl.int64) * stride_bt
    mid = (seq_len // BLOCK_N) * BLOCK_N
    for start in range(0, mid, BLOCK_N):
        acc, m_i, l_i = _tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt, kvh, start, seq_len,
                              qk_scale, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, sv_d,
                              BLOCK_N, D, BS, MODE, VT, False, EVICT, CACHE)
    for start in range(mid, seq_len, BLOCK_N):
        acc, m_i, l_i = _tile(q, acc, m_i, l_i, k_ptr, v_ptr, bt, kvh, start, seq_len,
                              qk_scale, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h, sv_d,
                              BLOCK_N, D, BS, MODE, VT, True, EVICT, CACHE)
    o = acc / l_i[:, None]
    tl.store(out_ptr + (req * nh + head)[:, None] * D + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=rv[:, None])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, nargs=2, action="append", metavar=("Q", "KV"))
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--modes", nargs="+",
                    default=["bf16", "f16", "f16vt", "pv8", "pv8vt", "all8"])
    ap.add_argument("--tiles", nargs="+", default=["64:2:4", "64:2:2", "64:1:4", "128:2:4"],
                    metavar="BN:STAGES:WARPS[:MAXNREG]")
    ap.add_argument("--load-hints", nargs="+", default=[":"], metavar="EVICT:CACHE",
                    help="the key / value loads' eviction_policy and cache_modifier, e.g. "
                    "evict_first: or :.cg (default: none)")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  dict(os.environ, TRITON_INTERPRET="1"))
    import torch

    tiny = args.tiny
    device = "cpu" if tiny else "cuda"
    d, bs = (16, 4) if tiny else (128, 16)
    batch = 3 if tiny else args.batch
    lo, hi = (5, 30) if tiny else (200, 2000)
    heads_list = args.heads or ([[4, 2]] if tiny else [[16, 8], [32, 8]])
    tiles = ["16:1:1"] if tiny else args.tiles
    fp8 = torch.float8_e4m3fn
    # mode name -> (MODE, cache dtype, values transposed)
    table = {"bf16": (0, torch.bfloat16, False), "f16": (1, fp8, False),
             "f16vt": (1, fp8, True), "pv8": (2, fp8, False), "pv8vt": (2, fp8, True),
             "all8": (3, fp8, False)}
    print(f"{'heads':>6} {'mode':>6} {'tile':>8} {'us':>8} {'floor':>6} {'err':>8}")
    for heads, kv_heads in heads_list:
        group = heads // kv_heads
        lens = sorted((lo + (hi - lo) * i // max(batch - 1, 1) for i in range(batch)),
                      reverse=True)
        per_req = [math.ceil(n / bs) for n in lens]
        gen = torch.Generator(device=device).manual_seed(0)
        nb = sum(per_req) + 1
        k16 = torch.randn(nb, bs, kv_heads, d, generator=gen, device=device).bfloat16()
        v16 = torch.randn(nb, bs, kv_heads, d, generator=gen, device=device).bfloat16()
        q = torch.randn(batch, heads, d, generator=gen, device=device).bfloat16()
        perm = torch.randperm(nb, generator=gen, device=device).to(torch.int32)
        bt = torch.zeros(batch, max(per_req), dtype=torch.int32, device=device)
        used = 0
        for i, n in enumerate(per_req):
            bt[i, :n] = perm[used:used + n]
            used += n
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        scale = d ** -0.5
        refs = {}
        for dt in (torch.bfloat16, fp8):
            kc, vc = k16.to(dt).float(), v16.to(dt).float()
            outs = []
            for i, n in enumerate(lens):
                idx = bt[i, :per_req[i]].long()
                kk = kc[idx].reshape(-1, kv_heads, d)[:n].repeat_interleave(group, 1)
                vv = vc[idx].reshape(-1, kv_heads, d)[:n].repeat_interleave(group, 1)
                s = torch.einsum("hd,nhd->hn", q[i].float(), kk) * scale
                outs.append(torch.einsum("hn,nhd->hd", s.softmax(-1), vv))
            refs[dt] = torch.stack(outs)
        for mode in args.modes:
            code, dt, vt = table[mode]
            kc, vc = k16.to(dt), v16.to(dt)
            if vt:
                vc = vc.permute(0, 2, 3, 1).contiguous()  # [block, kv head, dim, slot]
                sv = (vc.stride(0), vc.stride(3), vc.stride(1), vc.stride(2))
            else:
                sv = (vc.stride(0), vc.stride(1), vc.stride(2), vc.stride(3))
            kv_bytes = sum(lens) * kv_heads * d * 2 * kc.element_size()
            for tile, hints in itertools.product(tiles, args.load_hints):
                evict, cache = hints.split(":")
                bn, stages, warps, *reg = (int(x) for x in tile.split(":"))
                extra = {"maxnreg": reg[0]} if reg and not tiny else {}
                out = torch.full_like(q, float("nan"))

                launch = functools.partial(
                    kernel[(kv_heads, batch)], q, kc, vc, out, seq_lens, bt,
                    scale * 1.4426950408889634, bt.stride(0), kc.stride(0), kc.stride(1),
                    kc.stride(2), *sv, GROUP=group, BLOCK_M=max(16, group), BLOCK_N=bn, D=d,
                    BS=bs, MODE=code, VT=vt, EVICT=evict, CACHE=cache, num_warps=warps,
                    num_stages=stages, **extra)

                try:
                    launch()
                except Exception as exc:  # noqa: BLE001 (a prototype: report and go on)
                    print(f"{heads:>3}/{kv_heads:<2} {mode:>6} {tile:>8} failed: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                    continue
                err = ((out.float() - refs[dt]).abs().max() / refs[dt].abs().max()).item()
                if tiny:
                    us = floor = float("nan")
                else:
                    for _ in range(3):
                        launch()
                    start, stop = torch.cuda.Event(True), torch.cuda.Event(True)
                    start.record()
                    for _ in range(20):
                        launch()
                    stop.record()
                    stop.synchronize()
                    us = start.elapsed_time(stop) * 1e3 / 20
                    floor = kv_bytes / 4.2e6 / us
                print(f"{heads:>3}/{kv_heads:<2} {mode:>6} {tile:>8} {us:8.1f} {floor:6.2f} "
                      f"{err:8.4f} {hints if hints != ':' else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
