"""``scripts/kernel_audit.py``'s residency rule against Hopper's limits, worked by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

_SPEC = importlib.util.spec_from_file_location(
    "kernel_audit", Path(__file__).parents[1] / "scripts" / "kernel_audit.py")
assert _SPEC is not None and _SPEC.loader is not None
audit = importlib.util.module_from_spec(_SPEC)
sys.modules["kernel_audit"] = audit  # (its dataclass looks itself up there)
_SPEC.loader.exec_module(audit)


def test_the_eight_warp_cliff_of_qwen3_8b_prefill_is_flagged() -> None:
    # 139 registers round to 144: 144 x 256 threads = 36,864 of 65,536 -> one program;
    # 128 x 256 = 32,768 -> two, and 128 is within 12% of 139
    got = audit.residency(139, 8, 48 * 1024)
    assert (got.by_registers, got.limit, got.programs) == (1, "registers", 1)
    assert got.cliff == (128, 2)
    capped = audit.residency(128, 8, 48 * 1024)
    assert (capped.by_registers, capped.programs, capped.cliff) == (2, 2, None)


def test_shared_memory_or_threads_bind_before_registers() -> None:
    # 100 KiB of shared memory: two programs, whatever the registers
    got = audit.residency(200, 4, 100 * 1024)
    assert (got.by_shared, got.limit, got.programs, got.cliff) == (2, "shared", 2, None)
    # 32 registers, 4 warps: 16 programs by registers and threads alike -> threads bind
    small = audit.residency(32, 4, 0)
    assert (small.by_registers, small.by_threads, small.limit) == (16, 16, "threads")


def test_a_cliff_too_far_below_is_not_flagged() -> None:
    # 4 warps at 255 registers: 2 programs; 3 need <= 168, a third fewer registers
    got = audit.residency(255, 4, 16 * 1024)
    assert (got.by_registers, got.limit, got.cliff) == (2, "registers", None)
    # at 176: 2 programs; 168 (within 12%) fits 3
    assert audit.residency(176, 4, 16 * 1024).cliff == (168, 3)


def test_the_table_puts_flagged_rows_first() -> None:
    rows = [{"kernel": "a", "warps": 4, "stages": 2, "registers": 64, "spills": 0,
             "shared": 1024, "maxnreg": None, "constexprs": {}},
            {"kernel": "b", "warps": 8, "stages": 2, "registers": 139, "spills": 16,
             "shared": 1024, "maxnreg": None, "constexprs": {"BLOCK_M": 128}}]
    lines = audit.table(rows)
    assert lines[0].startswith("spill 16 B; cliff 128->2") and "BLOCK_M=128" in lines[0]
    assert lines[1].startswith("-")


def test_compiled_variants_are_read_from_the_jit_caches() -> None:
    """A launched variant (registers known) is listed with the constexprs that tell it from
    its siblings; a variant never launched is left out."""
    from types import SimpleNamespace

    from triton.runtime.jit import JITFunction

    # (built directly: under TRITON_INTERPRET=1 ``triton.jit`` gives an interpreted function)
    audited = JITFunction(_audited)

    def variant(regs: int | None, block: int | None = None) -> SimpleNamespace:
        k = SimpleNamespace(metadata=SimpleNamespace(num_warps=4, num_stages=2, shared=2048),
                            n_spills=0)
        if block is not None:  # (a Triton that keeps the source's constexprs on the kernel)
            k.src = SimpleNamespace(constexprs={(1,): block, (2,): 1})
        if regs is not None:
            k.n_regs = regs
        return k

    # Triton 3.6's caches: kernels by cache key, and the key cache from (specialization,
    # options) to that key, the specialization one (kind, value) pair a parameter.
    def spec(block: int) -> tuple[tuple[str, Any], ...]:
        return (("*bf16", "D"), ("constexpr", block), ("constexpr", 1))

    caches = {"a": variant(40), "b": variant(72), "c": variant(None), "d": variant(56, 32)}
    keys = {(spec(64), "opts"): "a", (spec(128), "opts"): "b", (spec(256), "opts"): "c"}
    audited.device_caches = {0: (caches, keys, None, None, None)}
    rows = [r for r in audit.compiled_kernels() if r["kernel"] == "_audited"]
    assert sorted((r["registers"], r["constexprs"]["BLOCK"]) for r in rows) == [
        (40, 64), (56, 32), (72, 128)]
    assert all("WIDE" not in r["constexprs"] for r in rows)  # (the same in every variant)


def _audited(x_ptr, BLOCK, WIDE):  # type: ignore[no-untyped-def]
    """A kernel's signature (never compiled: the test fills its caches)."""
