"""Weight-only integer GEMM (GPTQ / AWQ layers): packing, the dequantizing reference against
a per-element formula, and the Triton kernel (split-K included) against the reference."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

try:
    import mrv2_kernels  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from mrv2_kernels import wna16_gemm as wg
from mrv2_kernels.wna16_gemm import (
    WNA16Tiles,
    dequantize_wna16,
    pack_along_k,
    unpack_along_k,
    wna16_linear,
    wna16_linear_ref,
    wna16_linear_triton,
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


@pytest.fixture
def poisoned(poison: Callable[[ModuleType], None]) -> None:
    poison(wg)


def _weight(k: int, n: int, bits: int, group: int, asym: bool, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Random packed weight, scales, zeros (or None) and the integers ``[K, N]``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (k, n), generator=g, dtype=torch.int64)
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).half()
    zeros = (torch.randint(0, 2**bits, (k // group, n), generator=g).to(torch.uint8)
             if asym else None)
    return pack_along_k(q, bits), scales, zeros, q


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_round_trips_and_puts_row_k_at_its_bits(bits: int) -> None:
    q = torch.randint(0, 2**bits, (32, 5), generator=torch.Generator().manual_seed(1))
    packed = pack_along_k(q, bits)
    assert packed.dtype == torch.int32 and packed.shape == (32 * bits // 32, 5)
    assert torch.equal(unpack_along_k(packed, bits).long(), q)
    # row 3 sits at bits 3 * bits of word 0 (read as unsigned)
    word = int(packed[0, 2]) & 0xFFFFFFFF
    assert (word >> (3 * bits)) & ((1 << bits) - 1) == int(q[3, 2])


@pytest.mark.parametrize("bits,asym", [(4, False), (4, True), (8, True)])
def test_dequantize_is_the_per_element_formula(bits: int, asym: bool) -> None:
    k, n, group = 64, 6, 16
    packed, scales, zeros, q = _weight(k, n, bits, group, asym, seed=2)
    w = dequantize_wna16(packed, scales, zeros, bits, group)
    assert w.shape == (n, k)
    for kk, nn in [(0, 0), (17, 3), (63, 5), (40, 1)]:
        z = int(zeros[kk // group, nn]) if zeros is not None else 2 ** (bits - 1)
        expected = (int(q[kk, nn]) - z) * float(scales[kk // group, nn])
        assert w[nn, kk].item() == pytest.approx(expected, rel=1e-6, abs=1e-9)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("magic", [False, True])
@pytest.mark.parametrize("m,n,k,group,bits,asym,bias,splits,dtype,gemv", [
    (3, 40, 64, 32, 4, False, False, 1, torch.float32, False),
    (5, 32, 96, 32, 4, True, True, 3, torch.float32, False),
    (17, 48, 64, 64, 8, True, False, 2, torch.bfloat16, False),
    (2, 24, 32, 16, 4, True, True, 1, torch.float16, False),
    # the CUDA-core kernel of a few rows: one row split over K, then 3 rows (a 4-row block)
    (1, 40, 96, 32, 4, True, True, 3, torch.bfloat16, True),
    (1, 24, 64, 16, 8, False, False, 2, torch.bfloat16, True),
    (3, 40, 96, 32, 4, True, True, 3, torch.bfloat16, True),
    (2, 24, 64, 32, 4, True, False, 2, torch.float16, True),
    (3, 24, 64, 16, 8, False, False, 1, torch.float32, True),
    # the scales folded into the weight tiles before the dot (bf16-rounded weights)
    (5, 40, 96, 32, 4, True, True, 3, torch.bfloat16, None),
    (3, 24, 64, 16, 8, False, False, 1, torch.float32, None),
])
def test_triton_matches_reference(m: int, n: int, k: int, group: int, bits: int, asym: bool,
                                  bias: bool, splits: int, dtype: torch.dtype,
                                  gemv: bool | None, magic: bool) -> None:
    """Every kernel variant (``magic``: the integers made floats from their bits,
    :mod:`mrv2_kernels.int_bits`) against the fp32 reference."""
    packed, scales, zeros, _ = _weight(k, n, bits, group, asym, seed=m + n)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    args = [t.to(DEVICE) if t is not None else None for t in (x, packed, scales, zeros, b)]
    tiles = WNA16Tiles(16, 16, 16, splits) if DEVICE == "cpu" else WNA16Tiles(16, 32, 16, splits)
    if gemv:
        tiles = WNA16Tiles(1 if m == 1 else 4, 16, 16, splits, gemv=True)
    elif gemv is None:
        tiles = tiles._replace(fold=True)
    tiles = tiles._replace(magic=magic)
    got = wna16_linear_triton(args[0], args[1], args[2], args[3], bits, group, args[4], tiles)
    expected = wna16_linear_ref(x, packed, scales, zeros, bits, group, b)
    assert got.dtype == dtype and not got.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), expected.float(), rtol=tol, atol=tol)


def test_one_row_kernel_reads_a_misaligned_bf16_row() -> None:
    """The one-row magic kernel reads bf16 ``x`` as int32 pairs: a row starting at an odd
    element (a view into a larger buffer) is copied first, not read across a pair."""
    packed, scales, zeros, _ = _weight(64, 24, 4, 32, True, seed=5)
    buf = torch.randn(1, 65, generator=torch.Generator().manual_seed(6)).bfloat16()
    x = buf[:, 1:]
    args = [t.to(DEVICE) for t in (x, packed, scales, zeros)]
    got = wna16_linear_triton(*args, 4, 32, None,  # type: ignore[misc]
                              WNA16Tiles(1, 16, 16, 2, gemv=True, magic=True))
    want = wna16_linear_ref(x, packed, scales, zeros, 4, 32)
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-2, atol=2e-2)


def test_reference_matches_the_unquantized_product_of_its_weight() -> None:
    """The dispatcher (either path) is ``x @ W.T`` of the dequantized W, leading dimensions
    kept."""
    packed, scales, zeros, _ = _weight(32, 8, 4, 32, True, seed=3)
    x = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(4))
    w = dequantize_wna16(packed, scales, zeros, 4, 32)
    y = wna16_linear(x, packed, scales, zeros, 4, 32)
    assert y.shape == (2, 3, 8)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bad,match", [
    (dict(group=24), r"group_size \(24\) must divide K"),
    (dict(scales_shape=(3, 8)), r"scales must be \[2, 8\]"),
    (dict(bits=3), r"bits must be 4 or 8"),
])
def test_bad_layout_is_named(bad: dict[str, object], match: str) -> None:
    packed, scales, zeros, _ = _weight(64, 8, 4, 32, True, seed=5)
    if "scales_shape" in bad:
        scales = torch.ones(*bad["scales_shape"])  # type: ignore[misc]
    group = int(bad.get("group", 32))  # type: ignore[call-overload]
    bits = int(bad.get("bits", 4))  # type: ignore[call-overload]
    with pytest.raises(ValueError, match=match):
        dequantize_wna16(packed, scales, zeros, bits, group)


_SM90_SCRIPT = r"""
from mrv2_kernels import wna16_gemm as w
from mrv2_kernels import fused_moe as fm
from mrv2_kernels import paged_attention as pa

