# ruff: noqa: E501  (verbatim compiler output)
"""The sm_90 compile tests' check for math a layout repeats across threads
(:func:`sm90.replicated_math`), on TTGIR lines of real compiles: it must flag the pivot pass
before ea6eda2 (each temperature-scaled logit on 16 threads) and pass the fixed one."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from sm90 import replicated_math  # noqa: E402

# sm_90 TTGIR of the old pivot pass (BLOCK 256, 16 pivots, 8 warps): the [256] logits were
# the slice of a [256, 16] layout with 16 threads along the pivots.
_OLD = """
#blocked = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [2, 16], warpsPerCTA = [8, 1], order = [1, 0]}>
#blocked1 = #ttg.blocked<{sizePerThread = [1], threadsPerWarp = [32], warpsPerCTA = [8], order = [0]}>
      %x_126 = tt.precise_divf %x_124, %x_107 : tensor<256xf32, #ttg.slice<{dim = 1, parent = #blocked}>> loc(#loc329)
      %x_127 = tt.precise_divf %x_125, %x_108 : tensor<256xf32, #blocked1> loc(#loc329)
      %m = arith.cmpf ogt, %a, %b : tensor<256xf32, #ttg.slice<{dim = 1, parent = #blocked}>>
"""
# The fixed pass keeps [16, 256] tiles: the same division, one value a thread.
_NEW = """
#blocked = #ttg.blocked<{sizePerThread = [1, 1], threadsPerWarp = [1, 32], warpsPerCTA = [1, 8], order = [1, 0]}>
      %x_126 = tt.precise_divf %x_124, %x_107 : tensor<256xf32, #ttg.slice<{dim = 0, parent = #blocked}>> loc(#loc329)
      %mass_145 = arith.addf %mass_117, %mass_144 : tensor<16x256xf32, #blocked> loc(#loc292)
"""


def test_flags_math_on_values_spread_over_threads() -> None:
    found = replicated_math(_OLD)
    assert found == ["tt.precise_divf on tensor<256x> #ttg.slice<{dim = 1, parent = "
                     "#blocked}>: each value on 16 threads"], found  # not the compare


def test_passes_one_value_a_thread() -> None:
    assert replicated_math(_NEW) == []


# The decode step's kernels at the H200's tiles, which no other sm_90 test builds: the fused
# norm + GEMV (qkv, gate/up with the SwiGLU, o as a plain GEMV), RMSNorm, SiLU-and-mul, the
# skinny split-K GEMM, RoPE with the KV write, the split decode attention plan with its fused
# RoPE and the combine (and both at a head_dim of 96, padded), and the sampler's logprob
# and penalty kernels.
_DECODE_SCRIPT = r"""
from mrv2_kernels import logprobs as lp
from mrv2_kernels import norm as nm
from mrv2_kernels import norm_gemv as ng
from mrv2_kernels import paged_attention as pa
from mrv2_kernels import penalties as pe
from mrv2_kernels import rotary as rt
from mrv2_kernels import skinny_gemm as sk

bf, f32, i32, i64 = "*bf16", "*fp32", "*i32", "*i64"


def auto(fn, consts, types=(), **opts):
    names = [n for n in fn.arg_names if n.endswith("_ptr") and n not in consts]
    build(fn, {n: dict(types).get(n, bf) for n in names}, consts, **opts)


for gated, block_n in ((False, 8), (True, 4)):
    auto(ng._norm_gemv_kernel, dict(BLOCK_N=block_n, BLOCK_K=1024, NORM=True, RESIDUAL=True,
                                    GATED=gated, HAS_BIAS=False, PDL=True, EARLY_WEIGHTS=True),
         num_warps=4)
auto(ng._norm_gemv_kernel, dict(BLOCK_N=4, BLOCK_K=2048, NORM=False, RESIDUAL=False,
                                GATED=False, HAS_BIAS=False, PDL=True, EARLY_WEIGHTS=True),
     num_warps=4)
auto(nm._rms_norm_kernel, dict(HAS_RESIDUAL=True, BLOCK_R=2, BLOCK_H=1024, PDL=True),
     num_warps=8)
auto(nm._silu_and_mul_kernel, dict(BLOCK=1024, PDL=True), num_warps=4)
auto(sk._skinny_kernel, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, SPLIT=True, HAS_BIAS=False,
                             UPCAST=False, FUSED_REDUCE=True, PDL=True, EARLY_WEIGHTS=True),
     {"part_ptr": f32, "counters_ptr": i32}, num_warps=4, num_stages=3)
