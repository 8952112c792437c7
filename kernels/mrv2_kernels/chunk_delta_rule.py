"""Chunked prefill form of the gated delta rule (Qwen3-Next's Gated DeltaNet; without its delta
term, Mamba-2's SSM): the same op as :func:`mrv2_kernels.linear_attention.gated_delta_rule`,
same arguments, metadata and results up to fp32 rounding, computed a chunk of ``C`` tokens at a
time with matrix products instead of token by token (Yang et al., "Gated Delta Networks", the
WY representation / UT transform of the fla library's ``chunk_gated_delta_rule``).

**The algebra.** Per sequence and v head, chunks of ``C`` tokens aligned to the sequence's own
first token (a 5-token sequence is one partial chunk). In a chunk with state ``S`` ``[K, V]``
at its start, tokens ``i = 0 .. C-1``, ``G_i = g_0 + ... + g_i`` (the cumulative log decay,
``<= 0`` and non-increasing) and the token-serial update ``S_i = exp(g_i) S_{i-1} + k_i
u_i^T`` with ``u_i = beta_i (v_i - exp(g_i) S_{i-1}^T k_i)``::

    S_i = exp(G_i) S + sum_{j <= i} exp(G_i - G_j) k_j u_j^T
    (I + A) U = beta V - (beta exp(G) K) S,  A_ij = beta_i exp(G_i - G_j) k_i . k_j  (i > j)
    U = W_v - W_k S with T = (I + A)^-1, W_v = T (beta V) [C, V], W_k = T (beta exp(G) K) [C, K]
    O = (exp(G) Q) S + P U,  P_ij = exp(G_i - G_j) q_i . k_j  (i >= j, else 0)
    S' = exp(G_last) S + (exp(G_last - G) K)^T U

``delta=False`` (Mamba-2) has ``U = beta V`` and no ``T``. Decay factors between two tokens
are ``exp(G_i - G_j)`` for ``i >= j`` only, masked before the ``exp`` (the other half could
overflow); no ``exp(-G)`` is ever formed.

**The Triton path** is three launches (all PDL, none writes step metadata), the fla
library's split (Yang et al.'s ``chunk_gated_delta_rule``: the serial part of the work as small
as it can be, everything else parallel over the step's chunks); the kernels are in
:mod:`mrv2_kernels.chunk_delta_rule_kernels`:

1. :func:`_chunk_wy_kernel` (``delta=True`` only), grid ``(cdiv(T, C) + N, Hv)``: one
   program per (chunk, v head), parallel over every chunk of the step. A program finds its
   sequence and chunk on the device (:func:`mrv2_kernels._backend.flat_query_tile`: sequence
   ``i``'s chunks are numbered from ``query_start_loc[i] // C + i``, so the grid bound needs
   only host-known ``T`` and ``N``; programs past a sequence's chunks return at once), builds
   ``A`` from ``K K^T`` of the raw keys (their l2 norms scale its rows and columns), inverts
   ``I + A`` and writes ``W_k`` and ``W_v`` (fp32 scratch ``[T, Hv, K]`` and ``[T, Hv, V]``,
   by token). The inverse: the ``[SUB, SUB]`` diagonal blocks ``D`` by forward substitution in
   fp32 vector arithmetic (``SUB - 1`` steps over all blocks at once, through the program's
   ``[C, C]`` tile in the chunk's slot of the state scratch below), then ``T = (I + N)^-1
   D^-1`` with ``N = D^-1 L`` (``L``: the blocks below the diagonal), strictly block-lower, so
   the series ``(I - N)(I + N^2)(I + N^4)...`` ends after ``log2(C / SUB)`` factors: ``2 + 2
   log2(C / SUB)`` ``[C, C]`` products in all (exact algebra; ``C / SUB <= 4``, since N's
   powers cancel and lose fp32 accuracy with more blocks). (Block rows in order through the scratch
   tile, each ``T_bj`` a sum of ``[SUB, SUB]`` products, gave the interpreter's results but
   errors of ~1e-5 on an H100 at ``C = 64`` with exact products: a hazard between the
   program's own stores and loads there that barriers did not close.)
2. :func:`_chunk_state_kernel`, grid ``(N + 1, Hv, V / BLOCK_V)``: program ``(i, h, c)`` walks
   sequence ``i``'s chunks in order (``ceil(L / C)`` serial steps instead of ``L``), its state
   tile ``[K, BLOCK_V]`` fp32 in registers. Per chunk: the tile into the chunk's slot of the
   state scratch (``[cdiv(T, C) + N, Hv, K * V]`` fp32, the flat chunk numbering), ``U = W_v -
   W_k S`` (written over ``W_v``), the states a snapshot or ``row_slots`` keeps inside the
   chunk, then ``S' = exp(G_last) S + (exp(G_last - G) K)^T U``: two products of the chunk's
   serial chain. Programs ``(N, h, c)`` zero the padding tokens.
3. :func:`_chunk_out_kernel`, grid ``(cdiv(T, C) + N, Hv, V / BLOCK_V_OUT)``, parallel over
   chunks: ``O = (exp(G) Q) S_c + P U`` from the chunk's initial state ``S_c``, over K blocks
   of ``BLOCK_K`` (``Q K^T``, ``Q S_c``, the norms).

``G`` is a ``tl.cumsum`` of the chunk's ``g`` (dead rows add 0).

**The keywords** of the token-serial op, all taken. ``gate_params`` (``dt_limits``): the
kernels turn the raw ``g`` / ``beta`` into gates where they load them (:func:`_load_gates`, the
token-serial kernel's arithmetic), zeroed on a partial chunk's dead rows. ``skip``: ``o +=
skip[h] v`` in the output kernel; ``out_dtype``: the output buffer's. ``state_table``: the
scan reads the first chunk's initial state from ``src_row`` when the sequence resumes there
(``start == src_pos``), once, into registers (``src_row``, a snapshot slot other requests may
read, is never written), and a chunk holding a snapshot position (``0 < c <= n`` for ``c =
snap_pos - start - c0``; a runtime branch, so other chunks pay nothing) stores ``S_c =
exp(G_{c-1}) S + (exp(G_{c-1} - G) K)^T U`` with the keys masked to ``j < c`` (``U``'s row
``j`` depends on tokens ``<= j`` only, so the whole chunk's ``U`` serves) into ``snap_row``.
A padding sequence returns before reading its table entry. ``row_slots`` (speculative
decoding: :mod:`mrv2_kernels.recurrent_state`): the states after the sequence's last
``row_slots - 1`` counts but its final one, the same product each, into their counts' rows;
the final state into the final count's row.

**A decay per key channel** (Kimi Delta Attention: ``g`` ``[T, Hv, K]``, with
``gate_params`` a ``dt_bias`` ``[Hv, K]``): the same op with ``exp(G_i - G_j)`` a diagonal
matrix, in four launches of :mod:`mrv2_kernels.chunk_kda_kernels` (its docstring: the algebra,
and the split into ``SUB``-token blocks that keeps every exponent ``<= 0`` for decays down to
``exp(-20)`` a token), every keyword but ``dt_limits`` (Mamba-2's per-head gates); its scratch
adds ``4 K + 4`` bytes a token and v head (``G`` and ``beta``).

**Precision.** Products take fp32 operands; ``input_precision`` on the GPU is ``"tf32x3"``
(fp32 accuracy on tensor cores, as the attention kernels) where any of q / k / v or the output
is fp32, else ``"tf32"`` (H100, Qwen3-Next's heads, 300 bf16 tokens: states 8e-4 from the fp32
recurrence where tf32x3 gives 4e-7, outputs within their bf16 rounding; the fla library's
products take bf16 operands), and ``"ieee"`` under the interpreter. The scratch is ``4 (K +
V)`` bytes per token and v head (Qwen3-Next-80B, 32 v heads of 128 + 128: 256 MiB for an
8,192-token step) and ``4 K V`` per chunk and v head (270 MiB there), freed after the call.
GPU tiles: ``C = 64``, ``SUB = 16``, ``BLOCK_K = 32``; the scan ``BLOCK_V = 32`` in 8 warps,
1 stage; the output kernel ``BLOCK_V = 64`` in 4 warps (H100, 2026-12-06, BENCHMARKS.md: one
4,096-token Qwen3-Next prompt 0.97 ms against the token-serial kernel's 7.4; 8 warps with
``BLOCK_V = 16`` read out of its shared memory under compute-sanitizer, a Triton 3.6 fault,
and are refused).

:func:`prefer_chunked` is the rule a model applies with host-known numbers to pick this path or
the token-serial kernel (decode batches stay on the latter); :func:`gated_delta_rule_auto`
applies it, the delta rule from :data:`CHUNKED_MIN_QUERY_LEN_DELTA` tokens. In a chunked
step, sequences of fewer than :data:`CHUNKED_SERIAL_BELOW` tokens (a mixed step's decodes)
still run token-serial (``serial_below``): the token-serial kernel, launched first with
``max_len``, takes them, and the chunked kernels skip them on the device (each sequence's
length is read there, so CUDA graphs of mixed steps route the same way).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ._backend import cdiv, default_block, next_power_of_2, pdl
from ._backend import use_triton as _use_triton
from .chunk_delta_rule_kernels import _chunk_out_kernel, _chunk_state_kernel, _chunk_wy_kernel
from .chunk_kda_kernels import (
    _kda_gates_kernel,
    _kda_out_kernel,
    _kda_state_kernel,
    _kda_wy_kernel,
)
from .linear_attention import _L2_EPS, _check_gdr, check_triton_args, resolve_gates
from .linear_attention import gated_delta_rule as _serial_gated_delta_rule
from .linear_attention import gated_delta_rule_triton as _serial_triton
from .recurrent_state import (
    _KERNEL_DTYPES,
    _check_meta,
    _check_table,
    check_row_slots,
    iter_sequences,
)

__all__ = [
    "CHUNKED_MIN_QUERY_LEN",
    "CHUNKED_MIN_QUERY_LEN_DELTA",
    "CHUNKED_SERIAL_BELOW",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_ref",
    "chunk_gated_delta_rule_triton",
    "gated_delta_rule_auto",
    "prefer_chunked",
]

#: :func:`prefer_chunked`'s threshold: the chunked path once some sequence of the step has at
#: least this many query tokens (half a GPU chunk). Steps with prompt tokens replay CUDA graphs
#: by default (``max_mixed_graph_tokens``), so the device time decides (H100, 2026-12-06,
#: ``bench_delta_rule.py --graph``, Nemotron-H-8B's Mamba-2 heads, one prompt: 16 tokens 0.029
#: ms token-serial against 0.034 chunked, 32: 0.050 against 0.034, 128: 0.178 against 0.039).
#: An eager call costs the chunked path ~110 us more host time (3 launches against 1).
CHUNKED_MIN_QUERY_LEN = 32
#: The same for the delta rule (``delta=True``), whose chunks cost a WY kernel more (same run,
#: Qwen3-Next's heads in CUDA graphs: 32 tokens 0.052 ms token-serial against 0.049 chunked,
#: 64: 0.098 against 0.050, 128: 0.190 against 0.055; 4,096: 7.20 against 0.86). 64, not 32:
#: at 32 the graphs tie and an eager call loses (0.11 against 0.23 ms, its launches).
CHUNKED_MIN_QUERY_LEN_DELTA = 64
#: In a step :func:`gated_delta_rule_auto` runs chunked, sequences of fewer tokens than this
#: (a mixed step's decodes and speculative verifications) still run token-serial: a
#: one-token chunk costs the chunked kernels a whole chunk's work (H100, 2026-12-06: a
#: 512-token prompt beside 63 decodes took as long chunked as 8 prompts of 512). The value
#: is an estimate (a 16-token serial walk against a chunk's share), not yet timed.
CHUNKED_SERIAL_BELOW = 16
#: ``MRV2_CHUNKED_DELTA_RULE=0``: every step token-serial (both forms); read per call.
CHUNKED_ENV_VAR = "MRV2_CHUNKED_DELTA_RULE"
#: The most diagonal blocks a chunk's inverse takes (``chunk // block_sub``): the series
#: ``(I - N)(I + N^2)...`` forms N's powers, which cancel; at 8 blocks fp32 errors grew 4x
#: (4e-6 relative, near-duplicate keys), at 16 to 7e-4, at 32 to garbage (a review's CPU runs).
_MAX_BLOCKS = 4
#: Sequences whose chunk starts one ``flat_query_tile`` load reads (a constexpr: not sized by N).
_REQ_BLOCK = 64


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the Triton path writes comes from here (tests poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


# ------------------------------------------------------------------------------ reference


def _chunked_sequence(
    qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, gs: torch.Tensor, bs: torch.Tensor,
    s: torch.Tensor, chunk: int, delta: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked math of one sequence, all v heads at once: ``qs`` (normed and scaled),
    ``ks`` ``[Hv, L, K]``, ``vs`` ``[Hv, L, V]``, the gates ``gs``, ``bs`` ``[Hv, L]``, the
    initial state ``s`` ``[Hv, K, V]``; chunks of ``chunk`` tokens from the first. Returns the
    outputs ``[Hv, L, V]`` and the final state (fp32)."""
    hv, length, dv = vs.shape
    out = torch.empty(hv, length, dv, dtype=torch.float32, device=vs.device)
    for c0 in range(0, length, chunk):
        sl = slice(c0, min(c0 + chunk, length))
        qc, kc, vc, gc, bc = qs[:, sl], ks[:, sl], vs[:, sl], gs[:, sl], bs[:, sl]
        size = qc.shape[1]
        causal = torch.ones(size, size, dtype=torch.bool, device=qs.device).tril()
        if gc.dim() == 3:  # a decay per key channel
            out[:, sl], s = _chunk_per_channel(qc, kc, vc, gc, bc, s, causal, delta)
            continue
        gcum = gc.cumsum(-1)  # [Hv, c]
        diff = (gcum[:, :, None] - gcum[:, None, :]).masked_fill(~causal, float("-inf"))
        decay = diff.exp()  # exp(G_i - G_j) for i >= j, else 0
        if delta:
            a = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * decay).tril(-1)
            eye = torch.eye(size, dtype=torch.float32, device=qs.device)
            rhs = torch.cat([bc[..., None] * vc, (bc * gcum.exp())[..., None] * kc], -1)
            wy = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
            u = wy[..., :dv] - wy[..., dv:] @ s  # [Hv, c, V]
        else:
            u = bc[..., None] * vc
        out[:, sl] = (qc * gcum.exp()[..., None]) @ s + ((qc @ kc.transpose(1, 2)) * decay) @ u
        last = gcum[:, -1:]  # [Hv, 1]
        kd = kc * (last - gcum).exp()[..., None]
        s = s * last.exp()[..., None] + kd.transpose(1, 2) @ u
    return out, s


