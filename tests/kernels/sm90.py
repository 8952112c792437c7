"""Compile Triton kernels for an H100/H200 (sm_90) on a machine without a GPU, for tests.

The interpreter runs a kernel as Python, so what only Triton's compiler rejects (a global name
it cannot resolve, a layout it cannot lower, shared memory past a limit) passes every CPU
test. :func:`compile_for_sm90` runs a script in a fresh process without ``TRITON_INTERPRET``:
the script gets ``build(fn, ptrs, consts, descs=None, **options)``, which compiles ``fn`` with
the pointer arguments ``ptrs`` (name -> ``"*bf16"`` ...), the constexprs ``consts``, the
tensor descriptors ``descs`` (name -> ``"tensordesc<bf16[64, 128]>"``), every other argument a
32-bit integer (``qk_scale`` fp32; those named in ``divisible`` known multiples of 16, as the
launcher specializes them at run time: Triton pipelines masked loads only then), and prints the
kernel's name and shared memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_PRELUDE = r"""
import sys
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    sys.exit(3)

def build(fn, ptrs, consts, descs=None, divisible=(), **opts):
    sig = {n: "i32" for n in fn.arg_names}
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
"""


def compile_for_sm90(script: str, tmp_path: Path) -> dict[str, list[int]]:
    """Run ``script`` (after the ``build`` prelude) for sm_90; returns each built kernel's
    shared-memory sizes in bytes, by name. Skips where this Triton has no ahead-of-time
    compile API; fails with the compiler's error otherwise."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _PRELUDE + script], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    if proc.returncode == 3:
        pytest.skip("this Triton has no sm_90 ahead-of-time compile API")
    assert proc.returncode == 0, proc.stderr[-3000:]
    shared: dict[str, list[int]] = {}
    for line in proc.stdout.splitlines():
        name, size = line.split()
        shared.setdefault(name, []).append(int(size))
    return shared
