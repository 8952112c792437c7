"""The fused MoE's Triton kernels (the op, its contract and its tiles: :mod:`~mrv2_kernels.
fused_moe`): the grouped gate/up GEMM with the gated activation in its epilogue, the grouped
down GEMM (with the combine fused for decode-sized batches) and the combine kernel. Each takes
bf16 / fp32 / fp16 weights, FP8 weights with block scales (``FP8``) or packed integer / MXFP4
ones (``INT``, ``FP4``), switched at compile time, and optional expert biases
(``HAS_BIAS``)."""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8_gemm import _quant_rows
from .fused_moe_fp8 import _fp8_a_tile, _fp8_dot, _round_to
from .fused_moe_int import _int_step, _int_tile
from .fused_moe_ref import SWIGLUOAI_ALPHA

_ALPHA = tl.constexpr(SWIGLUOAI_ALPHA)


# ------------------------------------------------------------------------------ grouped GEMMs


@triton.jit
def _block_tile(pid: int, num_pid_m: int, num_pid_n: int,
                GROUP_M: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """``(pid_m, pid_n)`` of program ``pid``: ``GROUP_M`` blocks side by side walk the output
    slices together, so a slice of an expert's weights serves its blocks from L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    return pid_m, pid_n


@triton.jit
def _step_mask(offs_k: tl.tensor, left: int, W_STEP: tl.constexpr,
               BLOCK_K: tl.constexpr) -> tl.tensor:
    """``[W_STEP, 1]``: the weight rows of a K step that lie before the end, ``left`` inputs
    on (packed weights: a row per word of ``BLOCK_K / W_STEP`` inputs, the pack dividing
    ``left``)."""
    if W_STEP == BLOCK_K:
        mask = offs_k < left
    else:
        mask = tl.arange(0, W_STEP) < left // (BLOCK_K // W_STEP)
    return mask[:, None]


@triton.jit
def _glu(gate: tl.tensor, up: tl.tensor, ACT: tl.constexpr, limit: float) -> tl.tensor:
    """The gated activation of fp32 ``gate`` / ``up``: ``ACT`` 0, ``silu(gate) * up``; 1
    (``"swigluoai"``, gpt-oss), ``g * sigmoid(1.702 g) * (u + 1)`` of ``g = min(gate, limit)``,
    ``u = clamp(up, -limit, limit)``; 2 (``"gelu_tanh"``, GeGLU: Gemma 4), ``0.5 g (1 +
    tanh(sqrt(2 / pi) (g + 0.044715 g^3))) * up``, tanh as ``1 - 2 / (exp(2 z) + 1)`` (exact at
    both ends in fp32: the exponential saturates to 0 or inf); 3 (``"silu_clamp"``, Step-3.5 /
    3.7), ``min(silu(gate), limit) * clamp(up, -limit, limit)``."""
    if ACT == 3:
        s = tl.minimum(gate / (1.0 + tl.exp(-gate)), limit)
        return s * tl.minimum(tl.maximum(up, -limit), limit)
    if ACT == 2:
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        return 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)) * up
    if ACT == 1:
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        return g / (1.0 + tl.exp(-_ALPHA * g)) * (u + 1.0)
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def _moe_gate_up_kernel(
    x_ptr: tl.tensor,
    w_ptr: tl.tensor,
    act_ptr: tl.tensor,
    sorted_ptr: tl.tensor,
    block_expert_ptr: tl.tensor,
    num_post_ptr: tl.tensor,
    num_pairs: int,
    num_pid_m: int,
    top_k: int,
    hidden: int,
    inter: int,
    x_s0: int,
    w_s0: int,
    w_s1: int,
    act_s0: int,
    xs_ptr: tl.tensor,
    ws_ptr: tl.tensor,
    acts_ptr: tl.tensor,
    xs_s0: int,
    ws_s0: int,
    ws_s1: int,
    ws_s2: int,
    acts_s0: int,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    QUANT_A: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    W_BN: tl.constexpr,
    W_BK: tl.constexpr,
    ACT_DTYPE: tl.constexpr,
    wz_ptr: tl.tensor = None,
    INT: tl.constexpr = False,
    BITS: tl.constexpr = 4,
    HAS_ZEROS: tl.constexpr = False,
    FP4: tl.constexpr = False,
    INT_FOLD: tl.constexpr = False,
    INT_MAGIC: tl.constexpr = False,
    two23: int = 0,
    b_ptr: tl.tensor = None,
    b_s0: int = 0,
    act_limit: float = 0.0,
    HAS_BIAS: tl.constexpr = False,
    ACT: tl.constexpr = 0,
) -> None:
    """``act`` of one block of sorted pairs and ``BLOCK_N`` intermediate features (``ACT``
    and ``HAS_BIAS``: :func:`_glu`, ``b`` the gate/up biases ``[E, 2I]``). ``INT``:
    ``w`` holds packed integers, ``ws`` / ``wz`` the rows' group scales and zero points
    (:mod:`~mrv2_kernels.fused_moe_int`; groups of ``W_BK``; ``INT_FOLD``: each step's tile
    scaled and rounded to ``x``'s dtype before the dot). ``FP8``:
    ``w`` is e4m3 with block scales ``ws`` and ``x`` is fp8 with per-(token, group) scales
    ``xs`` or, with ``QUANT_A`` (``BLOCK_K == W_BK``), ``x`` itself quantized step by step
    here; ``QUANT_OUT`` (``BLOCK_N == W_BK``) stores ``act`` quantized, its scales in
    ``acts``."""
    pid_m, pid_n = _block_tile(tl.program_id(0), num_pid_m, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    token = (pair // top_k).to(tl.int64)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * x_s0 + offs_k[None, :]
    W_STEP: tl.constexpr = BLOCK_K // (32 // BITS) if INT else BLOCK_K  # weight elements/step
    gate_ptrs = (w_ptr + expert * w_s0 + offs_n.to(tl.int64)[None, :] * w_s1
                 + tl.arange(0, W_STEP)[:, None])
    up_ptrs = gate_ptrs + inter * w_s1
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if INT:  # the gate and up rows' group scales and zero points (per row)
        gs_ptrs = ws_ptr + expert * ws_s0 + offs_n.to(tl.int64) * ws_s1
        us_ptrs = gs_ptrs + inter * ws_s1
        gz_ptrs = wz_ptr + expert * ws_s0 + offs_n.to(tl.int64) * ws_s1
        uz_ptrs = gz_ptrs + inter * ws_s1
    if FP8:  # scale rows: the gate and up rows' blocks, the tokens' groups
        gs_ptrs = ws_ptr + expert * ws_s0 + (offs_n // W_BN).to(tl.int64) * ws_s1
        us_ptrs = ws_ptr + expert * ws_s0 + ((offs_n + inter) // W_BN).to(tl.int64) * ws_s1
        xs_ptrs = xs_ptr + token * xs_s0
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs, mask=valid[:, None], other=0.0)
            g = tl.load(gate_ptrs, mask=mask_n[None, :], other=0.0)
            u = tl.load(up_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = offs_k < hidden - k0
            a = tl.load(x_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
            mask_w = _step_mask(offs_k, hidden - k0, W_STEP, BLOCK_K) & mask_n[None, :]
            g = tl.load(gate_ptrs, mask=mask_w, other=0.0)
            u = tl.load(up_ptrs, mask=mask_w, other=0.0)
        if INT:  # one group per step: the small integers' products, scaled, then added
            grp = (k0 // W_BK) * ws_s2
            a_in = a.to(tl.float32) if UPCAST else a
            if BLOCK_K > W_BK:  # MXFP4 over several groups: the scales are in the weights
                g = _int_tile(g, gz_ptrs, mask_n, BITS, False, BLOCK_K, BLOCK_N, True,
                              gs_ptrs + grp, ws_s2, W_BK, INT_MAGIC, hidden - k0)
                u = _int_tile(u, uz_ptrs, mask_n, BITS, False, BLOCK_K, BLOCK_N, True,
                              us_ptrs + grp, ws_s2, W_BK, INT_MAGIC, hidden - k0)
                acc_gate = tl.dot(a_in, g.to(a_in.dtype), acc_gate,
                                  input_precision=DOT_PRECISION)
                acc_up = tl.dot(a_in, u.to(a_in.dtype), acc_up, input_precision=DOT_PRECISION)
            else:
                acc_gate = _int_step(acc_gate, a_in, g, gz_ptrs + grp, gs_ptrs + grp, mask_n,
                                     BITS, HAS_ZEROS, BLOCK_K, BLOCK_N, FP4, INT_FOLD,
                                     INT_MAGIC, DOT_PRECISION, two23)
                acc_up = _int_step(acc_up, a_in, u, uz_ptrs + grp, us_ptrs + grp, mask_n, BITS,
                                   HAS_ZEROS, BLOCK_K, BLOCK_N, FP4, INT_FOLD, INT_MAGIC,
                                   DOT_PRECISION, two23)
        elif FP8:  # one scale group per step: scale the step's fp32 products, then add
            a, a_scale = _fp8_a_tile(a, xs_ptrs, valid, k0 // W_BK, QUANT_A, UPCAST)
            g_scale = tl.load(gs_ptrs + (k0 // W_BK) * ws_s2, mask=mask_n, other=0.0)
            u_scale = tl.load(us_ptrs + (k0 // W_BK) * ws_s2, mask=mask_n, other=0.0)
            acc_gate += _fp8_dot(a, g, UPCAST) * a_scale[:, None] * g_scale[None, :]
            acc_up += _fp8_dot(a, u, UPCAST) * a_scale[:, None] * u_scale[None, :]
        else:
            if UPCAST:  # the CPU interpreter's bf16 arithmetic is wrong: convert at once there
                a = a.to(tl.float32)
                g = g.to(tl.float32)
                u = u.to(tl.float32)
            acc_gate = tl.dot(a, g, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(a, u, acc_up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        gate_ptrs += W_STEP
        up_ptrs += W_STEP
    if HAS_BIAS:
        b_ptrs = b_ptr + expert * b_s0 + offs_n
        acc_gate += tl.load(b_ptrs, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_ptrs + inter, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if FP8:  # the same roundings, to nearest even on the interpreter too
        gate = _round_to(acc_gate, ACT_DTYPE, UPCAST)
        up = _round_to(acc_up, ACT_DTYPE, UPCAST)
        act = _round_to(_glu(gate, up, ACT, act_limit), ACT_DTYPE, UPCAST)
        if QUANT_OUT:  # this slice is one scale group of the down GEMM's K
            act, act_scale = _quant_rows(act, UPCAST)
            tl.store(acts_ptr + pair.to(tl.int64) * acts_s0 + pid_n, act_scale, mask=valid)
        dst = act_ptr + pair.to(tl.int64)[:, None] * act_s0 + offs_n[None, :]
        tl.store(dst, act.to(act_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])
    else:
        # The unfused layers round gate/up to the dtype, then silu(gate) * up (fp32) once more.
        dtype = act_ptr.dtype.element_ty
        gate = acc_gate.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        act = _glu(gate, up, ACT, act_limit)
        dst = act_ptr + pair.to(tl.int64)[:, None] * act_s0 + offs_n[None, :]
        tl.store(dst, act.to(dtype), mask=valid[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_pid_m"])
def _moe_down_kernel(
    act_ptr: tl.tensor,
    w_ptr: tl.tensor,
    tw_ptr: tl.tensor,
    y_ptr: tl.tensor,
    sorted_ptr: tl.tensor,
    block_expert_ptr: tl.tensor,
    num_post_ptr: tl.tensor,
    num_pairs: int,
    num_pid_m: int,
    top_k: int,
    hidden: int,
    inter: int,
    act_s0: int,
    w_s0: int,
    w_s1: int,
    tw_s0: int,
    tw_s1: int,
    y_s0: int,
    out_ptr: tl.tensor,
    counters_ptr: tl.tensor,
    out_s0: int,
    as_ptr: tl.tensor,
    ws_ptr: tl.tensor,
    as_s0: int,
    ws_s0: int,
    ws_s1: int,
    ws_s2: int,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FUSED_COMBINE: tl.constexpr,
    FP8: tl.constexpr,
    QUANT_A: tl.constexpr,
    W_BN: tl.constexpr,
    W_BK: tl.constexpr,
    wz_ptr: tl.tensor = None,
    INT: tl.constexpr = False,
    BITS: tl.constexpr = 4,
    HAS_ZEROS: tl.constexpr = False,
    FP4: tl.constexpr = False,
    INT_FOLD: tl.constexpr = False,
    INT_MAGIC: tl.constexpr = False,
    two23: int = 0,
    b_ptr: tl.tensor = None,
    b_s0: int = 0,
    HAS_BIAS: tl.constexpr = False,
) -> None:
    """``y`` (and, ``FUSED_COMBINE``, ``out``) of one block of sorted pairs and ``BLOCK_N``
    hidden features (``HAS_BIAS``: plus the expert's down bias ``b`` ``[E, H]`` before the
    routing weight). ``INT``: packed integer weights (as the gate/up kernel's). ``FP8``:
    ``w`` is e4m3 with block scales ``ws`` and ``act`` is fp8 with
    per-(pair, group) scales ``as`` or, with ``QUANT_A`` (``BLOCK_K == W_BK``), ``act`` itself
    quantized step by step here."""
    num_pid_n = tl.cdiv(hidden, BLOCK_N)
    pid_m, pid_n = _block_tile(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    valid = pair < num_pairs
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + pair.to(tl.int64)[:, None] * act_s0 + offs_k[None, :]
    W_STEP: tl.constexpr = BLOCK_K // (32 // BITS) if INT else BLOCK_K
    w_ptrs = (w_ptr + expert * w_s0 + offs_n.to(tl.int64)[None, :] * w_s1
              + tl.arange(0, W_STEP)[:, None])
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if INT:
        s_ptrs = ws_ptr + expert * ws_s0 + offs_n.to(tl.int64) * ws_s1
        z_ptrs = wz_ptr + expert * ws_s0 + offs_n.to(tl.int64) * ws_s1
    if FP8:
        ws_ptrs = ws_ptr + expert * ws_s0 + (offs_n // W_BN).to(tl.int64) * ws_s1
        as_ptrs = as_ptr + pair.to(tl.int64) * as_s0
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            mask_k = offs_k < inter - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=_step_mask(offs_k, inter - k0, W_STEP, BLOCK_K)
                        & mask_n[None, :], other=0.0)
        if INT:
            grp = (k0 // W_BK) * ws_s2
            a_in = a.to(tl.float32) if UPCAST else a
            if BLOCK_K > W_BK:  # MXFP4 over several groups: the scales are in the weights
                w = _int_tile(w, z_ptrs, mask_n, BITS, False, BLOCK_K, BLOCK_N, True,
                              s_ptrs + grp, ws_s2, W_BK, INT_MAGIC, inter - k0)
                acc = tl.dot(a_in, w.to(a_in.dtype), acc, input_precision=DOT_PRECISION)
            else:
                acc = _int_step(acc, a_in, w, z_ptrs + grp, s_ptrs + grp, mask_n, BITS,
                                HAS_ZEROS, BLOCK_K, BLOCK_N, FP4, INT_FOLD, INT_MAGIC,
                                DOT_PRECISION, two23)
        elif FP8:
            a, a_scale = _fp8_a_tile(a, as_ptrs, valid, k0 // W_BK, QUANT_A, UPCAST)
            w_scale = tl.load(ws_ptrs + (k0 // W_BK) * ws_s2, mask=mask_n, other=0.0)
            acc += _fp8_dot(a, w, UPCAST) * a_scale[:, None] * w_scale[None, :]
        else:
            if UPCAST:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += W_STEP
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * b_s0 + offs_n, mask=mask_n, other=0.0).to(
            tl.float32)[None, :]
    token = pair // top_k
    slot = pair - token * top_k
    weight = tl.load(tw_ptr + token.to(tl.int64) * tw_s0 + slot * tw_s1, mask=valid, other=0.0)
    acc = acc * weight.to(tl.float32)[:, None]
    dst = y_ptr + pair.to(tl.int64)[:, None] * y_s0 + offs_n[None, :]
    tl.store(dst, acc, mask=valid[:, None] & mask_n[None, :])
    if FUSED_COMBINE:
        # Count this slice's arrivals per token; the program bringing a token's count to K
        # adds its K rows in slot order (deterministic), writes the output row slice and
        # resets the count for the next launch.
        tl.debug_barrier()  # every thread's rows are stored before the release
        token64 = token.to(tl.int64)
        counter = counters_ptr + token64 * num_pid_n + pid_n
        arrived = tl.atomic_add(counter, 1, mask=valid, sem="acq_rel")
        last = valid & (arrived == top_k - 1)
        if tl.sum(last.to(tl.int32), axis=0) > 0:
            tl.debug_barrier()  # the acquiring threads' view before the others' loads
            mask = last[:, None] & mask_n[None, :]
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for j in range(0, top_k):
                src = y_ptr + (token64 * top_k + j)[:, None] * y_s0 + offs_n[None, :]
                total += tl.load(src, mask=mask, other=0.0, cache_modifier=".cg")
            out = out_ptr + token64[:, None] * out_s0 + offs_n[None, :]
            tl.store(out, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(counter, tl.zeros([BLOCK_M], dtype=tl.int32), mask=last)


@triton.jit(do_not_specialize=["num_tokens"])
def _moe_combine_kernel(
    y_ptr: tl.tensor,
    out_ptr: tl.tensor,
    num_tokens: int,
    top_k: int,
    hidden: int,
    y_s0: int,
    out_s0: int,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
) -> None:
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (tokens < num_tokens)[:, None] & (cols < hidden)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in range(0, top_k):  # slot order: deterministic
        src = y_ptr + (tokens * top_k + j)[:, None] * y_s0 + cols[None, :]
        acc += tl.load(src, mask=mask, other=0.0)
    dst = out_ptr + tokens[:, None] * out_s0 + cols[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)