def _chunk_per_channel(
    qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, gc: torch.Tensor, bc: torch.Tensor,
    s: torch.Tensor, causal: torch.Tensor, delta: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of :func:`_chunked_sequence` with ``gc`` ``[Hv, c, K]`` (Kimi Delta
    Attention): the decays ``exp(G_ic - G_jc)`` formed per channel, ``[Hv, c, c, K]``, masked
    to ``i >= j`` before the ``exp``. Returns the chunk's outputs and the state after it."""
    dv = vc.shape[-1]
    gcum = gc.cumsum(1)  # [Hv, c, K]
    diff = gcum[:, :, None, :] - gcum[:, None, :, :]
    decay = diff.masked_fill(~causal[None, :, :, None], float("-inf")).exp()
    if delta:
        a = (bc[:, :, None] * torch.einsum("hik,hjk,hijk->hij", kc, kc, decay)).tril(-1)
        eye = torch.eye(a.shape[-1], dtype=torch.float32, device=a.device)
        rhs = torch.cat([bc[..., None] * vc, bc[..., None] * gcum.exp() * kc], -1)
        wy = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        u = wy[..., :dv] - wy[..., dv:] @ s
    else:
        u = bc[..., None] * vc
    p = torch.einsum("hik,hjk,hijk->hij", qc, kc, decay)
    out = (qc * gcum.exp()) @ s + p @ u
    last = gcum[:, -1:, :]  # [Hv, 1, K]
    s = s * last.exp().transpose(1, 2) + (kc * (last - gcum).exp()).transpose(1, 2) @ u
    return out, s


def chunk_gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, scale: float, l2norm_qk: bool = True, *, delta: bool = True,
    state_table: torch.Tensor | None = None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    dt_limits: tuple[float, float] | None = None, skip: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, chunk: int = 64, row_slots: int = 1,
) -> torch.Tensor:
    """Plain-torch chunked form of :func:`~mrv2_kernels.linear_attention.gated_delta_rule`
    (reads the metadata on the host): the gates computed first (``gate_params`` /
    ``dt_limits``), then per sequence chunks of ``chunk`` tokens from its first one, all v heads
    at once, ``T = (I + A)^-1`` applied by ``torch.linalg.solve_triangular`` (the module
    docstring's algebra). A snapshot after ``c`` tokens (``state_table``) runs the same math
    over the first ``c`` tokens alone, and so does each state ``row_slots`` keeps. A second
    formulation of the op, independent of the token-serial reference and of the kernels; same
    results up to fp32 rounding. A ``[T, Hv, K]`` ``g`` (a decay per key channel, Kimi Delta
    Attention) forms each chunk's per-channel decays ``[Hv, C, C, K]`` whole."""
    _check_gdr(q, k, v, g, beta, state, vector_gate=True)
    g, beta = resolve_gates(g, beta, v, gate_params, dt_limits, skip)
    _check_meta(query_start_loc, seq_lens, state_rows)
    _check_table(state_table)
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    slots = check_row_slots(row_slots)
    hv, dk, dv = state.shape[1:]
    group = hv // q.shape[1]
    out = torch.zeros(v.shape, dtype=out_dtype or v.dtype, device=v.device)
    for seq in iter_sequences(query_start_loc, seq_lens, state_rows, state_table, slots):
        bos, eos = seq.bos, seq.eos
        if seq.start > 0:
            s0 = state[seq.src].clone()  # [Hv, K, V]
        else:
            s0 = torch.zeros(hv, dk, dv, dtype=torch.float32, device=state.device)
        # [Hv, L, ...] per v head
        qs = q[bos:eos].float().repeat_interleave(group, dim=1).transpose(0, 1)
        ks = k[bos:eos].float().repeat_interleave(group, dim=1).transpose(0, 1)
        if l2norm_qk:
            qs = qs * torch.rsqrt((qs * qs).sum(-1, keepdim=True) + _L2_EPS)
            ks = ks * torch.rsqrt((ks * ks).sum(-1, keepdim=True) + _L2_EPS)
        qs = qs * scale
        vs = v[bos:eos].float().transpose(0, 1)
        gs = g[bos:eos].float().transpose(0, 1)  # [Hv, L] (per channel: [Hv, L, K])
        bs = beta[bos:eos].float().T  # [Hv, L]
        o, s = _chunked_sequence(qs, ks, vs, gs, bs, s0, chunk, delta)
        if skip is not None:
            o = o + skip.float()[:, None, None] * vs
        out[bos:eos] = o.transpose(0, 1).to(out.dtype)
        for c, snap_row in seq.snaps + seq.kept[:-1]:  # the final state: s, below
            part = slice(0, c)
            state[snap_row] = _chunked_sequence(qs[:, part], ks[:, part], vs[:, part],
                                                gs[:, part], bs[:, part], s0, chunk, delta)[1]
        state[seq.kept[-1][1]] = s
    return out


