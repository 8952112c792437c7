"""Prototype (H200 only) behind mrv2_kernels.prefill_attention's tile choices: causal varlen
prefill attention over the step's own contiguous q/k/v (no paged cache), TMA descriptor loads
or pointer loads, optional warp specialization, one config per process (a compile that fails
or hangs costs only its own run). TFLOP/s at 4 x 1,024 tokens, Qwen3-8B heads; the paged
kernel's number comes from ``python -m mrv2_kernels.bench_attention --no-decode``.
BENCHMARKS.md 2026-12-02 has the sweeps (the configs here are the second one).

python scripts/proto_prefill.py --config I   (one config; prints one line)
python scripts/proto_prefill.py --list       (how many configs)
"""

from __future__ import annotations

import argparse
import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _step(q, k, v, acc, m_i, l_i, qk_scale, offs_m, offs_n, MASK: tl.constexpr):
    qk = tl.dot(q, tl.trans(k))
    if MASK:
        qk = tl.where(offs_n[None, :] <= offs_m[:, None], qk, -1.0e6)
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _fa_kernel(q_desc, k_desc, v_desc, q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, stride_t,
               stride_ot, qk_scale, num_tiles,
               GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
               TMA: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr):
    tile = num_tiles - 1 - tl.program_id(0)
    head = tl.program_id(1)
    req = tl.program_id(2)
    kvh = head // GROUP
    start = tl.load(cu_ptr + req)
    seq = tl.load(cu_ptr + req + 1) - start
    m0 = tile * BM
    if m0 >= seq:
        return
    offs_m = m0 + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    offs_nb = tl.arange(0, BN)
    if TMA:
        q = q_desc.load([start + m0, head * D])
    else:
        q = tl.load(q_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_t + head * D
                    + offs_d[None, :], mask=(offs_m < seq)[:, None], other=0.0)
    acc = tl.zeros([BM, D], tl.float32)
    m_i = tl.full([BM], -1.0e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    mid = (m0 // BN) * BN
    for n0 in tl.range(0, mid, BN, num_stages=STAGES, warp_specialize=WS):
        if TMA:
            k = k_desc.load([start + n0, kvh * D])
            v = v_desc.load([start + n0, kvh * D])
        else:
            rows = (start + n0 + offs_nb).to(tl.int64)[:, None] * stride_t + kvh * D \
                + offs_d[None, :]
            k = tl.load(k_ptr + rows)
            v = tl.load(v_ptr + rows)
        acc, m_i, l_i = _step(q, k, v, acc, m_i, l_i, qk_scale, offs_m, n0 + offs_nb, False)
    for n0 in tl.range(mid, tl.minimum(m0 + BM, seq), BN):
        offs_n = n0 + offs_nb
        if TMA:
            k = k_desc.load([start + n0, kvh * D])
            v = v_desc.load([start + n0, kvh * D])
        else:
            rows = (start + offs_n).to(tl.int64)[:, None] * stride_t + kvh * D + offs_d[None, :]
            ok = (offs_n < seq)[:, None]
            k = tl.load(k_ptr + rows, mask=ok, other=0.0)
            v = tl.load(v_ptr + rows, mask=ok, other=0.0)
        acc, m_i, l_i = _step(q, k, v, acc, m_i, l_i, qk_scale, offs_m, offs_n, True)
    o = acc / l_i[:, None]
    tl.store(out_ptr + (start + offs_m).to(tl.int64)[:, None] * stride_ot + head * D
             + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=(offs_m < seq)[:, None])


CONFIGS = [dict(tma=True, ws=False, bm=bm, bn=bn, warps=nw, stages=st)
           for bm, bn, nw, st in [(64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 5), (64, 128, 4, 2),
                                  (64, 128, 4, 3), (64, 128, 8, 3), (128, 64, 8, 4),
                                  (128, 128, 8, 4), (64, 32, 4, 4), (64, 64, 8, 3)]]
CONFIGS += [dict(tma=False, ws=False, bm=64, bn=64, warps=4, stages=st) for st in (3, 4)]


def run(cfg: dict, reqs: int, seq: int, heads: int, kv_heads: int, d: int) -> tuple[float, float]:
    torch.manual_seed(0)
    t = reqs * seq
    width = (heads + 2 * kv_heads) * d
    qkv = torch.randn(t, width, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :heads * d]
    k = qkv[:, heads * d:(heads + kv_heads) * d]
    v = qkv[:, (heads + kv_heads) * d:]
    out = torch.full((t, heads * d), float("nan"), device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, t + 1, seq, device="cuda", dtype=torch.int32)
    bm, bn = cfg["bm"], cfg["bn"]
    qd = TensorDescriptor(q, [t, heads * d], [width, 1], [bm, d])
    kd = TensorDescriptor(k, [t, kv_heads * d], [width, 1], [bn, d])
    vd = TensorDescriptor(v, [t, kv_heads * d], [width, 1], [bn, d])
    tiles = triton.cdiv(seq, bm)
    scale = d ** -0.5 * 1.4426950408889634

    def call() -> None:
        _fa_kernel[(tiles, heads, reqs)](qd, kd, vd, q, k, v, out, cu, width, out.stride(0),
                                         scale, tiles, GROUP=heads // kv_heads, BM=bm, BN=bn,
                                         D=d, TMA=cfg["tma"], WS=cfg["ws"],
                                         STAGES=cfg["stages"], num_warps=cfg["warps"])

    call()
    torch.cuda.synchronize()
    qs = q.view(reqs, seq, heads, d).transpose(1, 2).float()
    ks = k.view(reqs, seq, kv_heads, d).transpose(1, 2).float().repeat_interleave(
        heads // kv_heads, 1)
    vs = v.view(reqs, seq, kv_heads, d).transpose(1, 2).float().repeat_interleave(
        heads // kv_heads, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
    got = out.view(reqs, seq, heads, d).transpose(1, 2).float()
    err = (got - ref).abs().max().item()
    ms = triton.testing.do_bench_cudagraph(call, rep=100)
    flops = reqs * heads * 4 * d * seq * seq / 2
    return flops / ms / 1e9, err


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", type=int, default=None)
    p.add_argument("--list", action="store_true")
    p.add_argument("--reqs", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    a = p.parse_args()
    if a.list:
        print(len(CONFIGS))
        return
    cfg = CONFIGS[a.config]
    tf, err = run(cfg, a.reqs, a.seq, 32, 8, 128)
    print(f"{a.config:3d} {cfg}  {tf:7.1f} TFLOP/s  max err {err:.3g}"
          + ("" if math.isfinite(err) and err < 2e-2 else "  WRONG"))


if __name__ == "__main__":
    main()
