"""Prototype (Gluon, Triton 3.6's explicit-layout dialect): causal prefill attention for Hopper
written the way FlashAttention-3 schedules it, against issue 16's 450 TFLOP/s target.

``mrv2_kernels.prefill_attention`` (Triton, TMA loads) reads 341 TFLOP/s on the issue's case
(4 x 1,024 causal tokens, Qwen3-8B heads, H200); Triton's ``tl.dot`` pipeline issues each
tile's two products one after the other and waits for each, so the softmax's exponentials
(MUFU) and the tensor cores take turns. Here a program owns 128 query rows of one head (two
warpgroups of 64 rows, 8 warps) and per key tile:

- the keys and values arrive by TMA into a ring of ``STAGES`` shared-memory slots, each slot's
  copy issued ``STAGES - 1`` tiles ahead and awaited on its mbarrier;
- ``S_j = Q K_j^T`` is issued asynchronously, then ``O += P_{j-1} V_{j-1}`` (P from
  registers: wgmma's A operand, no shared-memory round trip), then only S is awaited: the
  softmax of tile j runs while the tensor cores still do tile j - 1's second product
  (FlashAttention-3's intra-warpgroup overlap);
- the causal mask is applied on the last (diagonal) tile only (query and key tiles are the
  same size, so exactly one tile is masked).

Only the step's own keys (a request's whole prompt in the step: the issue's metric); keys from
the cache (a chunk after earlier chunks, a prefix hit) are the Triton kernel's. ``python
scripts/proto_gluon_prefill.py`` (no GPU needed) compiles it for sm_90 and prints shared
memory, registers and the SASS's MMA / shared-memory instruction counts; ``--run`` (CUDA):
checks it against fp32 attention in torch and times it (``do_bench_cudagraph``) beside the
Triton TMA kernel on the same inputs.
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_loop import _nvdisasm  # noqa: E402

LOG2E = 1.4426950408889634


@gluon.jit
def _softmax_tile(s, m_i, l_i, qk_scale,  # type: ignore[no-untyped-def]
                  keep, MASK: gl.constexpr, FIRST: gl.constexpr):
    """One key tile's online-softmax update (base 2): returns P (fp32), the new max and sum,
    and the factor the running output must be scaled by."""
    s = s * qk_scale
    if MASK:
        s = gl.where(keep, s, -float("inf"))
    m_tile = gl.max(s, axis=1)
    m_new = m_tile if FIRST else gl.maximum(m_i, m_tile)
    p = gl.exp2(s - m_new[:, None])
    if FIRST:
        alpha = gl.full_like(m_new, 1.0)
        l_new = gl.sum(p, axis=1)
    else:
        alpha = gl.exp2(m_i - m_new)
        l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def attn_fwd_kernel(q_desc, k_desc, v_desc, o_ptr, qsl_ptr,  # type: ignore[no-untyped-def]
                    qk_scale, num_q_tiles, stride_ot,
                    GROUP: gl.constexpr, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr,
                    STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                    TILES_LAST: gl.constexpr = False) -> None:
    """``o [T, H, D]`` = causal attention of the fused-QKV views ``q`` ``[T, H*D]``, ``k`` /
    ``v`` ``[T, Hk*D]`` for requests at ``qsl`` (cumulative query starts); a program per
    (query tile, head, request), the heaviest tiles first."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, BLOCK, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                  instr_shape=[16, HEAD_DIM, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    if TILES_LAST:  # grid (head, request, query tile): the whole grid's heaviest tiles first
        q_tile = num_q_tiles - 1 - gl.program_id(2)
        head = gl.program_id(0)
        req = gl.program_id(1)
    else:  # grid (query tile, head, request): heaviest first within each head
        q_tile = num_q_tiles - 1 - gl.program_id(0)
        head = gl.program_id(1)
        req = gl.program_id(2)
    q_start = gl.load(qsl_ptr + req)
    qlen = gl.load(qsl_ptr + req + 1) - q_start
    tile_start = q_tile * BLOCK
    if tile_start < qlen:
        col = (head // GROUP) * HEAD_DIM
        n_tiles = q_tile + 1  # key tiles 0..q_tile; the last is the diagonal one
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK, HEAD_DIM],
                                           k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK, HEAD_DIM],
                                           v_desc.layout)
        # barriers: K slots, V slots, Q
        bars = gl.allocate_shared_memory(gl.int64, [2 * STAGES + 1, 1],
                                         mbarrier.MBarrierLayout())
        for i in gl.static_range(2 * STAGES + 1):
            mbarrier.init(bars.index(i), count=1)
        q_bar = bars.index(2 * STAGES)
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_start + tile_start, head * HEAD_DIM], q_bar,
                                        q_smem)
        tile_bytes: gl.constexpr = k_desc.block_type.nbytes
        for i in gl.static_range(STAGES):
            go = i < n_tiles
            mbarrier.expect(bars.index(i), tile_bytes, pred=go)
            tma.async_copy_global_to_shared(k_desc, [q_start + i * BLOCK, col], bars.index(i),
                                            k_smem.index(i), pred=go)
            mbarrier.expect(bars.index(STAGES + i), tile_bytes, pred=go)
            tma.async_copy_global_to_shared(v_desc, [q_start + i * BLOCK, col],
                                            bars.index(STAGES + i), v_smem.index(i), pred=go)

        rows = tile_start + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, s_l))
        cols = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, s_l))
        keep = (tile_start + cols)[None, :] <= rows[:, None]  # the diagonal tile's mask
        zero_s = gl.zeros([BLOCK, BLOCK], gl.float32, s_l)
        mbarrier.wait(q_bar, 0)

        # Tile 0 alone (its softmax has nothing to overlap with).
        mbarrier.wait(bars.index(0), 0)
        s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False)
        gl.thread_barrier()  # both warpgroups are done with K slot 0: refill it
        go = n_tiles > STAGES
        mbarrier.expect(bars.index(0), tile_bytes, pred=go)
        tma.async_copy_global_to_shared(k_desc, [q_start + STAGES * BLOCK, col], bars.index(0),
                                        k_smem.index(0), pred=go)
        m_i = gl.max(s, axis=1)
        if n_tiles == 1:
            p, m_i, l_i, alpha = _softmax_tile(s, m_i, m_i, qk_scale, keep, True, True)
        else:
            p, m_i, l_i, alpha = _softmax_tile(s, m_i, m_i, qk_scale, keep, False, True)
        acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, o_l)
        for j in range(1, n_tiles):
            ks = j % STAGES
            vs = (j - 1) % STAGES
            mbarrier.wait(bars.index(ks), (j // STAGES) & 1)
            s_tok = warpgroup_mma(q_smem, k_smem.index(ks).permute((1, 0)), zero_s,
                                  use_acc=False, is_async=True)
            mbarrier.wait(bars.index(STAGES + vs), ((j - 1) // STAGES) & 1)
            p_op = gl.convert_layout(p.to(gl.bfloat16), p_l)
            o_tok = warpgroup_mma(p_op, v_smem.index(vs), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s_tok])
            # K_j read by every warpgroup: its slot takes K_{j + STAGES}
            gl.thread_barrier()
            go = j + STAGES < n_tiles
            mbarrier.expect(bars.index(ks), tile_bytes, pred=go)
            tma.async_copy_global_to_shared(k_desc, [q_start + (j + STAGES) * BLOCK, col],
                                            bars.index(ks), k_smem.index(ks), pred=go)
            if j == n_tiles - 1:
                p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, keep, True, False)
            else:
                p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qk_scale, keep, False, False)
            acc = warpgroup_mma_wait(0, deps=[o_tok])
            # V_{j-1} read by every warpgroup: its slot takes V_{j - 1 + STAGES}
            gl.thread_barrier()
            go = j - 1 + STAGES < n_tiles
            mbarrier.expect(bars.index(STAGES + vs), tile_bytes, pred=go)
            tma.async_copy_global_to_shared(v_desc, [q_start + (j - 1 + STAGES) * BLOCK, col],
                                            bars.index(STAGES + vs), v_smem.index(vs), pred=go)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_l))[:, None]
        last = n_tiles - 1
        mbarrier.wait(bars.index(STAGES + last % STAGES), (last // STAGES) & 1)
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_l)
        acc = warpgroup_mma(p_op, v_smem.index(last % STAGES), acc)
        for i in gl.static_range(2 * STAGES + 1):
            mbarrier.invalidate(bars.index(i))

        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_l))
        out = (acc / l_o[:, None]).to(gl.bfloat16)
        ob: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
        out = gl.convert_layout(out, ob)
        tok = tile_start + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, ob))
        d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ob))
        ptrs = o_ptr + (q_start + tok).to(gl.int64)[:, None] * stride_ot + head * HEAD_DIM \
            + d[None, :]
        gl.store(ptrs, out, mask=(tok < qlen)[:, None])


