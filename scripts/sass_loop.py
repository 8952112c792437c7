"""A Triton kernel's instruction mix for an H100/H200, read offline (no GPU needed).

    python scripts/sass_loop.py            # the W4A16 one-row kernel, conversions vs bits

:func:`loop_mix` compiles ``fn`` for sm_90 (every argument a 32-bit integer unless named in
``ptrs`` or ``consts``, as ``tests/kernels/sm90.py`` does), disassembles the cubin with the
``nvdisasm`` Triton ships and counts the opcodes of the kernel's largest loop (a label and the
backward branch to it): what a step of the main loop issues per thread. Quarter-rate
conversions (``I2F``, ``F2F``), per-element shared-memory stores (``STS``) and address
arithmetic show up here long before a profiler run (BENCHMARKS.md, thirty-sixth session).
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

OPS = ("I2F", "I2FP", "F2F", "F2FP", "FMUL", "FFMA", "FADD", "HADD2", "HFMA2", "HMMA", "HGMMA",
       "LOP3", "SHF", "PRMT", "IMAD", "LDG", "LDGSTS", "LDS", "LDSM", "STS", "BAR", "SHFL")


def _nvdisasm() -> str:
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    if not path.exists():
        raise SystemExit(f"no nvdisasm at {path}")
    return str(path)


def loop_mix(fn: Any, ptrs: dict[str, str], consts: dict[str, Any],
             divisible: tuple[str, ...] = (), **options: Any) -> collections.Counter[str]:
    """Opcode counts of ``fn``'s largest loop compiled for sm_90: ``ptrs`` name -> ``"*bf16"``
    ..., ``consts`` the constexprs, ``divisible`` integer arguments known multiples of 16 (as
    the launcher specializes them), ``options`` ``num_warps`` / ``num_stages``."""
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({p.name: "fp32" for p in fn.params if p.annotation == "fp32"})
    sig.update(ptrs)
    for k in consts:
        sig[k] = "constexpr"
    const = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in (*ptrs, *divisible)}
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                            options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        lines = subprocess.run([_nvdisasm(), "-c", f.name], capture_output=True, text=True,
                               check=True).stdout.splitlines()
    labels: dict[str, int] = {}
    best = (0, len(lines) - 1)
    for i, line in enumerate(lines):
        if m := re.match(r"^(\.L_x_\d+):", line):
            labels[m.group(1)] = i
        if (m := re.search(r"BRA `?\((\.L_x_\d+)\)", line)) and m.group(1) in labels:
            start = labels[m.group(1)]
            if i - start > best[1] - best[0] or best == (0, len(lines) - 1):
                best = (start, i)
    counts: collections.Counter[str] = collections.Counter()
    for line in lines[best[0]:best[1] + 1]:
        if m := re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line):
            counts[m.group(1).split(".")[0]] += 1
    return counts


def describe(counts: collections.Counter[str]) -> str:
    """``total N`` and the counts of the opcodes worth reading (:data:`OPS`)."""
    return f"total {sum(counts.values()):4d} " + " ".join(
        f"{op}:{counts[op]}" for op in OPS if counts[op])


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))
    from mrv2_kernels import wna16_gemm as w

    ptrs = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*i32",
            "bias_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    print("W4A16, one row, 128 columns x 64-long steps (64 weights a thread a step):")
    for magic in (False, True):
        consts = dict(GROUP=128, BITS=4, HAS_ZEROS=False, HAS_BIAS=False, BM=1, BN=128, BK=64,
                      SPLIT_K=4, STAGES=3, DOT_F32=False, GEMV=True, FOLD=False, MAGIC=magic)
        mix = loop_mix(w._wna16_kernel, ptrs, consts,
                       divisible=("N", "K", "K_CHUNK", "stride_x", "stride_o"), num_warps=4,
                       num_stages=3)
        print(f"  magic={magic!s:5s}", describe(mix))


if __name__ == "__main__":
    main()
