"""Registers, shared memory and spilled bytes of the paged-attention kernel's prefill programs,
compiled for a Hopper GPU (sm_90) on any machine: Triton's own ptxas and cuobjdump, no GPU.

Why: an 8-warp program over 128 registers a thread leaves one program per SM instead of two
(64K registers), which halved Qwen3-8B's prefill rate on an H100 (BENCHMARKS.md 2026-12-07);
run this after a change to ``_paged_attn_kernel`` before spending device time. The
specialization follows a real launch's (pointers and strides divisible by 16).

    python scripts/kernel_registers.py            # Qwen3-8B's and Qwen3-0.6B's prefill tiles
    python scripts/kernel_registers.py --cap 128  # with the launcher's maxnreg
    python scripts/kernel_registers.py --layouts 8B-decode 0.6B-decode --cap 200
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mrv2_kernels.paged_attention_kernels import _paged_attn_kernel

_POINTERS = {
    "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16",
    "part_m_ptr": "*fp32", "part_l_ptr": "*fp32", "part_acc_ptr": "*fp32",
    "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "block_table_ptr": "*i32", "pos_ptr": "*i64",
    "cos_sin_ptr": "*fp32", "q_w_ptr": "*bf16", "k_w_ptr": "*bf16", "new_k_ptr": "*bf16",
    "new_v_ptr": "*bf16", "slot_ptr": "*i64"}
_FLOATS = {"qk_scale", "eps"}
#: Integer arguments a launch passes divisible by 16 (strides of contiguous rows, head counts).
_DIVISIBLE = {"stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_ks",
              "stride_kh", "stride_bt", "stride_nt", "stride_nvt"}
#: The prefill plans of the two bench layouts (``attention_plan`` on an H100 / H200).
LAYOUTS: dict[str, dict[str, Any]] = {
    "8B": {"GROUP": 4, "GROUP_P2": 4, "BLOCK_Q": 32, "BLOCK_M": 128, "BLOCK_N": 32,
           "num_warps": 8},
    "0.6B": {"GROUP": 2, "GROUP_P2": 2, "BLOCK_Q": 32, "BLOCK_M": 64, "BLOCK_N": 64,
             "num_warps": 4},
    # Decode plans (a program a request and kv head, from a program an SM: 2 warps), rope and
    # the q/k norm fused, keys split (--cap 200: a decode register cap, timed on an H100 and
    # dropped, 2026-12-07: the workload's decode attention 3-7% slower under it).
    "8B-decode": {"GROUP": 4, "GROUP_P2": 4, "BLOCK_Q": 4, "BLOCK_M": 16, "BLOCK_N": 64,
                  "FLAT": False, "ZERO_PAD": False, "ROPE": True, "QK_NORM": True,
                  "USE_SPLITS": True, "num_warps": 2},
    "0.6B-decode": {"GROUP": 2, "GROUP_P2": 2, "BLOCK_Q": 8, "BLOCK_M": 16, "BLOCK_N": 64,
                    "FLAT": False, "ZERO_PAD": False, "ROPE": True, "QK_NORM": True,
                    "USE_SPLITS": True, "num_warps": 2},
}
_COMMON = {"HEAD_DIM": 128, "HEAD_DIM_P2": 128, "KV_BLOCK_SIZE": 16, "USE_SPLITS": False,
           "ZERO_PAD": True,
           "DOT_FP32": False, "FP32_PRECISION": "tf32x3", "PDL": True, "EARLY_META": True,
           "ROPE": False, "QK_NORM": False, "SKIP_LONG": False, "FLAT": True,
           "REQ_BLOCK": 256, "ONE_TOKEN": 0}


def resources(constants: dict[str, Any], num_warps: int, num_stages: int = 2,
              maxnreg: int | None = None) -> dict[str, int]:
    """``{"registers", "shared", "spilled"}`` of the kernel compiled with ``constants``."""
    fn = _paged_attn_kernel
    signature: dict[str, str] = {}
    values: dict[str, Any] = {}
    for p in fn.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            values[p.name] = constants.get(p.name, p.default)
        elif p.name == "sinks_ptr":
            signature[p.name], values[p.name] = "constexpr", None
        else:
            signature[p.name] = _POINTERS.get(p.name) or (
                "fp32" if p.name in _FLOATS else "i32")
    names = [p.name for p in fn.params]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if signature[n] != "constexpr" and (n in _POINTERS or n in _DIVISIBLE)}
    options: dict[str, Any] = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=values,
                                      attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options=options)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    found = re.search(r"REG:(\d+).*?LOCAL:(\d+)", usage, re.S)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no REG/LOCAL:\n{usage}")
    return {"registers": int(found.group(1)), "shared": int(kernel.metadata.shared),
            "spilled": int(found.group(2))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cap", type=int, default=None, help="maxnreg, as the launcher passes it")
    p.add_argument("--layouts", nargs="*", default=["8B", "0.6B"], choices=list(LAYOUTS))
    args = p.parse_args()
    for name in args.layouts:
        layout = dict(LAYOUTS[name])
        warps = layout.pop("num_warps")
        got = resources({**_COMMON, **layout}, warps, maxnreg=args.cap)
        resident = 65536 // (32 * warps * max(got["registers"], 1))
        kind = "decode" if name.endswith("decode") else "prefill"
        print(f"{name.removesuffix('-decode'):>4} {kind} ({warps} warps, cap {args.cap}): "
              f"{got['registers']} registers, {got['shared']} B shared, "
              f"{got['spilled']} B spilled: {resident} program(s) an SM by registers")


if __name__ == "__main__":
    main()