bf, f16, f32, i32, u8 = "*bf16", "*fp16", "*fp32", "*i32", "*u8"
gemm = {"x_ptr": bf, "qw_ptr": i32, "s_ptr": f16, "z_ptr": u8, "bias_ptr": bf,
        "out_ptr": bf, "ws_ptr": f32, "cnt_ptr": i32}
# the default tiles (wna16_tiles): the CUDA-core kernel at 1 row (4- and 8-bit), tl.dot at
# 2-16 rows (the scales folded into the wide tiles) and beyond; zero points or not; then
# the integers made floats from their bits (magic) in each kernel
for bm, bn, bk, splits, stages, bits, zeros, gemv, magic in (
        (1, 128, 64, 4, 3, 4, True, True, False), (1, 256, 64, 4, 3, 8, False, True, False),
        (16, 64, 128, 8, 4, 4, True, False, False), (16, 128, 128, 4, 4, 4, False, None, False),
        (64, 64, 128, 2, 3, 8, True, False, False), (1, 256, 64, 4, 3, 4, True, True, True),
        (1, 256, 64, 4, 3, 8, False, True, True), (16, 64, 128, 8, 4, 4, True, False, True),
        (16, 128, 128, 4, 4, 4, False, None, True)):
    build(w._wna16_kernel, gemm,
          dict(GROUP=128, BITS=bits, HAS_ZEROS=zeros, HAS_BIAS=True, BM=bm, BN=bn, BK=bk,
               SPLIT_K=splits, STAGES=stages, DOT_F32=False, GEMV=bool(gemv),
               FOLD=gemv is None, MAGIC=magic), num_warps=4, num_stages=stages)
