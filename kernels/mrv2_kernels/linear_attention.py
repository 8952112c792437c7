"""Device ops of hybrid linear-attention layers (Qwen3-Next's Gated DeltaNet, Mamba-2 mixers):
the causal depthwise conv over the fused q/k/v projection (its reference and kernel in
:mod:`mrv2_kernels.causal_conv1d`), and the gated delta rule recurrence (without its delta
term, Mamba-2's SSM).

Both are varlen over a flat token batch and keep per-request state in a tensor indexed by a
state **row** (not by batch position): the step metadata, prefix caching's ``state_table``,
speculative decoding's ``row_slots`` and the state layouts are specified in
:mod:`mrv2_kernels.recurrent_state`'s docstring (its names are re-exported here).

The delta-rule kernel's program owns a (sequence, v head, V block) state tile, which stays in
registers in fp32 while it walks the sequence's tokens in order. This token-serial delta rule
is right for decode and acceptable for prefill; the chunked prefill path (WY representation /
UT transform: intra-chunk work as matrix products, the state carried across chunks, as the
fla library's ``chunk_gated_delta_rule``) is :mod:`mrv2_kernels.chunk_delta_rule`.

``causal_conv1d`` (the dispatcher) stays here beside ``gated_delta_rule``: both dispatch
through this module's :func:`use_triton`, which tests patch to route both onto the kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._backend import (
    cdiv,
    default_block,
    next_power_of_2,
    pdl,
    pdl_early_meta,
    pdl_prologue,
    pdl_release,
    pdl_wait,
    use_triton,
)
from .causal_conv1d import causal_conv1d_ref, causal_conv1d_triton
from .recurrent_state import (
    _KERNEL_DTYPES,
    MAX_ROW_SLOTS,
    STATE_TABLE_COLS,
    _check_meta,
    _check_table,
    _empty,
    _zero_tail,
    check_row_slots,
    default_state_table,
    iter_sequences,
    kept_counts,
)

__all__ = [
    "MAX_ROW_SLOTS",
    "STATE_TABLE_COLS",
    "causal_conv1d",
    "causal_conv1d_ref",
    "causal_conv1d_triton",
    "check_row_slots",
    "gated_delta_rule",
    "gated_delta_rule_ref",
    "default_state_table",
    "gated_delta_rule_triton",
    "gates_from_logits",
    "kept_counts",
    "mamba_gates",
]

#: The largest key head dim of :func:`gated_delta_rule_triton` (one register tile of K).
MAX_K = 256
_L2_EPS = 1e-6


# ------------------------------------------------- causal conv1d (kernel: causal_conv1d.py)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, state_rows: torch.Tensor,
    activation: str | None = None, state_table: torch.Tensor | None = None,
    row_slots: int = 1,
) -> torch.Tensor:
    """Varlen causal depthwise conv1d with a rolling per-row state (Qwen3-Next's q/k/v conv).

    ``x`` ``[T, D]`` (fp32/bf16/fp16), ``weight`` ``[D, W]``, ``bias`` ``[D]`` or None,
    ``conv_state`` ``[R, W - 1, D]`` in ``x``'s dtype (each row's last ``W - 1`` inputs, oldest
    first), ``activation`` ``"silu"`` or None; the metadata as in the module docstring. Per
    sequence: ``ctx = conv_state[row]`` if ``start > 0`` else zeros; ``xs = cat(ctx,
    x[tokens])``; ``out[t] = act(bias + sum_j weight[:, j] * xs[t + j])`` in fp32 (the last tap
    multiplies the current token: ``nn.Conv1d(groups=D, padding=W - 1)`` truncated to the
    sequence); then ``conv_state[row] = xs[-(W - 1):]``, in place. Returns ``out`` ``[T, D]`` in
    ``x``'s dtype, zero on padding tokens. ``state_table``: snapshots and resumed states;
    ``row_slots``: the rows a sequence owns under speculative decoding (module docstring). Runs
    :func:`causal_conv1d_triton` when :func:`use_triton` says so, else
    :func:`causal_conv1d_ref`.
    """
    if use_triton(x) and x.dtype in _KERNEL_DTYPES:
        return causal_conv1d_triton(x, weight, bias, conv_state, query_start_loc, seq_lens,
                                    state_rows, activation, state_table, row_slots)
    return causal_conv1d_ref(x, weight, bias, conv_state, query_start_loc, seq_lens,
                             state_rows, activation, state_table, row_slots)


# ---------------------------------------------------------------------- gated delta rule


def _check_gdr(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, vector_gate: bool = False) -> None:
    """The shapes and the state's dtype (``vector_gate``: ``g`` may also be ``[T, Hv, K]``,
    one decay per key channel; every form of the op takes it)."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q, k must be [T, Hk, K] and v [T, Hv, V], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    num_tokens, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hk == 0 or hv % hk:
        raise ValueError(f"the v heads ({hv}) must be a multiple of the q/k heads ({hk})")
    if beta.shape != (num_tokens, hv):
        raise ValueError(f"beta must have shape ({num_tokens}, {hv}), got {tuple(beta.shape)}")
    if g.shape != (num_tokens, hv) and not (vector_gate and g.shape == (num_tokens, hv, dk)):
        vec = f" or ({num_tokens}, {hv}, {dk})" if vector_gate else ""
        raise ValueError(f"g must have shape ({num_tokens}, {hv}){vec}, got {tuple(g.shape)}")
    if state.dim() != 4 or state.shape[1:] != (hv, dk, dv):
        raise ValueError(f"state must be [R, {hv}, {dk}, {dv}], got {tuple(state.shape)}")
    if state.dtype != torch.float32:
        raise TypeError(f"state must be fp32, got {state.dtype}")


def gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, scale: float, l2norm_qk: bool = True, *, delta: bool = True,
    state_table: torch.Tensor | None = None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    dt_limits: tuple[float, float] | None = None, skip: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, row_slots: int = 1,
) -> torch.Tensor:
    """Plain-torch specification of :func:`gated_delta_rule` (reads the metadata on the host):
    token by token, as HF transformers' ``torch_recurrent_gated_delta_rule`` (``delta=False``:
    the Mamba-2 SSM recurrence; a ``[T, Hv, K]`` ``g``: its ``recurrent_kimi_delta_attention``,
    Kimi Delta Attention's per-channel decay)."""
    _check_gdr(q, k, v, g, beta, state, vector_gate=True)
    g, beta = resolve_gates(g, beta, v, gate_params, dt_limits, skip)
    _check_meta(query_start_loc, seq_lens, state_rows)
    _check_table(state_table)
    slots = check_row_slots(row_slots)
    hv, dk, dv = state.shape[1:]
    group = hv // q.shape[1]
    out = torch.zeros(v.shape, dtype=out_dtype or v.dtype, device=v.device)
    for seq in iter_sequences(query_start_loc, seq_lens, state_rows, state_table, slots):
        bos, eos, length = seq.bos, seq.eos, seq.length
        keep = dict(seq.kept)
        if seq.start > 0:
            s = state[seq.src].clone()
        else:
            s = torch.zeros(hv, dk, dv, dtype=torch.float32, device=state.device)
        qs = q[bos:eos].float().repeat_interleave(group, dim=1)  # [L, Hv, K]
        ks = k[bos:eos].float().repeat_interleave(group, dim=1)
        if l2norm_qk:
            qs = qs * torch.rsqrt((qs * qs).sum(-1, keepdim=True) + _L2_EPS)
            ks = ks * torch.rsqrt((ks * ks).sum(-1, keepdim=True) + _L2_EPS)
        qs = qs * scale
        vs, gs, bs = v[bos:eos].float(), g[bos:eos].float(), beta[bos:eos].float()
        for t in range(length):
            # the decay scales the state's rows: per head, or per key channel ([Hv, K])
            s = s * (gs[t].exp()[:, :, None] if gs.dim() == 3 else gs[t].exp()[:, None, None])
            upd = vs[t]
            if delta:
                upd = upd - (s * ks[t][:, :, None]).sum(1)  # v - S^T k: [Hv, V]
            s = s + ks[t][:, :, None] * (upd * bs[t][:, None])[:, None, :]
            o = (s * qs[t][:, :, None]).sum(1)
            if skip is not None:
                o = o + skip.float()[:, None] * vs[t]
            out[bos + t] = o.to(out.dtype)
            for c, snap_row in seq.snaps:
                if c == t + 1:
                    state[snap_row] = s
            if t + 1 in keep:
                state[keep[t + 1]] = s
    return out