def _layout(block: list[int]) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
           qsl: torch.Tensor, max_len: int, scale: float, *, heads: int, kv_heads: int,
           block: int = 128, stages: int = 2, tiles_last: bool = False) -> None:
    """``q`` ``[T, H*D]``, ``k`` / ``v`` ``[T, Hk*D]`` (strided views of one fused QKV
    buffer), ``out`` ``[T, H*D]``; a warpgroup per 64 query rows."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    num_warps = block // 16
    d = q.shape[1] // heads
    descs = [TensorDescriptor(t, list(t.shape), [t.stride(0), 1], [block, d],
                              _layout([block, d])) for t in (q, k, v)]
    num_q_tiles = triton.cdiv(max_len, block)
    nreq = qsl.numel() - 1
    grid = (heads, nreq, num_q_tiles) if tiles_last else (num_q_tiles, heads, nreq)
    attn_fwd_kernel[grid](
        *descs, out, qsl, scale * LOG2E, num_q_tiles, out.stride(0),
        GROUP=heads // kv_heads, BLOCK=block, HEAD_DIM=d, STAGES=stages, NUM_WARPS=num_warps,
        TILES_LAST=tiles_last, num_warps=num_warps)


def sass_report(block: int, stages: int, head_dim: int = 128) -> str:
    """Compiled for sm_90 without a GPU: shared memory, registers, spills and instruction
    counts."""
    fn = attn_fwd_kernel
    lay = _layout([block, head_dim])
    from triton.experimental.gluon.language.nvidia.hopper.tma import tensor_descriptor_type

    desc_t = f"tensordesc<bf16[{block}, {head_dim}],{lay!r}>"
    del tensor_descriptor_type
    sig = {"q_desc": desc_t, "k_desc": desc_t, "v_desc": desc_t, "o_ptr": "*bf16",
           "qsl_ptr": "*i32", "qk_scale": "fp32", "num_q_tiles": "i32", "stride_ot": "i32"}
    consts = {"GROUP": 4, "BLOCK": block, "HEAD_DIM": head_dim, "STAGES": stages,
              "NUM_WARPS": block // 16}
    sig.update({n: "constexpr" for n in consts})
    cidx = {(fn.arg_names.index(n),): v for n, v in consts.items()}
    kernel = triton.compile(GluonASTSource(fn, sig, cidx, {}),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": block // 16})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([_nvdisasm(), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([str(Path(_nvdisasm()).with_name("cuobjdump")),
                                "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    ops = r"\b((?:STS|LDS|LDSM|HGMMA|SHFL|MUFU|BAR|SYNCS|WARPGROUP)(?:\.[A-Z0-9x]+)*)\b"
    counts = dict(collections.Counter(re.findall(ops, text)))
    meta = kernel.metadata
    return (f"block {block} stages {stages}: shared {meta.shared} B, "
            f"regs {regs and regs.group(1)}, {usage.strip().splitlines()[-1].strip()}; {counts}")


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qsl: list[int], heads: int,
              kv_heads: int, scale: float) -> torch.Tensor:
    """fp32 causal attention per request (GQA by repeat)."""
    d = q.shape[1] // heads
    out = torch.empty(q.shape[0], heads, d, dtype=torch.float32, device=q.device)
    for a, b in zip(qsl[:-1], qsl[1:], strict=True):
        qq = q[a:b].float().view(b - a, heads, d).transpose(0, 1)
        kk = k[a:b].float().view(b - a, kv_heads, d).transpose(0, 1)
        vv = v[a:b].float().view(b - a, kv_heads, d).transpose(0, 1)
        kk = kk.repeat_interleave(heads // kv_heads, 0)
        vv = vv.repeat_interleave(heads // kv_heads, 0)
        att = (qq @ kk.transpose(1, 2)) * scale
        mask = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        out[a:b] = (att @ vv).transpose(0, 1)
    return out.view(q.shape[0], heads * d)


def run(lens: list[int], heads: int, kv_heads: int, configs: list[tuple[int, int, bool]]) -> None:
    from triton.testing import do_bench_cudagraph

    from mrv2_kernels.prefill_attention import prefill_attention_tma

    d = 128
    g = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lens)
    qkv = torch.randn(total, (heads + 2 * kv_heads) * d, device="cuda", dtype=torch.bfloat16,
                      generator=g)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    qsl_list = [0]
    for n in lens:
        qsl_list.append(qsl_list[-1] + n)
    qsl = torch.tensor(qsl_list, device="cuda", dtype=torch.int32)
    scale = d ** -0.5
    want = reference(q, k, v, qsl_list, heads, kv_heads, scale)
    flops = sum(4 * heads * d * n * (n + 1) // 2 for n in lens)
    for block, stages, last in configs:
        out = torch.full((total, heads * d), float("nan"), device="cuda", dtype=torch.bfloat16)
        launch(q, k, v, out, qsl, max(lens), scale, heads=heads, kv_heads=kv_heads,
               block=block, stages=stages, tiles_last=last)
        err = (out.float() - want).abs().max().item()
        ms = do_bench_cudagraph(functools.partial(
            launch, q, k, v, out, qsl, max(lens), scale, heads=heads, kv_heads=kv_heads,
            block=block, stages=stages, tiles_last=last))
        print(f"gluon block {block} stages {stages}{' tiles last' if last else ''}: max err "
              f"{err:.2e}; {ms * 1e3:.1f} us, {flops / ms / 1e9:.1f} TFLOP/s")
    # the Triton TMA kernel on the same inputs (an empty cache: no earlier keys)
    kv_cache = torch.zeros(2, 1, 16, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
    bt = torch.zeros(len(lens), 1, device="cuda", dtype=torch.int32)
    o3 = torch.empty(total, heads, d, device="cuda", dtype=torch.bfloat16)

    for last in (False, True):
        triton_tma = functools.partial(
            prefill_attention_tma, q.view(total, heads, d), k, v, kv_cache, qsl, seq_lens, bt,
            scale, max_query_len=max(lens), num_reqs=len(lens), out=o3, tiles_last=last)
        o3.fill_(float("nan"))
        triton_tma()
        err = (o3.view(total, -1).float() - want).abs().max().item()
        ms = do_bench_cudagraph(triton_tma)
        print(f"triton TMA kernel (64 x 64){' tiles last' if last else ''}: max err {err:.2e}; "
              f"{ms * 1e3:.1f} us, {flops / ms / 1e9:.1f} TFLOP/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="store_true", help="on a CUDA machine: check and time")
    p.add_argument("--lens", type=int, nargs="+", default=[1024] * 4)
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("H", "HK"))
    p.add_argument("--configs", nargs="+", default=["128:2", "64:2", "64:3"],
                   help="BLOCK:STAGES, or BLOCK:STAGES:last (the grid's tile axis slowest)")
    args = p.parse_args()
    configs = [(int(c.split(":")[0]), int(c.split(":")[1]), c.endswith(":last"))
               for c in args.configs]
    if args.run:
        run(args.lens, *args.heads, configs)
    else:
        for block, stages, _ in configs:
            print(sass_report(block, stages))


if __name__ == "__main__":
    main()
