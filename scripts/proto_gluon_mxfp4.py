"""Prototype (Gluon, Triton 3.6's explicit-layout dialect): MXFP4 weights decoded straight into
wgmma's A-operand registers, so no weight passes through shared memory.

Triton's ``tl.dot`` moves a tile decoded in registers to shared memory element by element
(``STS.U16``, one per weight) before its MMA, whichever operand the weights are
(``scripts/sass_loop.py``; BENCHMARKS.md, thirty-sixth and thirty-seventh sessions): the
reason gpt-oss's MXFP4 expert GEMMs run at 0.16 of their byte floor at decode sizes. Hopper's
wgmma takes its A operand from registers, and Gluon lets a kernel build a tensor in that
operand's layout. Here ``out^T [64, BM] = W [64, 32] @ x^T [32, BM]`` a K step: W the weights
(the MMA's M, 64 output features a warpgroup), x the tokens (its N, 16-64).

The words are repacked once (:func:`repack_words`, as Marlin-style kernels do at load): word
``c`` of each group of 32 inputs holds inputs ``16h + 8g + 2c + e`` in code slot ``4h + 2g +
e``, exactly the K values one thread's A fragment holds for a row in a K32 step. A thread then
loads one word a row (two: rows ``r`` and ``r + 8``) and one scale byte a row, shifts the eight
codes out in registers, and a reshape and permute of that ``[64, 4, 8]`` tile give the
``[64, 32]`` operand in wgmma's layout with no data movement (``convert_layout(...,
assert_trivial=True)`` compiles). For sm_90 (``python scripts/proto_gluon_mxfp4.py``, no GPU
needed): 2 ``LDG.E`` of words and 2 of scales a thread a step, ``HGMMA.64xBMx16`` with A from
registers, shared memory only for x's tile (``STS.128``) and the epilogue.

Not done: pipelining (the loads of step ``i + 1`` in flight during step ``i``'s MMA), split-K
for few tiles, the MoE's routing (an expert's aligned rows as N). ``--run`` (a CUDA machine):
the kernel against the dequantized weights on a dense [N, K] x [M, K] product, and its time
beside ``torch`` on the bf16 weights; ``--check-repack`` (CPU): the repack and the kernel's
index arithmetic, replayed in torch, give the weights back.
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
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sass_loop import _nvdisasm  # noqa: E402

#: Input (within a group of 32) of each (word c, slot j) of a repacked group: c * 8 + j ->
#: 16h + 8g + 2c + e for j = 4h + 2g + e.
REPACK_ORDER = [16 * h + 8 * g + 2 * c + e for c in range(4) for h in range(2)
                for g in range(2) for e in range(2)]


def repack_words(w: torch.Tensor) -> torch.Tensor:
    """MXFP4 words ``[..., K / 8]`` (int32, 8 codes a word, input ``8 * word + slot``) with
    each group of 32 inputs reordered as the kernel reads them (module docstring)."""
    shifts = torch.arange(0, 32, 4, device=w.device, dtype=torch.int32)
    codes = ((w[..., None] >> shifts) & 15).reshape(*w.shape[:-1], -1, 32)
    order = torch.tensor(REPACK_ORDER, device=w.device)
    packed = codes[..., order].reshape(*w.shape, 8).to(torch.int64) << shifts.to(torch.int64)
    return packed.sum(-1).to(torch.int32)  # (the top slot's sign bit wraps as int32's)


@gluon.jit
def mxfp4_rs_kernel(w_ptr, s_ptr, x_ptr, o_ptr, K: int, N: int,  # type: ignore[no-untyped-def]
                    BM: gl.constexpr) -> None:
    """``o [BM, N] = x [BM, K] @ W.T``: W MXFP4, repacked int32 words ``[N, K / 8]``
    (:func:`repack_words`) with uint8 e8m0 scales ``[N, K / 32]``; a program per 64 features,
    K steps of one group (32)."""
    BN: gl.constexpr = 64
    BK: gl.constexpr = 32
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BM, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    # [features, word c, slot j]: slot bits and row + 8 in registers (in the fragment's
    # register order), c and rows 0-7 across lanes, rows 16 and 32 across warps
    l3: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [8, 0, 0], [0, 0, 2], [0, 0, 4]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]], block_bases=[], shape=[64, 4, 8])
    wl: gl.constexpr = gl.SliceLayout(2, l3)
    xb: gl.constexpr = gl.BlockedLayout([8, 1], [8, 4], [1, 4], [0, 1])
    x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BM], gl.bfloat16,
                                                              transposed=True)
    pid = gl.program_id(0)
    rn = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, wl))
    rc = gl.arange(0, 4, layout=gl.SliceLayout(0, wl))
    slots = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, l3)))
    xk = gl.arange(0, BK, layout=gl.SliceLayout(1, xb))
    xm = gl.arange(0, BM, layout=gl.SliceLayout(0, xb))
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [BK, BM], x_sl)
    acc = gl.zeros([BN, BM], gl.float32, layout=mma)
    for k0 in range(0, K, BK):
        words = gl.load(w_ptr + rn[:, None] * (K // 8) + (k0 // 8 + rc)[None, :])
        q = (gl.expand_dims(words, 2) >> (slots * 4)[None, None, :]) & 15
        e = (q >> 1) & 3
        m = (q & 1).to(gl.float32)
        mag = gl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * gl.exp2((e - 1).to(gl.float32)))
        val = gl.where((q >> 3) == 1, -mag, mag)
        s = gl.load(s_ptr + rn * (K // 32) + k0 // 32).to(gl.int32)
        v = (val * (s << 23).to(gl.float32, bitcast=True)[:, None, None]).to(gl.bfloat16)
        # [n, c, j = (h, g, e)] -> [n, k = 16h + 8g + 2c + e]: the operand, no data moved
        v = gl.reshape(gl.permute(gl.reshape(v, [BN, 4, 2, 2, 2]), [0, 2, 3, 1, 4]), [BN, BK])
        a = gl.convert_layout(v, a_l, assert_trivial=True)
        x_smem.store(gl.load(x_ptr + xm[None, :] * K + (k0 + xk)[:, None]))
        fence_async_shared()
        acc = warpgroup_mma(a, x_smem, acc)
    ob: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    out = gl.convert_layout(acc, ob)
    on = pid * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, ob))
    om = gl.arange(0, BM, layout=gl.SliceLayout(0, ob))
    gl.store(o_ptr + om[None, :] * N + on[:, None], out)


PTRS = {"w_ptr": "*i32", "s_ptr": "*u8", "x_ptr": "*bf16", "o_ptr": "*fp32"}


def sass_counts(bm: int) -> dict[str, int]:
    """Loads, stores, shuffles and MMAs of the whole kernel for sm_90 (no GPU needed)."""
    fn = mxfp4_rs_kernel
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(PTRS)
    sig["BM"] = "constexpr"
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in (*PTRS, "K", "N")}
    kernel = triton.compile(GluonASTSource(fn, sig, {(fn.arg_names.index("BM"),): bm}, attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        text = subprocess.run([_nvdisasm(), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    ops = r"\b((?:STS|LDS|LDSM|LDG|HGMMA|SHFL)(?:\.[A-Z0-9x]+)*)\b"
    return dict(collections.Counter(re.findall(ops, text)))


def check_repack() -> None:
    """The kernel's reading of repacked words, replayed in torch, gives the weights back."""
    from mrv2_kernels.fused_moe_int import dequantize_int_experts

    g = torch.Generator().manual_seed(0)
    w = torch.randint(-2**31, 2**31 - 1, (1, 64, 16), dtype=torch.int32, generator=g)
    s = torch.randint(118, 124, (1, 64, 4), generator=g).to(torch.uint8)
    want = dequantize_int_experts(w, s, None, 4, 32, torch.float32, fp4=True)[0]
    r = repack_words(w[0])  # [64, 16]: 4 groups of 4 words
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = (r.reshape(64, 4, 4)[..., None] >> shifts) & 15  # [n, group, c, j]
    logical = codes.reshape(64, 4, 4, 2, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(64, -1)
    got = dequantize_int_experts(
        (logical.reshape(64, -1, 8).to(torch.int64) << shifts.to(torch.int64)).sum(-1)
        .to(torch.int32)[None], s, None, 4, 32, torch.float32, fp4=True)[0]
    assert torch.equal(got, want), "the repack and the kernel's reading disagree"
    print("repack: the kernel's reading gives the weights back")


def run(n: int, k: int, rows: list[int]) -> None:
    """Correctness against the dequantized weights, and µs beside torch on bf16 weights."""
    from triton.testing import do_bench

    from mrv2_kernels.mxfp4_dense import dequantize_mxfp4

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randint(-2**31, 2**31 - 1, (1, n, k // 8), device="cuda", dtype=torch.int32,
                      generator=g)
    s = torch.randint(118, 124, (1, n, k // 32), device="cuda", generator=g).to(torch.uint8)
    dense = dequantize_mxfp4(w, s, torch.bfloat16)[0]
    packed = repack_words(w[0]).contiguous()

    def launch(x: torch.Tensor, out: torch.Tensor) -> None:
        mxfp4_rs_kernel[(n // 64,)](packed, s[0], x, out, k, n, BM=x.shape[0], num_warps=4)

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
    p.add_argument("--check-repack", action="store_true", help="the index arithmetic, on CPU")
    p.add_argument("--shape", type=int, nargs=2, default=[5760, 2880], metavar=("N", "K"))
    p.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64])
    args = p.parse_args()
    if args.run:
        run(*args.shape, args.rows)
    elif args.check_repack:
        check_repack()
    else:
        for bm in (16, 32, 64):
            print(f"64 features x {bm} rows x K 32:", sass_counts(bm))


if __name__ == "__main__":
    main()