# fp16 activations on the two-row bit-built kernel (x read as int32 pairs, converted)
build(w._wna16_kernel, dict(gemm, x_ptr=f16, bias_ptr=f16, out_ptr=f16),
      dict(GROUP=128, BITS=4, HAS_ZEROS=True, HAS_BIAS=False, BM=2, BN=256, BK=64, SPLIT_K=16,
           STAGES=3, DOT_F32=False, GEMV=True, FOLD=False, MAGIC=True), num_warps=4,
      num_stages=3)
build(w._dequant_kernel, {"qw_ptr": i32, "s_ptr": f16, "z_ptr": u8, "w_ptr": bf},
      dict(GROUP=128, BITS=4, HAS_ZEROS=True, BK=64, BN=128), num_warps=4)
moe_common = dict(BLOCK_M=16, GROUP_M=1, EVEN_K=True, UPCAST=False, DOT_PRECISION="tf32",
                  FP8=False, QUANT_A=False, W_BN=1, INT=True, BITS=4)
# GPTQ-like (fp16 scales, zero points, SiLU), then gpt-oss's MXFP4 (e8m0 scales, groups of
# 32, the experts' biases, swigluoai) a group a step, then 128-wide steps (scales folded into
# the weights; gpt-oss's 2,880 features end inside a step)
# (the GPTQ-like one with its tiles scaled before the dots)
# (then both with their weights made floats from their bits)
for group, fp4, scale, bk, magic in ((128, False, f16, 128, False), (32, True, u8, 32, False),
                                     (32, True, u8, 128, False), (128, False, f16, 128, True),
                                     (32, True, u8, 32, True)):
    flags = dict(moe_common, W_BK=group, HAS_ZEROS=not fp4, FP4=fp4, HAS_BIAS=fp4,
                 EVEN_K=bk <= group, INT_FOLD=not fp4, INT_MAGIC=magic)
    bias = {"b_ptr": bf} if fp4 else {}
    build(fm._moe_gate_up_kernel,
          {"x_ptr": bf, "w_ptr": i32, "act_ptr": bf, "sorted_ptr": i32,
           "block_expert_ptr": i32, "num_post_ptr": i32, "xs_ptr": f32, "ws_ptr": scale,
           "acts_ptr": f32, "wz_ptr": u8, **bias},
          dict(flags, BLOCK_N=32, BLOCK_K=bk, QUANT_OUT=False, ACT_DTYPE="bf16",
               ACT=int(fp4)), num_warps=4, num_stages=4)
    build(fm._moe_down_kernel,
          {"act_ptr": bf, "w_ptr": i32, "tw_ptr": f32, "y_ptr": f32, "sorted_ptr": i32,
           "block_expert_ptr": i32, "num_post_ptr": i32, "out_ptr": bf, "counters_ptr": i32,
           "as_ptr": f32, "ws_ptr": scale, "wz_ptr": u8, **bias},
          dict(flags, BLOCK_N=64, BLOCK_K=bk, FUSED_COMBINE=True), num_warps=4,
          num_stages=4)
# the pair-a-program CUDA-core MoE kernels (fused_moe_gemv): GPTQ-like, then MXFP4 with biases
from mrv2_kernels import fused_moe_gemv as fg
for group, fp4, scale in ((128, False, f16), (32, True, u8)):
    flags = dict(BITS=4, HAS_ZEROS=not fp4, FP4=fp4, GROUP=group, BLOCK_K=128 if fp4 else 64,
                 X_PAIRS=True, HAS_VALID=True, HAS_BIAS=fp4, STAGES=3, R=2)
    build(fg._moe_gemv_gate_up_kernel,
          {"x_ptr": bf, "w_ptr": i32, "ws_ptr": scale, "wz_ptr": u8, "ids_ptr": i32,
           "act_ptr": bf, "valid_ptr": i32, "b_ptr": bf},
          dict(flags, BLOCK_N=64, ACT=int(fp4)), num_warps=4, num_stages=3)
    build(fg._moe_gemv_down_kernel,
          {"act_ptr": bf, "w_ptr": i32, "ws_ptr": scale, "wz_ptr": u8, "ids_ptr": i32,
           "tw_ptr": f32, "y_ptr": f32, "out_ptr": bf, "counters_ptr": i32, "valid_ptr": i32,
           "b_ptr": bf}, dict(flags, BLOCK_N=64), num_warps=4, num_stages=3)
