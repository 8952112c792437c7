"""Prototype (H200): does prefetching a layer's MLP weights into L2 during its attention make a
batch-1 decode step faster?

A batch-1 step of a small model is a chain of latency-bound kernels; each GEMV reads its
weights from HBM only once it starts. Attention (plus its split combine) uses almost no
bandwidth for ~6 us a layer. Here a side-stream kernel, forked after each layer's qkv GEMV,
asks L2 to fetch that layer's o / gate-up / down weights (and the next layer's qkv), so the
GEMVs after attention read them from L2. The real decode kernels of mrv2 run the layer chain
(Qwen3-0.6B shapes, one request of --keys cached keys) in one CUDA graph per variant:

* ``none``: no prefetch (today's step);
* ``bulk``: ``cp.async.bulk.prefetch.L2`` (one instruction per program and region);
* ``lines``: ``prefetch.global.L2`` per 128-byte line;
* ``hot``: every layer uses layer 0's weights (all L2 hits: the bound of what L2 can give).

Prints the median graph replay time per variant (and per layer).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from mrv2_kernels.norm_gemv import decode_linear, norm_gemv
from mrv2_kernels.paged_attention import paged_attention
from mrv2_kernels.paged_attention_plan import FusedRope

_BULK = tl.constexpr("""{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0;
@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }""")
_LINE = tl.constexpr("prefetch.global.L2 [$1]; mov.u32 $0, 0;")


@triton.jit
def _prefetch_region(base, nbytes, pid, nprog, BULK: tl.constexpr, LINES: tl.constexpr):
    chunk = tl.cdiv(tl.cdiv(nbytes, nprog), 4096) * 4096
    lo = pid * chunk
    size = tl.minimum(chunk, nbytes - lo)
    if size > 0:
        if BULK:
            tl.inline_asm_elementwise(_BULK, "=r,l,r", [base + lo, size.to(tl.int32)],
                                      dtype=tl.int32, is_pure=False, pack=1)
        else:
            for off in range(0, size, LINES * 128):
                offs = off + tl.arange(0, LINES) * 128
                ptrs = base + lo + tl.where(offs < size, offs, 0)
                tl.inline_asm_elementwise(_LINE, "=r,l", [ptrs], dtype=tl.int32,
                                          is_pure=False, pack=1)


@triton.jit
def _prefetch_kernel(p0, n0, p1, n1, p2, n2, p3, n3, BULK: tl.constexpr, LINES: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    _prefetch_region(p0, n0, pid, nprog, BULK, LINES)
    _prefetch_region(p1, n1, pid, nprog, BULK, LINES)
    _prefetch_region(p2, n2, pid, nprog, BULK, LINES)
    _prefetch_region(p3, n3, pid, nprog, BULK, LINES)


def prefetch(tensors: list[torch.Tensor], mode: str, programs: int) -> None:
    args: list[object] = []
    for t in tensors:
        args += [t.view(torch.uint8).reshape(-1), t.numel() * t.element_size()]
    while len(args) < 8:
        args += [tensors[0].view(torch.uint8).reshape(-1), 0]
    _prefetch_kernel[(programs,)](*args, BULK=mode == "bulk", LINES=1024, num_warps=4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--keys", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=3072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--programs", type=int, default=32)
    ap.add_argument("--variants", nargs="+", default=["none", "bulk", "lines", "hot", "none"])
    ap.add_argument("--max-seq-len", type=int, default=4096, help="the plan's bound (graphs)")
    ap.add_argument("--next-qkv", type=int, default=1, help="also prefetch the next qkv")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt, d = torch.device("cuda"), torch.bfloat16, 128
    hid, inter, nh, nkv = args.hidden, args.inter, args.heads, args.kv_heads
    qkv_n = (nh + 2 * nkv) * d

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=dev) * 0.02).to(dt)

    layers = [dict(qkv=rnd(qkv_n, hid), o=rnd(hid, nh * d), gu=rnd(2 * inter, hid),
                   down=rnd(hid, inter), ln1=1 + rnd(hid), ln2=1 + rnd(hid),
                   qn=1 + rnd(d), kn=1 + rnd(d)) for _ in range(args.layers)]
    bs, nblk = 16, triton.cdiv(args.keys + 1, 16) + 1
    caches = [rnd(2, nblk, bs, nkv, d) for _ in range(args.layers)]
    bt = torch.arange(nblk, device=dev, dtype=torch.int32)[None]
    qsl = torch.tensor([0, 1], device=dev, dtype=torch.int32)
    seq_lens = torch.tensor([args.keys + 1], device=dev, dtype=torch.int32)
    pos = torch.tensor([args.keys], device=dev, dtype=torch.int64)
    slots = torch.tensor([args.keys], device=dev, dtype=torch.int64)
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
    ang = torch.arange(4096, device=dev).float()[:, None] * inv[None]
    cos_sin = torch.cat([ang.cos(), ang.sin()], -1).contiguous()
    x0 = rnd(1, hid)
    side = torch.cuda.Stream()

    def step(variant: str) -> torch.Tensor:
        h, res = x0.clone(), None
        forked = False
        for i in range(args.layers):
            w = layers[0] if variant == "hot" else layers[i]
            if res is None:
                qkv, res = norm_gemv(h, w["qkv"], norm_weight=w["ln1"], eps=1e-6)
            else:
                qkv, res = norm_gemv(h, w["qkv"], norm_weight=w["ln1"], eps=1e-6, residual=res)
            if variant in ("bulk", "lines"):
                regions = [w["o"], w["gu"], w["down"]]
                if args.next_qkv and i + 1 < args.layers:
                    regions.append(layers[i + 1]["qkv"])
                side.wait_stream(torch.cuda.current_stream())
                forked = True
                with torch.cuda.stream(side):
                    prefetch(regions, variant, args.programs)
            q, k, v = qkv.split([nh * d, nkv * d, nkv * d], -1)
            attn = paged_attention(
                q.view(1, nh, d), caches[i], qsl, seq_lens, bt, d ** -0.5, max_query_len=1,
                max_seq_len=args.max_seq_len, num_reqs=1, uniform_decode=True,
                num_splits=int(variant[5:]) if variant.startswith("split") else None,
                rope=FusedRope(pos, cos_sin, k, v, slots, (w["qn"], w["kn"], 1e-6)))
            o = decode_linear(attn.view(1, nh * d), w["o"])
            act, res = norm_gemv(o, w["gu"], norm_weight=w["ln2"], eps=1e-6, residual=res,
                                 gated=True)
            h = decode_linear(act, w["down"])
        if forked:
            torch.cuda.current_stream().wait_stream(side)
        return h

    import mrv2_kernels.paged_attention as pa

    class _NoLaunch:
        def __getitem__(self, grid: object) -> object:
            return lambda *a, **k: None

    combine = pa._combine_splits_kernel
    results: list[tuple[str, float]] = []
    for variant in args.variants:
        pa._combine_splits_kernel = _NoLaunch() if variant == "nocombine" else combine
        for _ in range(3):
            step(variant)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step(variant)
        ref = step("none") if variant in ("bulk", "lines") else None
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        if ref is not None:
            err = (out.float() - ref.float()).abs().max().item()
            assert err == 0.0, f"{variant}: output differs from the eager chain by {err}"
        times = []
        for _ in range(30):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(20):
                graph.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 20 * 1000)
        results.append((variant, statistics.median(times)))
        del graph
    mb = sum(t.numel() * 2 for t in layers[0].values()) / 1e6
    print(f"layers {args.layers}, keys {args.keys}, programs {args.programs}, "
          f"{mb:.1f} MB of weights a layer")
    print(f"{'variant':8} {'step us':>9} {'us/layer':>9}")
    for name, us in results:
        print(f"{name:8} {us:9.1f} {us / args.layers:9.2f}")


if __name__ == "__main__":
    main()