# ------------------------------------------------------------------------------- wrappers


def scan_warps_for(block_v: int, on_gpu: bool, scan_warps: int | None = None) -> int:
    """The state scan's warps: ``scan_warps`` if given, else 4 on the GPU (1 on the CPU):
    4 warps with 2 stages beat the first default, 8 with 1, by 9% (H100, 2026-12-06, two
    sweeps a session apart: 1 x 4,096 / 8 x 512 Qwen3-Next tokens 0.910 / 0.945 ms against
    1.001 / 1.038). 8 warps with ``block_v`` 16 are refused: in Triton 3.6 the scan's
    transposed product read past its shared memory in that layout (compute-sanitizer, H100,
    2026-12-06: an illegal address in a long prompt)."""
    warps = scan_warps or (4 if on_gpu else 1)
    if on_gpu and warps == 8 and block_v == 16:
        raise ValueError("chunk_gated_delta_rule_triton: block_v 16 with scan_warps 8 faults "
                         "in Triton 3.6; take block_v 32 or scan_warps 4")
    return warps


def chunk_gated_delta_rule_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, scale: float, l2norm_qk: bool = True,
    *,
    delta: bool = True,
    state_table: torch.Tensor | None = None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    dt_limits: tuple[float, float] | None = None, skip: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    row_slots: int = 1,
    chunk: int | None = None,
    block_sub: int | None = None,
    block_k: int | None = None,
    block_v: int | None = None,
    block_v_out: int | None = None,
    scan_warps: int | None = None,
    scan_stages: int | None = None,
    dot_precision: str | None = None,
    serial_below: int = 0,
) -> torch.Tensor:
    """Triton implementation of :func:`chunk_gated_delta_rule`: three launches, no host sync
    (the module docstring has the design). Tiles, powers of two: ``chunk`` (``C``; GPU 64,
    CPU 16), ``block_sub`` (the inverse's diagonal blocks, at most ``C``; GPU 16, CPU 8),
    ``block_k`` (the K blocks the WY and output kernels' products loop over; GPU 32, CPU up to
    64), ``block_v`` (a scan program's state columns; GPU 32, CPU up to 64) and
    ``block_v_out`` (an output program's; GPU 64, CPU up to 64); on the GPU all but
    ``block_sub`` at least 16. ``scan_warps`` / ``scan_stages``: the scan's launch (GPU 4 /
    2: measured in :func:`scan_warps_for`; CPU 1 / 1). ``dot_precision``: the products' fp32
    ``input_precision`` (GPU: ``"tf32"`` where q, k, v and the output are all 16-bit, else
    ``"tf32x3"``; CPU ``"ieee"``). q/k/v may be strided views (their last dim is
    made contiguous); ``state`` must have a contiguous last dim (it is updated in place).
    ``state_table``, ``gate_params``, ``dt_limits``, ``skip``, ``out_dtype``, ``row_slots``:
    as :func:`~mrv2_kernels.linear_attention.gated_delta_rule`'s (the module docstring says
    how). ``serial_below``: sequences of fewer tokens (a mixed step's decodes) run in the
    token-serial kernel, launched ahead of these (a one-token chunk costs these kernels a
    whole chunk's work), the chunked kernels skipping them on the device. A ``[T, Hv, K]``
    ``g`` (a decay per key channel) runs :mod:`mrv2_kernels.chunk_kda_kernels`' launches
    (:func:`_launch_kda`; ``scan_warps`` / ``scan_stages`` default to 8 / 1 on the GPU there,
    ``block_k`` to 16)."""
    n = check_triton_args("chunk_gated_delta_rule_triton", q, k, v, g, beta, state,
                          query_start_loc, seq_lens, state_rows, state_table, gate_params,
                          dt_limits, skip, vector_gate=True)
    row_slots_n = check_row_slots(row_slots)
    num_tokens, hk, dk = q.shape
    hv, dv = v.shape[1:]
    on_gpu = v.is_cuda
    c = default_block(v, cuda=64, cpu=16, block=chunk)
    sub = default_block(v, cuda=16, cpu=8, block=block_sub)
    if sub > c:
        raise ValueError(f"block_sub ({sub}) must divide the chunk ({c})")
    if c // sub > _MAX_BLOCKS:
        raise ValueError(f"chunk / block_sub must be at most {_MAX_BLOCKS} (the inverse's "
                         f"series loses accuracy past it), got {c} / {sub}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = _empty((num_tokens, hv, dv), out_dtype or v.dtype, v.device)
    if out.numel() == 0:
        return out
    tile_min = 16 if on_gpu else 1  # tl.dot's smallest tile dim on the GPU
    bk = default_block(v, cuda=min(32, max(16, next_power_of_2(dk))),
                       cpu=min(64, next_power_of_2(dk)), block=block_k)
    pow2_v = max(tile_min, next_power_of_2(dv))
    bv = default_block(v, cuda=min(32, pow2_v), cpu=min(64, pow2_v), block=block_v)
    bvo = default_block(v, cuda=min(64, pow2_v), cpu=min(64, pow2_v), block=block_v_out)
    if on_gpu and min(bk, bv, bvo, c) < 16:
        raise ValueError(f"chunk, block_k, block_v and block_v_out must be at least 16 on the "
                         f"GPU (tl.dot), got {c}, {bk}, {bv}, {bvo}")
    warps_scan = scan_warps_for(bv, on_gpu, scan_warps)
    # Any fp32 operand or output keeps fp32's accuracy (3 TF32 products a product); with all
    # of them 16-bit, one TF32 product (the fla library's products take bf16 operands)
    sixteen = all(t.dtype != torch.float32 for t in (q, k, v, out))
    prec = dot_precision or ("ieee" if not on_gpu else "tf32" if sixteen else "tf32x3")
    a_log, dt_bias = ((g, g) if gate_params is None
                      else (gate_params[0].contiguous(), gate_params[1].contiguous()))
    dt_lo, dt_hi = (0.0, 0.0) if dt_limits is None else (float(dt_limits[0]),
                                                         float(dt_limits[1]))
    gates = {"RAW_GATES": gate_params is not None, "MAMBA_GATES": dt_limits is not None}
    min_len = max(serial_below, 1)
    if min_len > 1 and n > 0:
        _serial_triton(q, k, v, g, beta, state, query_start_loc, seq_lens, state_rows, scale,
                       l2norm_qk, delta=delta, state_table=state_table,
                       gate_params=gate_params, dt_limits=dt_limits, skip=skip,
                       row_slots=row_slots, max_len=min_len - 1, out=out)
    # Each chunk's initial state, for the output kernel, in fp32 (in bf16 as the fla library
    # keeps it, Mamba-2's unnormalized states put bf16 outputs 1e-2 off the token-serial op's)
    # (flat per head: the WY kernel's [C, C] tiles live there first, dk * dv may be smaller)
    slots = cdiv(num_tokens, c) + n
    h_buf = _empty((slots, hv, max(dk * dv, c * c)), torch.float32, v.device)
    if g.dim() == 3:  # a decay per key channel (Kimi Delta Attention): chunk_kda_kernels
        tbl = state_rows if state_table is None else state_table
        _launch_kda(q, k, v, g, beta, state, query_start_loc, seq_lens, state_rows, tbl, out,
                    h_buf, gate_params, skip, n, min_len, float(scale), l2norm_qk, delta,
                    state_table is not None, row_slots_n,
                    dict(CHUNK=c, SUB=sub, BLOCK_K=block_k or (16 if on_gpu else bk),
                         BLOCK_V=bv, BLOCK_V_OUT=bvo, PREC=prec,
                         scan_warps=scan_warps or (8 if on_gpu and bv >= 32 else warps_scan),
                         scan_stages=scan_stages or 1))
        return out
    if delta and n > 0:
        wk = _empty((num_tokens, hv, dk), torch.float32, v.device)
        wv = _empty((num_tokens, hv, dv), torch.float32, v.device)
        # T's [C, C] tiles in the chunks' state slots (the scan writes those only later)
        _chunk_wy_kernel[(slots, hv)](
            k, v, g, beta, wk, wv, h_buf, query_start_loc, a_log, dt_bias, dt_lo, dt_hi,
            n, min_len, dk, dv, hv // hk,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
            beta.stride(0), beta.stride(1), wk.stride(0), wk.stride(1), wv.stride(0),
            wv.stride(1), h_buf.stride(0), h_buf.stride(1),
            L2NORM=l2norm_qk, CHUNK=c, SUB=sub, LOG2_BLOCKS=(c // sub).bit_length() - 1,
            BLOCK_K=bk,
            BLOCK_V=block_v or default_block(v, cuda=min(64, pow2_v), cpu=pow2_v),
            REQ_BLOCK=_REQ_BLOCK, PREC=prec, **gates,
            num_warps=8 if on_gpu else 1,
            **pdl(v),
        )
    else:
        wk = wv = out  # not read
    tbl = state_rows if state_table is None else state_table
    _chunk_state_kernel[(n + 1, hv, cdiv(dv, bv))](
        k, v, g, beta, wk, wv, h_buf, state, out, query_start_loc, seq_lens, state_rows,
        tbl, a_log, dt_bias, dt_lo, dt_hi, n, num_tokens, min_len, dk, dv, hv // hk,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0), beta.stride(1), wk.stride(0), wk.stride(1), wv.stride(0),
        wv.stride(1), h_buf.stride(0), h_buf.stride(1), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1), state.stride(2), tbl.stride(0),
        L2NORM=l2norm_qk, DELTA=delta, CHUNK=c, BLOCK_KF=max(tile_min, next_power_of_2(dk)),
        BLOCK_V=bv, BLOCK_T=8, PREC=prec, HAS_TABLE=state_table is not None,
        ROW_SLOTS=row_slots_n, **gates,
        num_warps=warps_scan, num_stages=scan_stages or (2 if on_gpu else 1),
        **pdl(v),
    )
    if n == 0:
        return out
    _chunk_out_kernel[(slots, hv, cdiv(dv, bvo))](
        q, k, v, g, beta, wv, h_buf, out, query_start_loc, a_log, dt_bias,
        g if skip is None else skip.contiguous(), dt_lo, dt_hi, n, min_len, float(scale), dk,
        dv, hv // hk, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), wv.stride(0), wv.stride(1),
        h_buf.stride(0), h_buf.stride(1), out.stride(0), out.stride(1),
        L2NORM=l2norm_qk, DELTA=delta, CHUNK=c, BLOCK_K=bk, BLOCK_V=bvo, REQ_BLOCK=_REQ_BLOCK,
        PREC=prec, HAS_SKIP=skip is not None, **gates,
        num_warps=4 if on_gpu else 1,
        **pdl(v),
    )
    return out


def _launch_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, qsl: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor,
    tbl: torch.Tensor, out: torch.Tensor, h_buf: torch.Tensor,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None, skip: torch.Tensor | None,
    n: int, min_len: int, scale: float, l2norm_qk: bool, delta: bool, has_table: bool,
    row_slots: int, t: dict[str, Any],
) -> None:
    """:func:`chunk_gated_delta_rule_triton`'s launches for a ``[T, Hv, K]`` ``g`` (the
    kernels and their algebra: :mod:`mrv2_kernels.chunk_kda_kernels`): the gates kernel
    (``G`` and ``beta`` into fp32 scratch), the WY kernel (``delta``), the scan, the output
    kernel; ``t``: the tiles and launch settings the caller picked. GPU defaults differ from
    the per-head path's where ptxas (sm_90, K = V = 128) said so: ``BLOCK_K = 16`` for the WY
    and output kernels, 8 warps each (no spills; 32 spilled 4 / 1,064 bytes), the scan in 8
    warps, 1 stage (208 bytes spilled, 316 with ``row_slots`` 4, against 2,316 / 1,532 in 4
    warps with 2; the per-head scan spills 1,184 at its defaults). Not yet timed on a GPU."""
    num_tokens, hk, dk = q.shape
    hv, dv = v.shape[1:]
    on_gpu = v.is_cuda
    c, slots = t["CHUNK"], h_buf.shape[0]
    tile_min = 16 if on_gpu else 1
    a_log, dt_bias = ((g, g) if gate_params is None
                      else (gate_params[0].contiguous(), gate_params[1].contiguous()))
    gc = _empty((num_tokens, hv, dk), torch.float32, v.device)  # G, per key channel
    bt = _empty((num_tokens, hv), torch.float32, v.device)  # beta
    if n > 0:
        _kda_gates_kernel[(slots, hv)](
            g, beta, a_log, dt_bias, gc, bt, qsl, n, min_len, dk, g.stride(0), g.stride(1),
            g.stride(2), beta.stride(0), beta.stride(1), gc.stride(0), gc.stride(1),
            bt.stride(0),
            CHUNK=c, BLOCK_K=t["BLOCK_K"], REQ_BLOCK=_REQ_BLOCK,
            RAW_GATES=gate_params is not None, num_warps=4 if on_gpu else 1, **pdl(v))
    if delta and n > 0:
        wk = _empty((num_tokens, hv, dk), torch.float32, v.device)
        wv = _empty((num_tokens, hv, dv), torch.float32, v.device)
        _kda_wy_kernel[(slots, hv)](
            k, v, gc, bt, wk, wv, h_buf, qsl, n, min_len, dk, dv, hv // hk,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), gc.stride(0), gc.stride(1),
            bt.stride(0), wk.stride(0), wk.stride(1), wv.stride(0), wv.stride(1),
            h_buf.stride(0), h_buf.stride(1),
            L2NORM=l2norm_qk, CHUNK=c, SUB=t["SUB"],
            LOG2_BLOCKS=(c // t["SUB"]).bit_length() - 1, BLOCK_K=t["BLOCK_K"],
            BLOCK_V=t["BLOCK_V_OUT"], REQ_BLOCK=_REQ_BLOCK, PREC=t["PREC"],
            num_warps=8 if on_gpu else 1, **pdl(v))
    else:
        wk = wv = out  # not read
    _kda_state_kernel[(n + 1, hv, cdiv(dv, t["BLOCK_V"]))](
        k, v, gc, bt, wk, wv, h_buf, state, out, qsl, seq_lens, rows, tbl, n, num_tokens,
        min_len, dk, dv, hv // hk, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        gc.stride(0), gc.stride(1), bt.stride(0), wk.stride(0), wk.stride(1), wv.stride(0),
        wv.stride(1), h_buf.stride(0), h_buf.stride(1), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1), state.stride(2), tbl.stride(0),
        L2NORM=l2norm_qk, DELTA=delta, CHUNK=c, BLOCK_KF=max(tile_min, next_power_of_2(dk)),
        BLOCK_V=t["BLOCK_V"], BLOCK_T=8, PREC=t["PREC"], HAS_TABLE=has_table,
        ROW_SLOTS=row_slots, num_warps=t["scan_warps"], num_stages=t["scan_stages"], **pdl(v))
    if n == 0:
        return
    _kda_out_kernel[(slots, hv, cdiv(dv, t["BLOCK_V_OUT"]))](  # (8 warps: no spills)
        q, k, v, gc, bt, wv, h_buf, out, qsl, g if skip is None else skip.contiguous(), n,
        min_len, scale, dk, dv, hv // hk, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), gc.stride(0), gc.stride(1), bt.stride(0), wv.stride(0),
        wv.stride(1), h_buf.stride(0), h_buf.stride(1), out.stride(0), out.stride(1),
        L2NORM=l2norm_qk, DELTA=delta, CHUNK=c, SUB=t["SUB"], BLOCK_K=t["BLOCK_K"],
        BLOCK_V=t["BLOCK_V_OUT"], REQ_BLOCK=_REQ_BLOCK, PREC=t["PREC"],
        HAS_SKIP=skip is not None, num_warps=8 if on_gpu else 1, **pdl(v))


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, scale: float, l2norm_qk: bool = True, *, delta: bool = True,
    state_table: torch.Tensor | None = None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    dt_limits: tuple[float, float] | None = None, skip: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, row_slots: int = 1, serial_below: int = 0,
) -> torch.Tensor:
    """:func:`mrv2_kernels.linear_attention.gated_delta_rule` (same arguments, semantics and
    results up to fp32 rounding: see its docstring) computed a chunk of tokens at a time, for
    prefill. Runs :func:`chunk_gated_delta_rule_triton` when :func:`use_triton` says so (with
    ``serial_below``: its shorter sequences token-serial), else
    :func:`chunk_gated_delta_rule_ref`."""
    if _use_triton(v) and all(t.dtype in _KERNEL_DTYPES for t in (q, k, v, beta)):
        return chunk_gated_delta_rule_triton(
            q, k, v, g, beta, state, query_start_loc, seq_lens, state_rows, scale, l2norm_qk,
            delta=delta, state_table=state_table, gate_params=gate_params,
            dt_limits=dt_limits, skip=skip, out_dtype=out_dtype, row_slots=row_slots,
            serial_below=serial_below)
    return chunk_gated_delta_rule_ref(
        q, k, v, g, beta, state, query_start_loc, seq_lens, state_rows, scale, l2norm_qk,
        delta=delta, state_table=state_table, gate_params=gate_params, dt_limits=dt_limits,
        skip=skip, out_dtype=out_dtype, row_slots=row_slots)