attn = {"q_ptr": bf, "k_ptr": bf, "v_ptr": bf, "out_ptr": bf, "part_m_ptr": f32,
        "part_l_ptr": f32, "part_acc_ptr": f32, "qsl_ptr": i32, "seq_lens_ptr": i32,
        "block_table_ptr": i32, "pos_ptr": "*i64", "cos_sin_ptr": f32, "q_w_ptr": bf,
        "k_w_ptr": bf, "new_k_ptr": bf, "new_v_ptr": bf, "slot_ptr": "*i64",
        "sinks_ptr": f32}
# a local, soft-capped layer with sinks: the prefill tiles and the split decode ones
for bm, bn, splits, warps in ((128, 32, False, 8), (16, 64, True, 2)):
    build(pa._paged_attn_kernel, attn,
          dict(HEAD_DIM=128, HEAD_DIM_P2=128, KV_BLOCK_SIZE=16, DOT_FP32=False,
               FP32_PRECISION="tf32x3",
               PDL=True, EARLY_META=False, ROPE=splits, QK_NORM=splits, SKIP_LONG=False,
               GROUP=4, GROUP_P2=4, BLOCK_Q=bm // 4, BLOCK_M=bm, BLOCK_N=bn,
               USE_SPLITS=splits, ZERO_PAD=not splits, FLAT=not splits, REQ_BLOCK=256,
               ONE_TOKEN=0, SLIDING=True, CAP=50.0 * 16.0, SINKS=True),
          num_warps=warps, num_stages=2)
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU run compiles them for real")
def test_new_kernels_compile_for_sm90(tmp_path: Path) -> None:
    """The integer GEMM at its default tiles, the fused MoE's integer and MXFP4 paths and the
    attention kernel with a window, a soft-cap and sinks compile for an H100/H200 without a GPU
    (the interpreter accepts what the compiler may not)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from sm90 import compile_for_sm90

    sizes = compile_for_sm90(_SM90_SCRIPT, tmp_path)
    assert len(sizes["_wna16_kernel"]) == 10 and len(sizes["_dequant_kernel"]) == 1
    assert len(sizes["_moe_gate_up_kernel"]) == 5 and len(sizes["_moe_down_kernel"]) == 5
    assert len(sizes["_paged_attn_kernel"]) == 2
    assert len(sizes["_moe_gemv_gate_up_kernel"]) == len(sizes["_moe_gemv_down_kernel"]) == 2


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("bits,group,asym", [(4, 32, True), (8, 16, False)])
def test_triton_dequantization_is_the_reference_transposed(bits: int, group: int,
                                                           asym: bool) -> None:
    """The prefill path's one-pass dequantization (``[K, N]``) against the reference's."""
    packed, scales, zeros, _ = _weight(64, 40, bits, group, asym, seed=9)
    args = [t.to(DEVICE) if t is not None else None for t in (packed, scales, zeros)]
    got = wg.dequantize_wna16_triton(args[0], args[1], args[2], bits, group, torch.float32)
    want = dequantize_wna16(packed, scales, zeros, bits, group)
    assert got.shape == (64, 40)
    torch.testing.assert_close(got.cpu(), want.T, rtol=0, atol=0)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a column-major buffer (a transposed view: not contiguous)."""
    out = t.T.contiguous().T
    assert not out.is_contiguous() or t.shape[0] == 1
    return out


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("gemv", [False, True])
def test_strided_weight_tensors_read_by_their_strides(gemv: bool) -> None:
    """Packed weight, scales, zero points and bias given as strided views (a column-major
    buffer) give the contiguous tensors' product, the one-pass dequantization likewise."""
    k, n, bits, group = 64, 40, 4, 16
    packed, scales, zeros, q = _weight(k, n, bits, group, True, seed=11)
    assert zeros is not None
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, k, generator=g)
    b = torch.randn(2 * n, generator=g)[::2]  # every other entry: stride 2
    # plain torch from the layout's description: W[n, k] = (q[k, n] - z[k // G, n]) * s
    rows = torch.arange(k) // group
    w = (q.float() - zeros.float()[rows]) * scales.float()[rows]
    want = x @ w + b
    tiles = (WNA16Tiles(4, 16, 16, 1, gemv=True) if gemv else
             WNA16Tiles(16, 16, 16, 1) if DEVICE == "cpu" else WNA16Tiles(16, 32, 16, 1))
    args = [_strided(t).to(DEVICE) for t in (packed, scales, zeros)]
    got = wna16_linear_triton(x.to(DEVICE), *args, bits, group, b.to(DEVICE), tiles)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    deq = wg.dequantize_wna16_triton(*args, bits, group, torch.float32)
    torch.testing.assert_close(deq.cpu(), w, rtol=1e-6, atol=1e-7)
