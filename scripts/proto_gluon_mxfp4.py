"""Prototype (Gluon, Triton 3.6's explicit-layout dialect): an MXFP4 weight tile decoded
straight into wgmma's A-operand registers, so the weights never pass through shared memory.

Triton's ``tl.dot`` moves a tile decoded in registers to shared memory element by element
(``STS.U16``, one per weight) before its MMA, whichever operand the weights are
(``scripts/sass_loop.py``; BENCHMARKS.md, thirty-sixth and thirty-seventh sessions): the
reason gpt-oss's MXFP4 expert GEMMs run at 0.16 of their byte floor at decode sizes. Hopper's
wgmma takes its A operand from registers, and Gluon lets a kernel build a tensor in that
operand's layout: here ``out^T [BN, BM] = W [BN, BK] @ x^T [BK, BM]``, W the weights (the MMA's
M = 64 output features a warpgroup), x the tokens (its N: 16-64). Offline, for sm_90
(``python scripts/proto_gluon_mxfp4.py``): one ``HGMMA.64xBMx16`` a K16 with A from registers,
no shared-memory store of a weight (only x's tile and the epilogue use shared memory).

Not done: each thread loads the word of each of its pairs of K values (4 words a row a K32
step, each read by 4 threads; from L1). Repacking the words at load time so that word ``c`` of
each group of 32 holds inputs ``2c, 2c+1, 2c+8, 2c+9, 16+2c, 17+2c, 24+2c, 25+2c`` (one
thread's A fragment in a K32 step) puts every value a thread needs in one word a row; tried
with per-element addressing, the compiler did not merge the equal loads (10 ``LDG.E`` a
thread instead of 8), so the words need a layout of their own, ``[BN, BK / 8]`` one word a
thread a row, expanded into the operand layout (a linear layout Gluon can express).

``--run`` (a CUDA machine): the kernel against the dequantized reference on a dense
[N, K] x [M, K] product, and its time beside ``torch`` on the dequantized bf16 weights.
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

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_loop import _nvdisasm  # noqa: E402


@gluon.jit
def mxfp4_rs_kernel(w_ptr, s_ptr, x_ptr, o_ptr, K: int, N: int,  # type: ignore[no-untyped-def]
                    BN: gl.constexpr, BM: gl.constexpr, BK: gl.constexpr) -> None:
    """``o [BM, N] = x [BM, K] @ W.T``: W MXFP4 int32 words ``[N, K / 8]`` (8 codes a word,
    low nibble first) with uint8 e8m0 scales ``[N, K / 32]``; one program per BN features."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BM, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    xb: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
    x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BM], gl.bfloat16,
                                                              transposed=True)
    pid = gl.program_id(0)
    rn = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, a_l))
    rk = gl.arange(0, BK, layout=gl.SliceLayout(0, a_l))
    xk = gl.arange(0, BK, layout=gl.SliceLayout(1, xb))
    xm = gl.arange(0, BM, layout=gl.SliceLayout(0, xb))
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [BK, BM], x_sl)
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        words = gl.load(w_ptr + rn[:, None] * (K // 8) + (kk // 8)[None, :])
        q = (words >> ((kk % 8) * 4)[None, :]) & 15
        e = (q >> 1) & 3
        m = (q & 1).to(gl.float32)
        mag = gl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * gl.exp2((e - 1).to(gl.float32)))
        val = gl.where((q >> 3) == 1, -mag, mag)
        s = gl.load(s_ptr + rn[:, None] * (K // 32) + (kk // 32)[None, :]).to(gl.int32)
        a = (val * (s << 23).to(gl.float32, bitcast=True)).to(gl.bfloat16)
        x_smem.store(gl.load(x_ptr + xm[None, :] * K + (k0 + xk)[:, None]))
        fence_async_shared()
        acc = warpgroup_mma(a, x_smem, acc)
    ob: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    out = gl.convert_layout(acc, ob)
    on = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ob))
    om = gl.arange(0, BM, layout=gl.SliceLayout(0, ob))
    gl.store(o_ptr + om[None, :] * N + on[:, None], out)


PTRS = {"w_ptr": "*i32", "s_ptr": "*u8", "x_ptr": "*bf16", "o_ptr": "*fp32"}


def sass_counts(bm: int, bk: int) -> dict[str, int]:
    """Loads, stores and MMAs of the kernel for sm_90 (the whole kernel), no GPU needed."""
    fn = mxfp4_rs_kernel
    consts = {"BN": 64, "BM": bm, "BK": bk}
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(PTRS)
    sig.update({k: "constexpr" for k in consts})
    const = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in (*PTRS, "K", "N")}
    kernel = triton.compile(GluonASTSource(fn, sig, const, attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([_nvdisasm(), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    ops = r"\b((?:STS|LDS|LDSM|LDG|HGMMA)(?:\.[A-Z0-9x]+)*)\b"
    return dict(collections.Counter(re.findall(ops, text)))


def run(n: int, k: int, rows: list[int]) -> None:
    """Correctness against the dequantized weights, and µs beside torch on bf16 weights."""
    import torch
    from triton.testing import do_bench

    from mrv2_kernels.mxfp4_dense import dequantize_mxfp4

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randint(-2**31, 2**31 - 1, (1, n, k // 8), device="cuda", dtype=torch.int32,
                      generator=g)
    s = torch.randint(118, 124, (1, n, k // 32), device="cuda", generator=g).to(torch.uint8)
    dense = dequantize_mxfp4(w, s, torch.bfloat16)[0]
    def launch(x: torch.Tensor, out: torch.Tensor) -> None:
        mxfp4_rs_kernel[(n // 64,)](w, s, x, out, k, n, BN=64, BM=x.shape[0], BK=32,
                                    num_warps=4)

    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        out = torch.empty(m, n, device="cuda", dtype=torch.float32)
        launch(x, out)
        want = x.float() @ dense.float().T
        err = ((out - want).abs().max() / want.abs().max()).item()
        us = do_bench(functools.partial(launch, x, out)) * 1e3
        ref = do_bench(functools.partial(torch.matmul, x, dense.T)) * 1e3
        floor = n * k * (0.5 + 1 / 32) / 3.0e12 * 1e6
        print(f"rows {m}: max err {err:.1e}; {us:.1f} µs (bf16 torch {ref:.1f}; MXFP4 bytes "
              f"at 3 TB/s {floor:.1f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="store_true", help="on a CUDA machine: check and time")
    p.add_argument("--shape", type=int, nargs=2, default=[5760, 2880], metavar=("N", "K"))
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    args = p.parse_args()
    if args.run:
        run(*args.shape, args.rows)
        return
    for bm, bk in ((16, 32), (32, 64), (64, 64)):
        print(f"BN 64 x BM {bm} x BK {bk}:", sass_counts(bm, bk))


if __name__ == "__main__":
    main()
