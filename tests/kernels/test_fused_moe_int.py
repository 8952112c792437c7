"""Integer (GPTQ / AWQ / compressed-tensors) experts in the fused MoE: the dequantizing
reference against a per-expert formula, and the Triton path (4 and 8 bits, zero points or
not, decode-sized and larger batches, padding rows) against the reference."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from mrv2_kernels import fused_moe as fm
from mrv2_kernels.fused_moe import IntExperts, fused_moe_ref, fused_moe_triton
from mrv2_kernels.fused_moe_int import dequantize_int_experts, pack_experts
from mrv2_kernels.int_dense import (
    INT_DENSE_ENV_VAR,
    INT_DENSE_MIN_TOKENS,
    dequantize_int,
    use_int_dense,
)

DEVICE = "cuda" if os.environ.get("MRV2_TEST_GPU") and torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


def _experts(e: int, n: int, k: int, bits: int, group: int, asym: bool, seed: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Packed ``[E, N, K / pack]``, scales, zeros (or None), the integers ``[E, N, K]``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (e, n, k), generator=g)
    scale = (torch.rand(e, n, k // group, generator=g) + 0.1) * 0.3 / 2**bits  # weights ~0.02
    zeros = (torch.randint(0, 2**bits, (e, n, k // group), generator=g).to(torch.uint8)
             if asym else None)
    return pack_experts(q, bits), scale.half(), zeros, q


def test_dequantize_is_the_formula() -> None:
    packed, scale, zeros, q = _experts(2, 6, 32, 4, 16, True, seed=1)
    assert zeros is not None
    w = dequantize_int_experts(packed, scale, zeros, 4, 16)
    for e, n, k in [(0, 0, 0), (1, 5, 31), (1, 2, 17)]:
        want = (int(q[e, n, k]) - int(zeros[e, n, k // 16])) * float(scale[e, n, k // 16])
        assert w[e, n, k].item() == pytest.approx(want, rel=1e-6, abs=1e-9)


@pytest.fixture
def poisoned(poison: Callable[[ModuleType], None]) -> None:
    poison(fm)


@pytest.mark.parametrize(("bits", "asym", "dtype"), [(4, True, torch.bfloat16),
                                                     (8, False, torch.float32)])
def test_dense_dequantization(bits: int, asym: bool, dtype: torch.dtype,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton pass of :func:`~mrv2_kernels.int_dense.dequantize_int` (a K that is not a
    multiple of its tile) gives the reference's values (exactly in fp32; bf16 to its
    rounding); the opt-in rule."""
    packed, scale, zeros, _ = _experts(2, 6, 96, bits, 32, asym, seed=7)
    want = dequantize_int_experts(packed, scale, zeros, bits, 32, dtype)
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    dev = [t.to(DEVICE) if t is not None else None for t in (packed, scale, zeros)]
    got = dequantize_int(dev[0], dev[1], dev[2], bits, 32, dtype,  # type: ignore[arg-type]
                         block_r=4, block_w=4)
    assert got.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(got.cpu(), want)
    else:  # (the interpreter's conversion to bf16 does not round to nearest)
        torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2**-7, atol=0)
    big = torch.empty(128, 1536, 256, dtype=torch.int32, device="meta")
    assert not use_int_dense(8192, big, big[:, :2048, :96], 8, torch.bfloat16)  # opt-in
    monkeypatch.setenv(INT_DENSE_ENV_VAR, "1")
    assert use_int_dense(INT_DENSE_MIN_TOKENS, big, big[:, :2048, :96], 8, torch.bfloat16)
    assert not use_int_dense(INT_DENSE_MIN_TOKENS - 1, big, big, 8, torch.bfloat16)
    with pytest.raises(ValueError, match=r"scales \(and zero points\) \[E, N, K / group_size\]"):
        dequantize_int(packed, scale, zeros, bits, 64, dtype)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize(("tokens", "bits", "asym", "group", "dtype", "valid"), [
    (3, 4, False, 32, torch.float32, None),
    (9, 4, True, 16, torch.float32, 7),
    (5, 8, True, 32, torch.bfloat16, None),
    (2, 4, True, 32, torch.float16, None),
])
@pytest.mark.parametrize(("fold", "magic", "gemv"), [
    (False, False, False), (True, False, False), (False, True, False), (True, True, False),
    (False, False, True), (None, None, None)],
    ids=["scaled_products", "folded_tiles", "magic", "magic_folded", "gemv", "dense"])
def test_triton_matches_reference(tokens: int, bits: int, asym: bool, group: int,
                                  dtype: torch.dtype, valid: int | None, fold: bool | None,
                                  magic: bool | None, gemv: bool | None) -> None:
    """Each step's variants (``magic``: the integers made floats from their bits,
    :mod:`mrv2_kernels.int_bits`; ``gemv``: the pair-a-program CUDA-core kernels,
    :mod:`mrv2_kernels.fused_moe_gemv`; ``dense``: the experts dequantized first,
    :mod:`mrv2_kernels.int_dense`) against the dequantizing reference."""
    experts, hidden, inter, top_k = 4, 64, 32, 2
    w13, s13, z13, _ = _experts(experts, 2 * inter, hidden, bits, group, asym, seed=2)
    w2, s2, z2, _ = _experts(experts, hidden, inter, bits, group, asym, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    ints = IntExperts(s13, s2, z13, z2, bits, group)
    valid_t = None if valid is None else torch.tensor([valid], dtype=torch.int32)
    want = fused_moe_ref(x, w13, w2, weights, ids.int(), int_experts=ints,
                         valid_tokens=valid_t)
    dev = [t.to(DEVICE) if t is not None else None for t in (x, w13, w2, weights, ids.int())]
    ints_dev = IntExperts(*[t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in ints])
    got = fused_moe_triton(*dev, int_experts=ints_dev,  # type: ignore[arg-type]
                           valid_tokens=None if valid_t is None else valid_t.to(DEVICE),
                           int_fold=fold, int_magic=magic, int_gemv=gemv,
                           int_dense=fold is None or None,
                           block_n1=16 if gemv else None, block_k1=32 if gemv else None).cpu()
    rows = tokens if valid is None else valid
    assert not got[:rows].isnan().any()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got[:rows].float(), want[:rows].float(), rtol=tol, atol=tol)


def test_bad_layout_is_named() -> None:
    w13, s13, _, _ = _experts(2, 64, 64, 4, 32, False, seed=5)
    w2, s2, _, _ = _experts(2, 64, 32, 4, 32, False, seed=6)
    x = torch.randn(2, 64)
    ids = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"w2_scale must be \(2, 64, 1\)"):
        fused_moe_ref(x, w13, w2, torch.ones(2, 1), ids,
                      int_experts=IntExperts(s13, s13, None, None, 4, 32))
    with pytest.raises(ValueError, match=r"group_size \(24\) must divide"):
        fused_moe_ref(x, w13, w2, torch.ones(2, 1), ids,
                      int_experts=IntExperts(s13, s2, None, None, 4, 24))