auto(rt._rotary_kernel, dict(BLOCK_HEADS=16, BLOCK_HALF=64, NORM=True, KV_WRITE=True,
                             KV_BLOCK_SIZE=16, PDL=True, EARLY_META=True),
     {"positions_ptr": i64, "cos_sin_ptr": f32, "slot_ptr": i64}, num_warps=4)
auto(lp._logprob_stats_kernel, dict(BLOCK_V=2048),
     {"tokens_ptr": i64, "lse_ptr": f32, "rank_ptr": i32}, num_warps=8)
auto(pe._penalties_kernel, dict(BLOCK_V=1024),
     {"logits_ptr": f32, "idx_ptr": i32, "counts_ptr": i32, "mask_ptr": "*u8", "rep_ptr": f32,
      "freq_ptr": f32, "pres_ptr": f32}, num_warps=4)
attn = {"q_ptr": bf, "k_ptr": bf, "v_ptr": bf, "out_ptr": bf, "part_m_ptr": f32,
        "part_l_ptr": f32, "part_acc_ptr": f32, "qsl_ptr": i32, "seq_lens_ptr": i32,
        "block_table_ptr": i32, "pos_ptr": i64, "cos_sin_ptr": f32, "q_w_ptr": bf,
        "k_w_ptr": bf, "new_k_ptr": bf, "new_v_ptr": bf, "slot_ptr": i64}
for group, warps in ((2, 2), (4, 4)):  # Qwen3-0.6B / 8B heads
    build(pa._paged_attn_kernel, attn,
          dict(HEAD_DIM=128, HEAD_DIM_P2=128, KV_BLOCK_SIZE=16, DOT_FP32=False,
               FP32_PRECISION="tf32x3",
               PDL=True, EARLY_META=True, ROPE=True, QK_NORM=True, SKIP_LONG=False,
               GROUP=group, GROUP_P2=group, BLOCK_Q=16 // group, BLOCK_M=16, BLOCK_N=64,
               USE_SPLITS=True, ZERO_PAD=False, FLAT=False, REQ_BLOCK=256, ONE_TOKEN=0,
               SLIDING=False, CAP=0.0, SINKS=False, sinks_ptr=None),
          num_warps=warps, num_stages=2)
build(pa._combine_splits_kernel, {"part_m_ptr": f32, "part_l_ptr": f32, "part_acc_ptr": f32,
                                  "out_ptr": bf, "qsl_ptr": i32},
      dict(SPLITS_P2=32, HEAD_DIM=128, HEAD_DIM_P2=128, PDL=True), num_warps=4)
# a head_dim of 96 (Phi-3-mini, GPT-NeoX-20B): 128-wide tiles masked to 96 columns, split
# decode without the fused RoPE (the launcher rotates first for such heads) and the combine
build(pa._paged_attn_kernel, attn,
      dict(HEAD_DIM=96, HEAD_DIM_P2=128, KV_BLOCK_SIZE=16, DOT_FP32=False,
           FP32_PRECISION="tf32x3", PDL=True, EARLY_META=True, ROPE=False, QK_NORM=False,
           SKIP_LONG=False, GROUP=4, GROUP_P2=4, BLOCK_Q=4, BLOCK_M=16, BLOCK_N=64,
           USE_SPLITS=True, ZERO_PAD=False, FLAT=False, REQ_BLOCK=256, ONE_TOKEN=0,
           SLIDING=False, CAP=0.0, SINKS=False, sinks_ptr=None),
      num_warps=4, num_stages=2)
build(pa._combine_splits_kernel, {"part_m_ptr": f32, "part_l_ptr": f32, "part_acc_ptr": f32,
                                  "out_ptr": bf, "qsl_ptr": i32},
      dict(SPLITS_P2=32, HEAD_DIM=96, HEAD_DIM_P2=128, PDL=True), num_warps=4)
"""


def test_decode_kernels_compile_for_sm90_without_repeated_math(tmp_path: Path) -> None:
    from sm90 import compile_for_sm90

    built = compile_for_sm90(_DECODE_SCRIPT, tmp_path)
    assert sum(len(v) for v in built.values()) == 14, built