def gates_from_logits(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor,
                      dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's decay and write strength from the projections' raw values (HF's
    Qwen3-Next): ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``, fp32,
    ``A_log`` and ``dt_bias`` per v head. With ``a`` ``[T, Hv, K]`` (Kimi Delta Attention's
    per-channel decay, HF's ``KimiLinearForgetGate``): ``A_log`` ``[Hv]``, ``dt_bias``
    ``[Hv, K]``, ``g`` ``[T, Hv, K]``."""
    _check_gate_params(a, a_log, dt_bias, b.shape[-1])
    neg_a = -a_log.float().exp()
    if a.dim() == 3:
        neg_a = neg_a[:, None]
    g = neg_a * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def resolve_gates(g: torch.Tensor, beta: torch.Tensor, v: torch.Tensor,
                  gate_params: tuple[torch.Tensor, torch.Tensor] | None,
                  dt_limits: tuple[float, float] | None, skip: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The references' gates: the keywords checked, then ``g`` and ``beta`` as given, or made
    from the raw projections (:func:`gates_from_logits`; with ``dt_limits``
    :func:`mamba_gates`, per-head ``g`` only)."""
    _check_extras(v, gate_params, dt_limits, skip)
    if g.dim() == 3 and dt_limits is not None:
        raise ValueError("dt_limits (Mamba-2 gates) takes a per-head g [T, Hv], not a "
                         "per-channel one")
    if gate_params is None:
        return g, beta
    if dt_limits is None:
        return gates_from_logits(g, beta, *gate_params)
    return mamba_gates(g, *gate_params, dt_limits)


def check_triton_args(
    op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, state_rows: torch.Tensor, state_table: torch.Tensor | None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None,
    dt_limits: tuple[float, float] | None, skip: torch.Tensor | None,
    vector_gate: bool = False,
) -> int:
    """What both Triton forms of the delta rule check before launching (``op``: the name their
    errors give): shapes, metadata, the table and the keywords, the dtypes, the state's
    contiguous last dim, ``K <= MAX_K``. Returns the sequence count ``N``. ``vector_gate``:
    ``g`` may be per key channel (both forms take it)."""
    _check_gdr(q, k, v, g, beta, state, vector_gate)
    n = _check_meta(query_start_loc, seq_lens, state_rows)
    _check_table(state_table)
    if gate_params is not None:
        _check_gate_params(g, *gate_params, beta.shape[-1])
    _check_extras(v, gate_params, dt_limits, skip)
    if g.dim() == 3 and dt_limits is not None:
        raise ValueError("dt_limits (Mamba-2 gates) takes a per-head g [T, Hv], not a "
                         "per-channel one")
    for t in (q, k, v, beta):
        if t.dtype not in _KERNEL_DTYPES:
            raise TypeError(f"{op} takes fp32/bf16/fp16, got {t.dtype}")
    if state.stride(-1) != 1:
        raise ValueError("state must have a contiguous last dim")
    if q.shape[2] > MAX_K:
        raise ValueError(f"the key head dim must be at most {MAX_K}, got {q.shape[2]}")
    return n


@triton.jit
def raw_gates(gv: tl.tensor, bv: tl.tensor, neg_a: tl.tensor, dt_bias: tl.tensor,
              dt_lo: float, dt_hi: float, MAMBA_GATES: tl.constexpr
              ) -> tuple[tl.tensor, tl.tensor]:
    """Triton helper shared by both kernels: the log decay and write strength (fp32, scalars
    or vectors) from the raw ``g`` / ``beta`` values, ``neg_a = -exp(A_log[h])``:
    :func:`gates_from_logits`' arithmetic, or with ``MAMBA_GATES`` :func:`mamba_gates`' (``beta
    = clamp(softplus(g + dt_bias))``, ``g = neg_a * beta``; ``bv`` unused)."""
    xa = gv + dt_bias
    sp = tl.where(xa > 20.0, xa, tl.log(1.0 + tl.exp(xa)))  # softplus
    if MAMBA_GATES:
        step = tl.minimum(tl.maximum(sp, dt_lo), dt_hi)
        return neg_a * step, step
    return neg_a * sp, 1.0 / (1.0 + tl.exp(-bv))


def mamba_gates(dt: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                dt_limits: tuple[float, float]) -> tuple[torch.Tensor, torch.Tensor]:
    """A Mamba-2 mixer's decay and write strength from its raw ``dt`` projection: ``dt =
    clamp(softplus(dt + dt_bias), *dt_limits)``, ``g = -exp(A_log) * dt``, ``beta = dt``
    (fp32; per head)."""
    _check_gate_params(dt, a_log, dt_bias)
    step = F.softplus(dt.float() + dt_bias.float()).clamp(min=dt_limits[0], max=dt_limits[1])
    return -a_log.float().exp() * step, step


def _check_extras(v: torch.Tensor, gate_params: tuple[torch.Tensor, torch.Tensor] | None,
                  dt_limits: tuple[float, float] | None, skip: torch.Tensor | None) -> None:
    if dt_limits is not None and gate_params is None:
        raise ValueError("dt_limits (Mamba-2 gates) needs gate_params=(A_log, dt_bias)")
    if skip is not None and skip.shape != (v.shape[1],):
        raise ValueError(f"skip must have shape ({v.shape[1]},) (one D per v head), got "
                         f"{tuple(skip.shape)}")


def _check_gate_params(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
                       hv: int | None = None) -> None:
    """``A_log`` ``[Hv]`` and ``dt_bias`` ``[Hv]`` (``a`` ``[T, Hv]``) or ``[Hv, K]`` (``a``
    ``[T, Hv, K]``: a per-channel decay); ``hv``: the v heads (default ``a``'s last dim)."""
    vector = a.dim() == 3
    hv = a.shape[1] if vector else (a.shape[-1] if hv is None else hv)
    want = {"A_log": (hv,), "dt_bias": (hv, a.shape[2]) if vector else (hv,)}
    for name, t in (("A_log", a_log), ("dt_bias", dt_bias)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"gate_params: {name} must have shape {want[name]}, got "
                             f"{tuple(t.shape)}")


@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "max_len"])
def _gated_delta_rule_kernel(
    q_ptr: tl.tensor, k_ptr: tl.tensor, v_ptr: tl.tensor, g_ptr: tl.tensor,
    beta_ptr: tl.tensor, state_ptr: tl.tensor, out_ptr: tl.tensor,
    qsl_ptr: tl.tensor, seq_lens_ptr: tl.tensor, rows_ptr: tl.tensor, tbl_ptr: tl.tensor,
    a_log_ptr: tl.tensor, dt_bias_ptr: tl.tensor, skip_ptr: tl.tensor, dt_lo: float,
    dt_hi: float,
    num_seqs: int, num_tokens: int, max_len: int, scale: float, dim_k: int, dim_v: int,
    group: int, q_st: int, q_sh: int, k_st: int, k_sh: int, v_st: int, v_sh: int,
    g_st: int, g_sh: int, g_sk: int, b_st: int, b_sh: int, o_st: int, o_sh: int,
    s_sr: int, s_sh: int, s_sk: int,
    L2NORM: tl.constexpr, DELTA: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr, HAS_TABLE: tl.constexpr, RAW_GATES: tl.constexpr,
    MAMBA_GATES: tl.constexpr, HAS_SKIP: tl.constexpr, ROW_SLOTS: tl.constexpr,
    PDL: tl.constexpr, EARLY: tl.constexpr = False, VEC_GATE: tl.constexpr = False,
) -> None:
    # VEC_GATE: g is [T, Hv, K], one decay per key channel (Kimi Delta Attention; dt_bias
    # [Hv, K] with RAW_GATES); off, the per-head scalar decay, compiled as before.
    # EARLY (pdl_early_meta's rule): the step's metadata, the state table, the gates'
    # parameters and the initial state tile are loaded before the wait for the previous
    # kernel, only q/k/v and the gates after it. No PDL kernel writes them: a layer's state
    # rows are written by this kernel alone (the sequence's own rows, in earlier steps).
    if EARLY:
        pdl_release(PDL)
    else:
        pdl_prologue(PDL)
    # Programs (i < N, v head, V block) run sequence i; programs (N, ...) zero the padding.
    seq = tl.program_id(0)
    h = tl.program_id(1)
    kk = tl.arange(0, BLOCK_K)
    kmask = kk < dim_k
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    vmask = vv < dim_v
    if seq == num_seqs:
        if EARLY:
            pdl_wait(PDL)
        _zero_tail(out_ptr + h * o_sh, qsl_ptr, num_seqs, num_tokens, o_st, vv, vmask,
                   BLOCK_T, BLOCK_V)
        return
    bos = tl.load(qsl_ptr + seq).to(tl.int32)
    eos = tl.load(qsl_ptr + seq + 1).to(tl.int32)
    # padding (its row may be another sequence's), or longer than max_len (the chunked
    # kernels' to run)
    if (eos <= bos) | (eos - bos > max_len):
        if EARLY:
            pdl_wait(PDL)  # (every program waits: the chain's completion goes through it)
        return
    start = tl.load(seq_lens_ptr + seq).to(tl.int32) - (eos - bos)
    has_init = start > 0
    row = tl.load(rows_ptr + seq).to(tl.int64)
    hk = h // group
    tile = h * s_sh + kk[:, None] * s_sk + vv[None, :]
    smask = kmask[:, None] & vmask[None, :]
    # The table as scalars (rows and in-chunk counts): the snapshot stores below are scalar
    # branches, so no second or third [K, V] pointer tensor stays live through the token loop
    # (they spilled: 184 bytes at K = 128, V block 32).
    n = eos - bos
    base = row * ROW_SLOTS  # the sequence's first state row (ROW_SLOTS: module docstring)
    src_row = base + start % ROW_SLOTS
    c0 = -1  # snapshots: after c0 / c1 tokens, into rows snap0 / snap1
    c1 = -1
    snap0 = row
    snap1 = row
    if HAS_TABLE:
        tbl = tbl_ptr + row * 6
        src_row = tl.where(start == tl.load(tbl + 1), tl.load(tbl).to(tl.int64), src_row)
        c0 = tl.load(tbl + 2) - start
        snap0 = tl.load(tbl + 3).to(tl.int64)
        c1 = tl.load(tbl + 4) - start
        snap1 = tl.load(tbl + 5).to(tl.int64)
    s = tl.load(state_ptr + src_row * s_sr + tile, mask=smask & has_init, other=0.0)
    if RAW_GATES:  # g and beta from the raw projections: gates_from_logits / mamba_gates
        neg_a = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
        if VEC_GATE:
            dt_bias = tl.load(dt_bias_ptr + h * dim_k + kk, mask=kmask, other=0.0).to(
                tl.float32)
        else:
            dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    if HAS_SKIP:
        skip = tl.load(skip_ptr + h).to(tl.float32)
    if EARLY:
        pdl_wait(PDL)  # (the state tile's load stays in flight through it)
    bos64 = bos.to(tl.int64)
    for i in range(0, n):
        t64 = bos64 + i
        qt = tl.load(q_ptr + t64 * q_st + hk * q_sh + kk, mask=kmask, other=0.0).to(tl.float32)
        kt = tl.load(k_ptr + t64 * k_st + hk * k_sh + kk, mask=kmask, other=0.0).to(tl.float32)
        vt = tl.load(v_ptr + t64 * v_st + h * v_sh + vv, mask=vmask, other=0.0).to(tl.float32)
        if VEC_GATE:
            gt = tl.load(g_ptr + t64 * g_st + h * g_sh + kk * g_sk, mask=kmask,
                         other=0.0).to(tl.float32)
        else:
            gt = tl.load(g_ptr + t64 * g_st + h * g_sh).to(tl.float32)
        bt = tl.load(beta_ptr + t64 * b_st + h * b_sh).to(tl.float32)
        if RAW_GATES:
            gt, bt = raw_gates(gt, bt, neg_a, dt_bias, dt_lo, dt_hi, MAMBA_GATES)
        v_in = vt
        if L2NORM:
            qt = qt * tl.rsqrt(tl.sum(qt * qt, axis=0) + 1e-6)
            kt = kt * tl.rsqrt(tl.sum(kt * kt, axis=0) + 1e-6)
        qt = qt * scale
        if VEC_GATE:  # noqa: SIM108 (constexpr: one branch compiled)
            s = s * tl.exp(gt)[:, None]  # (the state's rows, per key channel)
        else:
            s = s * tl.exp(gt)
        if DELTA:
            vt = vt - tl.sum(s * kt[:, None], axis=0)  # v - S^T k: [BLOCK_V]
        s = s + kt[:, None] * (vt * bt)[None, :]
        o = tl.sum(s * qt[:, None], axis=0)
        if HAS_SKIP:
            o += skip * v_in
        tl.store(out_ptr + t64 * o_st + h * o_sh + vv, o.to(out_ptr.dtype.element_ty),
                 mask=vmask)
        if HAS_TABLE:
            if i + 1 == c0:
                tl.store(state_ptr + snap0 * s_sr + tile, s, mask=smask)
            if i + 1 == c1:
                tl.store(state_ptr + snap1 * s_sr + tile, s, mask=smask)
        if ROW_SLOTS > 1:  # noqa: SIM102 (constexpr: compiled out at 1)
            # the states after the chunk's last tokens but the final one
            if (i + ROW_SLOTS >= n) & (i + 1 < n):
                kept = base + (start + i + 1) % ROW_SLOTS
                tl.store(state_ptr + kept * s_sr + tile, s, mask=smask)
    tl.store(state_ptr + (base + (start + n) % ROW_SLOTS) * s_sr + tile, s, mask=smask)


