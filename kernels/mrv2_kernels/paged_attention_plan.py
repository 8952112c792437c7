"""How :func:`mrv2_kernels.paged_attention.paged_attention` launches (tiles, warps, stages and
split counts per device, from CPU-known bounds only: no device tensor is read), and what it
takes besides the query to rotate it itself (:class:`FusedRope`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._backend import cdiv, next_power_of_2, sm_count
from .paged_attention_ref import _check_inputs
from .prefill_attention import use_tma_prefill
from .rotary import QKNorm, rotary_embedding_triton

_MAX_SPLITS = 64


def head_tile(head_dim: int) -> int:
    """The paged kernels' tile width for heads of ``head_dim``: the next power of two, at
    least 16 (``tl.arange`` and ``tl.dot``'s rule); a wider tile is masked to ``head_dim``."""
    if head_dim < 1:
        raise ValueError(f"paged_attention needs a head_dim >= 1, got {head_dim}")
    return max(16, next_power_of_2(head_dim))


def _default_config(
    on_gpu: bool, small_q: bool, rows: int, head_dim: int, elem_size: int, group_p2: int
) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) for ``rows`` = max_query_len * group rows.

    Interpreter (CPU tensors): small tiles, they only need to be correct. GPU (checked by
    compiling for sm_90: no spills, shared memory within budget; chosen by
    ``bench_attention --sweep`` on the H200, device time in CUDA graphs, BENCHMARKS.md
    2026-12-01): decode reads ``block_n`` keys per step, double-buffered (3 stages were 3-12%
    slower at 64-256 requests of 256-512 keys: the third buffer costs an SM a resident
    program); bf16/fp16 prefill with head_dim <= 128 uses 64 x 64 tiles on 4 warps for
    groups of 1-2 query heads per kv head (Qwen3-0.6B: 209 against 181 TFLOP/s for 128 x 64)
    and 128 x 32 on 8 warps from 4 (Qwen3-8B: 257 against 219); 128 x 32 past head_dim 128;
    fp32 models get small tiles (their 3xTF32 dots are register-hungry).
    """
    if not on_gpu:
        return (max(16, next_power_of_2(max(rows, 1))) if small_q else 32), 16, 4, 1
    if small_q:
        bm = max(16, next_power_of_2(max(rows, 1)))
        wide = head_dim * elem_size > 256
        return bm, (32 if wide else 64), 4, 2
    bm = max(16, next_power_of_2(rows))
    if elem_size >= 4:
        return min(bm, 32), 32, 4, 2
    if head_dim > 128:
        return min(bm, 128), 32, 8, 2
    if group_p2 >= 4:
        return min(bm, 128), 32, (8 if bm >= 128 else 4), 2
    return min(bm, 64), 64, 4, 2


def decode_warps(small_q: bool, block_m: int, programs: int, sm_count: int, warps: int) -> int:
    """Warps of a plan's programs: 2 for a decode-sized query tile (<= 16 rows) once the
    launch has a program per multiprocessor before any split, ``warps`` otherwise.

    2-warp programs keep twice as many programs (independent key streams) resident on a
    multiprocessor (~150 registers a thread allow 3 programs of 4 warps), and a batch's
    programs fit in fewer waves. H200, 2026-12-02/03 (BENCHMARKS.md), Qwen3-8B heads:
    - fp8 cache (latency-bound: Nsight Compute, 48% of DRAM bandwidth): 32-256 requests of
      256-4,096 keys 18-37% faster; the throughput workload's decode steps 1,913 -> 1,728 µs;
    - bf16 cache (bound by its bytes): 64 requests 18-22% faster (a wave less), 128-256
      requests 6-9%, 32 level; the workload's decode attention 2,090 -> 2,051 µs, its decode
      steps' device time 10.28 -> 10.16 s (Qwen3-0.6B 4.75 -> 4.73 s).
    With fewer programs (1-8 requests: the plan splits keys instead) 2 warps took up to 31%
    longer."""
    if small_q and block_m <= 16 and programs >= sm_count:
        return 2
    return warps


@dataclass(frozen=True)
class AttentionPlan:
    """How :func:`paged_attention` launches for given CPU-known bounds (all host integers)."""

    small_q: bool
    """Split-KV ("flash decoding") configuration: one query tile per request."""
    block_m: int
    """Rows of a ``tl.dot`` tile: ``block_q`` query tokens x the padded GQA group."""
    block_q: int
    block_n: int
    """Keys per inner-loop step."""
    num_q_tiles: int
    num_splits: int
    """KV chunks per (request, kv head); > 1 adds the combine kernel."""
    num_warps: int
    num_stages: int


def attention_plan(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    num_reqs: int,
    uniform_decode: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> AttentionPlan:
    """The launch plan :func:`paged_attention` uses (defaults per device, then overrides).

    Splits: enough programs for ``2 x`` the multiprocessor count (8 under the interpreter),
    no more than one split per ``2 * block_n`` keys of ``max_seq_len``, at most 64. The
    kernel cuts each request's own key range evenly, so a loose ``max_seq_len`` (fixed for
    CUDA-graph capture, say) only changes how many chunks there are, not their balance.
    Warps of a decode plan: :func:`decode_warps`.
    """
    num_heads, num_kv_heads, head_dim, _ = _check_inputs(query, kv_cache)
    group_p2 = next_power_of_2(num_heads // num_kv_heads)
    on_gpu = query.is_cuda
    rows = max_query_len * group_p2
    small_q = rows <= 16 or (uniform_decode and rows <= 128)
    # (tiles of a padded head: as wide as the next power of two)
    bm, bn, warps, stages = _default_config(on_gpu, small_q, rows, head_tile(head_dim),
                                            query.element_size(), group_p2)
    bm = max(block_m if block_m is not None else bm, group_p2)
    bn = block_n if block_n is not None else bn
    assert bm & (bm - 1) == 0 and bn & (bn - 1) == 0, "block_m and block_n must be powers of 2"
    assert bm >= 16 and bn >= 16, "block_m and block_n must be >= 16 (tl.dot)"
    block_q = bm // group_p2
    num_q_tiles = cdiv(max(max_query_len, 0), block_q)
    base_programs = num_q_tiles * num_kv_heads * num_reqs  # before any split
    if not small_q:
        splits = 1
    elif num_splits is not None:
        splits = max(1, min(num_splits, _MAX_SPLITS))
    else:
        target = 2 * sm_count(query.device) if on_gpu else 8
        max_by_len = cdiv(max(max_seq_len, 1), 2 * bn)
        splits = max(1, min(cdiv(target, max(base_programs, 1)), max_by_len, _MAX_SPLITS))
    if on_gpu and num_warps is None:
        warps = decode_warps(small_q, bm, base_programs, sm_count(query.device), warps)
    return AttentionPlan(
        small_q=small_q,
        block_m=bm,
        block_q=block_q,
        block_n=bn,
        num_q_tiles=num_q_tiles,
        num_splits=splits,
        num_warps=num_warps if num_warps is not None else warps,
        num_stages=num_stages if num_stages is not None else stages,
    )


def rope_in_kernel(plan: AttentionPlan, head_dim: int, num_tokens: int) -> bool:
    """Whether the paged kernel rotates the query and stores the step's keys itself
    (:class:`FusedRope`) under ``plan``: split decode plans (one query tile, several
    splits) of a power-of-2 ``head_dim`` (its rotation walks ``head_dim // 2`` halves
    unpadded) only. Others run the RoPE kernel (with its cache write) first: a prefill plan's
    program per query tile cannot store other tiles' keys first; an unsplit decode plan
    (many requests, several waves of programs) pays more for the rotation's registers and
    its step before the key loop than for the RoPE launch (H200, Qwen3-0.6B batch 64: 1.935
    against 1.808 ms a step; BENCHMARKS.md 2026-12-01, seventh session)."""
    return (plan.small_q and plan.num_q_tiles == 1 and plan.num_splits > 1 and num_tokens > 0
            and head_tile(head_dim) == head_dim)


@dataclass(frozen=True)
class FusedRope:
    """What :func:`paged_attention` needs to take the step's raw query, key and value: it
    normalizes and rotates them (as :func:`mrv2_kernels.rotary.rotary_embedding` would, with
    ``rotary_dim == head_dim``) and stores the key and value at ``slot_mapping`` itself.

    Split small-query plans (decode and spec decode at batches of up to a few dozen
    requests) of a power-of-2 head_dim do it inside the attention kernel: one launch per
    layer less than RoPE then attention. Other plans (and other head dims) run the RoPE
    kernel (with its cache write) first (:func:`rope_in_kernel`)."""

    positions: torch.Tensor
    """``[T]`` the query tokens' positions (rows of ``cos_sin``)."""
    cos_sin: torch.Tensor
    """``[max_position, head_dim]`` fp32, cos half first (:class:`RotaryEmbedding`'s table)."""
    key: torch.Tensor
    """``[T, Hk*D]`` or ``[T, Hk, D]``, raw (a fused QKV output's slice is fine)."""
    value: torch.Tensor
    """Like ``key``."""
    slot_mapping: torch.Tensor
    """``[>= T]`` each token's flat cache slot; negative: not stored."""
    qk_norm: QKNorm | None = None
    """``(q weight, k weight, eps)``: per-head RMSNorm before the rotation (Qwen3)."""


