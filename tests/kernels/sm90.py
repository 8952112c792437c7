"""Compile Triton kernels for an H100/H200 (sm_90) on a machine without a GPU, for tests.

The interpreter runs a kernel as Python, so what only Triton's compiler rejects (a global name
it cannot resolve, a layout it cannot lower, shared memory past a limit) passes every CPU
test. :func:`compile_for_sm90` runs a script in a fresh process without ``TRITON_INTERPRET``:
the script gets ``build(fn, ptrs, consts, descs=None, **options)``, which compiles ``fn`` with
the pointer arguments ``ptrs`` (name -> ``"*bf16"`` ...), the constexprs ``consts``, the
tensor descriptors ``descs`` (name -> ``"tensordesc<bf16[64, 128]>"``), every other argument a
32-bit integer (``qk_scale`` and ``float``-annotated ones fp32; those named in ``divisible``
known multiples of 16, as the launcher specializes them at run time: Triton pipelines masked
loads only then), and prints the kernel's name and shared memory.

It also reads each kernel's TTGIR for floating-point math on a tensor of
:data:`_MIN_ELEMS`+ elements whose layout gives every value to :data:`_MAX_COPIES` or more
threads, and fails on any: the same arithmetic repeated across threads. (The top-k / top-p
pivot pass once held ``[BLOCK, 16]`` tiles whose ``[BLOCK]`` values were each spread over 16
threads, and divided every bf16 logit by the temperature 16 times: BENCHMARKS.md, eighteenth
session.)
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

_PRELUDE = r"""
import inspect
import sys
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    sys.exit(3)

def build(fn, ptrs, consts, descs=None, divisible=(), **opts):
    # constexprs the script leaves out take their defaults, as in a launch that omits them
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr
                 and p.name not in consts and p.default is not inspect.Parameter.empty},
              **consts}
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({p.name: "fp32" for p in fn.params if p.annotation == "fp32"})  # float args
    sig.update(ptrs)
    sig.update(descs or {})
    sig["qk_scale"] = "fp32" if "qk_scale" in sig else None
    sig = {k: v for k, v in sig.items() if v}
    for k in consts:
        sig[k] = "constexpr"
    const = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in (*ptrs, *divisible)}
    try:
        src = ASTSource(fn, sig, const, attrs)
    except TypeError:
        sys.exit(3)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    print(fn.__name__, k.metadata.shared)
    for line in replicated_math(k.asm["ttgir"]):
        print("REPLICATED", fn.__name__, line)
"""

#: Floating-point ops the replication check counts (integer index math and masks are cheap).
_MATH_OPS = ("arith.addf", "arith.subf", "arith.mulf", "arith.divf", "math.exp", "math.exp2",
             "math.log", "math.log2", "math.fma", "math.sqrt", "math.rsqrt", "tt.precise_divf",
             "tt.extern_elementwise", "arith.extf", "arith.truncf")
_MIN_ELEMS = 256
_MAX_COPIES = 4


def replicated_math(ttgir: str) -> list[str]:
    """Lines describing each floating-point op (:data:`_MATH_OPS`) on a tensor of at least
    :data:`_MIN_ELEMS` elements whose blocked (or sliced blocked) layout gives every value to
    :data:`_MAX_COPIES` or more threads."""
    layouts = {}
    for m in re.finditer(r"^#(\w+) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], "
                         r"threadsPerWarp = \[([\d, ]+)\], warpsPerCTA = \[([\d, ]+)\]",
                         ttgir, re.M):
        spt, tpw, wpc = ([int(v) for v in g.split(",")] for g in m.group(2, 3, 4))
        layouts[m.group(1)] = (spt, tpw, wpc)
    tensor = re.compile(r"tensor<((?:\d+x)+)\w+, (#ttg\.slice<\{dim = (\d+), "
                        r"parent = #(\w+)\}>|#(\w+))>")
    found = []
    for line in ttgir.splitlines():
        op = re.match(r"\s*(?:%[\w#:]+(?:, %[\w#:]+)* = )?\"?([\w.]+)", line)
        types = tensor.findall(line)
        if not op or op.group(1) not in _MATH_OPS or not types:
            continue
        dims, spec, sliced_dim, parent, plain = types[-1]
        name = parent or plain
        if name not in layouts:
            continue
        spt, tpw, wpc = layouts[name]
        cover = [a * b * c for a, b, c in zip(spt, tpw, wpc, strict=True)]
        copies = 1
        if parent:  # every thread along the sliced dimension holds the value
            d = int(sliced_dim)
            copies = tpw[d] * wpc[d]
            cover = cover[:d] + cover[d + 1:]
        shape = [int(v) for v in dims.rstrip("x").split("x")]
        if len(shape) != len(cover):
            continue
        elems = 1
        for size, c in zip(shape, cover, strict=True):
            elems *= size
            copies *= max(1, c // size)
        if elems >= _MIN_ELEMS and copies >= _MAX_COPIES:
            found.append(f"{op.group(1)} on tensor<{dims}> {spec}: each value on {copies} "
                         f"threads")
    return found


def compile_for_sm90(script: str, tmp_path: Path) -> dict[str, list[int]]:
    """Run ``script`` (after the ``build`` prelude) for sm_90; returns each built kernel's
    shared-memory sizes in bytes, by name. Skips where this Triton has no ahead-of-time
    compile API; fails with the compiler's error otherwise."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    prelude = _PRELUDE.replace("import triton\n", "import re\nimport triton\n", 1)
    prelude += "\n" + "\n".join(f"{k} = {v!r}" for k, v in (
        ("_MATH_OPS", _MATH_OPS), ("_MIN_ELEMS", _MIN_ELEMS), ("_MAX_COPIES", _MAX_COPIES)))
    prelude += "\n" + inspect.getsource(replicated_math) + "\n"
    proc = subprocess.run([sys.executable, "-c", prelude + script], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    if proc.returncode == 3:
        pytest.skip("this Triton has no sm_90 ahead-of-time compile API")
    assert proc.returncode == 0, proc.stderr[-3000:]
    shared: dict[str, list[int]] = {}
    replicated = []
    for line in proc.stdout.splitlines():
        if line.startswith("REPLICATED "):
            replicated.append(line.removeprefix("REPLICATED "))
            continue
        name, size = line.split()
        shared.setdefault(name, []).append(int(size))
    assert not replicated, "math repeated across threads by a layout:\n" + "\n".join(replicated)
    return shared