def gated_delta_rule_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, scale: float, l2norm_qk: bool = True,
    *,
    delta: bool = True,
    state_table: torch.Tensor | None = None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    dt_limits: tuple[float, float] | None = None, skip: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, row_slots: int = 1,
    block_v: int | None = None, max_len: int | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton implementation of :func:`gated_delta_rule`: one launch, grid ``(N + 1, Hv, V /
    block_v)``. Program ``(i, h, c)`` keeps its ``[K, block_v]`` state tile in fp32 registers
    (``K <= 256``, padded to a power of two) and walks sequence ``i``'s tokens in order, its
    loop bounds read on the device; programs ``(N, h, c)`` zero the padding tokens. q/k/v may
    be strided views (their last dim is made contiguous); ``state`` must have a contiguous
    last dim (it is updated in place). ``max_len``: sequences of more tokens are left alone
    (their outputs and states unwritten: the chunked kernels' share of a step,
    :func:`mrv2_kernels.chunk_delta_rule.chunk_gated_delta_rule_triton`'s ``serial_below``);
    ``out``: the ``[T, Hv, V]`` buffer to write (``out_dtype`` is then its dtype)."""
    n = check_triton_args("gated_delta_rule_triton", q, k, v, g, beta, state, query_start_loc,
                          seq_lens, state_rows, state_table, gate_params, dt_limits, skip,
                          vector_gate=True)
    vector = g.dim() == 3
    slots = check_row_slots(row_slots)
    num_tokens, hk, dk = q.shape
    hv, dv = v.shape[1:]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if out is None:
        out = _empty((num_tokens, hv, dv), out_dtype or v.dtype, v.device)
    elif out.shape != (num_tokens, hv, dv) or out.stride(-1) != 1:
        raise ValueError(f"out must be [T, Hv, V] = [{num_tokens}, {hv}, {dv}] with a "
                         f"contiguous last dim, got {tuple(out.shape)}")
    if out.numel() == 0:
        return out
    block_k = next_power_of_2(dk)
    pow2 = next_power_of_2(dv)
    # [K, 16] state tiles in 4 warps at K = 128: ptxas (sm_90) gives them 219 registers and no
    # spills with the snapshot table; [K, 32] in 4 warps spilled 172 bytes (255 registers)
    bv = default_block(v, cuda=min(16, pow2), cpu=min(64, pow2), block=block_v)
    warps = max(1, min(8, block_k * bv // 512)) if v.is_cuda else 1
    _gated_delta_rule_kernel[(n + 1, hv, cdiv(dv, bv))](
        q, k, v, g, beta, state, out, query_start_loc, seq_lens, state_rows,
        state_rows if state_table is None else state_table,
        # (the kernel reads A_log, dt_bias and skip at [h]: contiguous, as the chunked path's)
        *((gate_params[0].contiguous(), gate_params[1].contiguous())
          if gate_params is not None else (g, g)), g if skip is None else skip.contiguous(),
        *(dt_limits if dt_limits is not None else (0.0, 0.0)),
        n, num_tokens, num_tokens if max_len is None else max_len, float(scale), dk, dv,
        hv // hk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), g.stride(2) if vector else 0, beta.stride(0),
        beta.stride(1), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        L2NORM=l2norm_qk, DELTA=delta, BLOCK_K=block_k, BLOCK_V=bv, BLOCK_T=8,
        HAS_TABLE=state_table is not None, RAW_GATES=gate_params is not None,
        MAMBA_GATES=dt_limits is not None, HAS_SKIP=skip is not None, ROW_SLOTS=slots,
        num_warps=warps, EARLY=pdl_early_meta(v, default=True), VEC_GATE=vector,
        **pdl(v),
    )
    return out


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, scale: float, l2norm_qk: bool = True, *, delta: bool = True,
    state_table: torch.Tensor | None = None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    dt_limits: tuple[float, float] | None = None, skip: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, row_slots: int = 1,
) -> torch.Tensor:
    """Varlen gated delta rule with a per-row fp32 matrix state (Qwen3-Next's linear attention).

    ``q``, ``k`` ``[T, Hk, K]``; ``v`` ``[T, Hv, V]`` with ``Hv`` a multiple of ``Hk`` (v head
    ``h`` reads q/k head ``h // (Hv // Hk)``); ``g`` ``[T, Hv]`` fp32 log decay (``<= 0``), or
    ``[T, Hv, K]``: one per key channel, ``S = diag(exp(g)) S`` (Kimi Delta Attention, HF's
    ``recurrent_kimi_delta_attention``; with ``gate_params``, ``dt_bias`` is then ``[Hv, K]``);
    ``beta`` ``[T, Hv]`` (already sigmoid-ed); ``state`` ``[R, Hv, K, V]`` fp32; the metadata as
    in the module docstring. Per sequence and v head, from ``S = state[row, h]`` if ``start >
    0`` else zeros, for each token in fp32: ``q, k`` l2-normalised (``rsqrt(sum(x^2) + 1e-6)``)
    when ``l2norm_qk``; ``q *= scale``; ``S *= exp(g)``; ``delta = (v - S^T k) * beta``; ``S +=
    outer(k, delta)``; ``o = S^T q``. ``delta=False`` drops the ``S^T k`` term (``S = exp(g) S +
    outer(k, beta v)``): Mamba-2's SSM with ``q = C``, ``k = B``, ``v = x``, ``g = dt A``,
    ``beta = dt``, ``l2norm_qk=False``, ``scale=1``. Returns ``o`` ``[T, Hv, V]`` in ``v``'s
    dtype (zero on padding tokens) and writes the final ``S`` into ``state[row, h]``, in place.
    ``state_table``: snapshots and resumed states (module docstring). ``gate_params`` ``(A_log,
    dt_bias)``: ``g`` and ``beta`` are the raw projections ``a`` and ``b``, turned into the decay
    and write strength inside the op (:func:`gates_from_logits`); with ``dt_limits`` both are
    the raw ``dt`` of a Mamba-2 mixer (:func:`mamba_gates`). ``skip`` ``[Hv]``: ``o += skip[h] *
    v`` (Mamba-2's ``D``). ``out_dtype``: the output's (default ``v``'s). ``row_slots``: the
    rows a sequence owns under speculative decoding (module docstring). Runs
    :func:`gated_delta_rule_triton` when :func:`use_triton` says so, else
    :func:`gated_delta_rule_ref`.
    """
    op = (gated_delta_rule_triton if use_triton(v) and all(
        t.dtype in _KERNEL_DTYPES for t in (q, k, v, beta)) else gated_delta_rule_ref)
    return op(q, k, v, g, beta, state, query_start_loc, seq_lens, state_rows, scale, l2norm_qk,
              delta=delta, state_table=state_table, gate_params=gate_params,
              dt_limits=dt_limits, skip=skip, out_dtype=out_dtype, row_slots=row_slots)