def _rows_of_heads(t: torch.Tensor, name: str, num_tokens: int, heads: int,
                   head_dim: int) -> torch.Tensor:
    """``t`` as ``[T, heads * head_dim]`` with contiguous heads (a view; rows may be strided)."""
    flat = t.reshape(t.shape[0], -1) if t.dim() == 3 else t
    if (flat.dim() != 2 or flat.shape != (num_tokens, heads * head_dim) or flat.stride(-1) != 1
            or (t.dim() == 3 and t.stride(1) != head_dim)):
        raise ValueError(f"FusedRope.{name} must be [T, Hk*D] = [{num_tokens}, "
                         f"{heads * head_dim}] with contiguous heads, got {tuple(t.shape)}")
    return flat


def fused_rope_launch(
    query: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan, rope: FusedRope | None,
    qsl: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
) -> tuple[torch.Tensor, FusedRope | None, tuple[Any, ...],
           tuple[torch.Tensor, torch.Tensor] | None]:
    """How :func:`~mrv2_kernels.paged_attention.paged_attention` takes ``rope`` under ``plan``:
    ``(query, rope, rope_args, step_kv)``.

    Split decode plans of a power-of-2 head_dim keep ``rope`` (:func:`rope_in_kernel`: the
    attention kernel rotates and stores the step's keys itself, ``rope_args`` its
    arguments). Every other plan runs the RoPE kernel (with its
    cache write) here first and gets the rotated ``query`` and ``rope = None``; a prefill plan
    that can read the step's keys through TMA also gets them as ``step_kv``. Without ``rope``,
    ``rope_args`` are unused placeholders of the kernel's argument types.
    """
    num_tokens = query.shape[0]
    step_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    # (positions, cos_sin, q_w, k_w, eps, key, value, key row stride, value row stride, slots):
    # unused placeholders without rope
    rope_args: tuple[Any, ...] = (qsl, query, query, query, 0.0, query, query, 0, 0, qsl)
    if rope is not None:
        key = _rows_of_heads(rope.key, "key", num_tokens, num_kv_heads, head_dim)
        value = _rows_of_heads(rope.value, "value", num_tokens, num_kv_heads, head_dim)
        if rope.cos_sin.dim() != 2 or rope.cos_sin.shape[1] != head_dim:
            raise ValueError(f"FusedRope.cos_sin must be [max_position, {head_dim}], got "
                             f"{tuple(rope.cos_sin.shape)}")
        if not rope_in_kernel(plan, head_dim, num_tokens):
            # (rope_in_kernel's rule) the RoPE kernel, with its cache write, first
            q2, k2 = rotary_embedding_triton(
                rope.positions, query.reshape(num_tokens, num_heads * head_dim), key,
                rope.cos_sin, head_dim, head_dim, rope.qk_norm,
                kv_write=(value, kv_cache, rope.slot_mapping))
            query = q2.reshape(num_tokens, num_heads, head_dim)  # then plain attention
            rope = None
            if not plan.small_q:
                k2 = _rows_of_heads(k2, "key", num_tokens, num_kv_heads, head_dim)
                if kv_cache.dtype == query.dtype and use_tma_prefill(query, k2, value):
                    # (its step keys must be what the cache holds: not with an fp8 cache)
                    step_kv = (k2, value)  # the rotated keys, as stored: read them here
        else:
            q_w, k_w, eps = rope.qk_norm if rope.qk_norm is not None else (query, query, 0.0)
            cos_sin = rope.cos_sin if rope.cos_sin.stride(-1) == 1 else rope.cos_sin.contiguous()
            rope_args = (rope.positions.contiguous(), cos_sin, q_w, k_w, eps, key, value,
                         key.stride(0), value.stride(0), rope.slot_mapping)
    return query, rope, rope_args, step_kv