def prefer_chunked(num_tokens: int, num_seqs: int, max_query_len: int | None = None,
                   min_query_len: int | None = None) -> bool:
    """Whether a step of ``num_tokens`` tokens over ``num_seqs`` sequences (padding ones
    included) should run the chunked path: when its longest query is at least
    ``min_query_len`` tokens (default :data:`CHUNKED_MIN_QUERY_LEN`), unless
    ``MRV2_CHUNKED_DELTA_RULE=0``. Host numbers only: ``max_query_len`` where the caller
    knows it (the runner's ``InputBatch.max_query_len``; a mixed CUDA graph bakes its token
    count there, so its steps, which carry prompt tokens, go chunked; a decode graph bakes ``1
    + k`` and stays token-serial), else the mean query length, a lower bound of the longest (a
    long prompt among many decodes then stays token-serial: correct, slower)."""
    if os.environ.get(CHUNKED_ENV_VAR, "1") == "0":
        return False
    if max_query_len is not None:
        longest = min(max_query_len, num_tokens)
    else:
        longest = cdiv(num_tokens, max(num_seqs, 1))
    return longest >= (CHUNKED_MIN_QUERY_LEN if min_query_len is None else min_query_len)


def gated_delta_rule_auto(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    state_rows: torch.Tensor, scale: float, l2norm_qk: bool = True, *, delta: bool = True,
    state_table: torch.Tensor | None = None,
    gate_params: tuple[torch.Tensor, torch.Tensor] | None = None,
    dt_limits: tuple[float, float] | None = None, skip: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, max_query_len: int | None = None,
    row_slots: int = 1,
) -> torch.Tensor:
    """The gated delta rule by the faster form for the step: :func:`chunk_gated_delta_rule`
    where :func:`prefer_chunked` says so (from ``q``'s token count, the sequence count and
    ``max_query_len``; the delta rule from :data:`CHUNKED_MIN_QUERY_LEN_DELTA` tokens), else
    the token-serial :func:`~mrv2_kernels.linear_attention.gated_delta_rule`; every keyword of
    the latter (``state_table``, ``gate_params``, ``dt_limits``, ``skip``, ``out_dtype``,
    ``row_slots``) passed on. Same results up to fp32 rounding either way (TF32's where every
    operand and the output are 16-bit, on the GPU: :func:`chunk_gated_delta_rule_triton`). A
    per-key-channel ``g`` ``[T, Hv, K]`` (Kimi Delta Attention) goes by the same rule (its
    chunked kernels: :mod:`mrv2_kernels.chunk_kda_kernels`)."""
    kw: dict[str, Any] = dict(delta=delta, state_table=state_table, gate_params=gate_params,
                              dt_limits=dt_limits, skip=skip, out_dtype=out_dtype,
                              row_slots=row_slots)
    if prefer_chunked(
            q.shape[0], query_start_loc.shape[0] - 1, max_query_len,
            CHUNKED_MIN_QUERY_LEN_DELTA if delta else CHUNKED_MIN_QUERY_LEN):
        return chunk_gated_delta_rule(q, k, v, g, beta, state, query_start_loc, seq_lens,
                                      state_rows, scale, l2norm_qk,
                                      serial_below=CHUNKED_SERIAL_BELOW, **kw)
    return _serial_gated_delta_rule(q, k, v, g, beta, state, query_start_loc, seq_lens,
                                    state_rows, scale, l2norm_qk, **kw)
