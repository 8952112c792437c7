"""Multi-LoRA products: every token adds its own adapter's low-rank update to a layer's output.

``lora_apply(x, y, lora_a, lora_b, slots)`` computes, for every row ``t`` whose slot
``s = slots[t]`` is ``>= 0``, ``y[t] += (x[t] @ lora_a[s].T) @ lora_b[s].T``; rows of slot
``-1`` (no adapter, or a CUDA graph's padding) are left as they are. ``lora_a`` is
``[L, R, K]`` and ``lora_b`` ``[L, N, R]``: ``L`` adapter slots of rank ``R`` (padded with
zeros; the scaling already folded into ``lora_b``).

Two launches, a *shrink* (``[T, K] -> [T, R]`` in fp32) and an *expand* that adds into ``y``.
The shrink's grid is (token tile, K chunk, slot), the expand's (token tile, output tile,
slot): program ``(m, ·, s)`` multiplies the rows of tile ``m`` that belong to slot ``s`` and
skips its work when there are none, so a batch mixing adapters (or requests without one)
costs one tile product per adapter present in the tile, and a batch without adapters only the
launches. The shrink splits ``K`` so a decode batch's few token tiles still fill the device
(one program walking all of ``K`` made a rank-16 adapter on Qwen3-8B cost 22 ms a decode
step on an H200, BENCHMARKS.md 2026-12-05): each chunk writes its own fp32 partial
``[split, T, R]`` and the expand sums them as it loads them, in a fixed order (no atomics:
the same sums on every run, in graphs and eager alike). The grid depends on ``T``, ``K`` and
``L`` only: a CUDA graph captures it, and nothing is read back on the host. A token belongs to one
slot, so each output element has one writer. Both launch with programmatic dependent launch
where the device has it (:func:`mrv2_kernels._backend.pdl`), as the decode chain's kernels do.

The intermediate is rounded to ``lora_b``'s dtype before the expand, as
:func:`lora_apply_ref` (the plain-torch specification, and the CPU's path) does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import cdiv, default_block, next_power_of_2, pdl, pdl_prologue, use_triton

__all__ = ["lora_apply", "lora_apply_ref", "lora_apply_triton", "shrink_split"]


def _check(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
           slots: torch.Tensor) -> None:
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x [T, K] and y [T, N] expected, got {tuple(x.shape)} and "
                         f"{tuple(y.shape)}")
    if lora_a.dim() != 3 or lora_b.dim() != 3 or lora_a.shape[0] != lora_b.shape[0]:
        raise ValueError(f"lora_a [L, R, K] and lora_b [L, N, R] expected, got "
                         f"{tuple(lora_a.shape)} and {tuple(lora_b.shape)}")
    if lora_a.shape[2] != x.shape[1] or lora_b.shape[1] != y.shape[1] or (
            lora_a.shape[1] != lora_b.shape[2]):
        raise ValueError(f"shapes do not chain: x {tuple(x.shape)}, lora_a "
                         f"{tuple(lora_a.shape)}, lora_b {tuple(lora_b.shape)}, y "
                         f"{tuple(y.shape)}")
    if slots.dim() != 1 or slots.shape[0] < x.shape[0]:
        raise ValueError(f"slots must be [>= {x.shape[0]}], got {tuple(slots.shape)}")


def lora_apply_ref(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor,
                   lora_b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Plain-torch specification of :func:`lora_apply` (reads the slots on the host): adds
    into ``y`` in place and returns it."""
    _check(x, y, lora_a, lora_b, slots)
    t = x.shape[0]
    token_slots = slots[:t]
    for s in torch.unique(token_slots).tolist():
        if s < 0:
            continue
        rows = (token_slots == s).nonzero().squeeze(1)
        shrunk = (x[rows].float() @ lora_a[s].float().t()).to(lora_b.dtype)
        y[rows] = (y[rows].float() + shrunk.float() @ lora_b[s].float().t()).to(y.dtype)
    return y


@triton.jit(do_not_specialize=["T"])
def _shrink_kernel(x_ptr: tl.tensor, a_ptr: tl.tensor, slots_ptr: tl.tensor,
                   out_ptr: tl.tensor, T: int, K: int, R: int, CHUNK: int, sxt: int, sxk: int,
                   sal: int, sar: int, sak: int, sos: int, sot: int, BLOCK_M: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   DOT_FP32: tl.constexpr, PDL: tl.constexpr) -> None:
    pdl_prologue(PDL)
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_slot = tl.load(slots_ptr + rows, mask=rows < T, other=-1)
    mine = row_slot == slot
    if tl.sum(mine.to(tl.int32), axis=0) > 0:
        r = tl.arange(0, BLOCK_R)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        start = split * CHUNK
        end = tl.minimum(start + CHUNK, K)
        for k0 in range(start, end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + rows[:, None] * sxt + k[None, :] * sxk,
                         mask=mine[:, None] & (k[None, :] < end), other=0.0)
            at = tl.load(a_ptr + slot * sal + r[:, None] * sar + k[None, :] * sak,
                         mask=(r[:, None] < R) & (k[None, :] < end), other=0.0)
            if DOT_FP32:
                acc = tl.dot(xt.to(tl.float32), tl.trans(at.to(tl.float32)), acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(xt, tl.trans(at), acc)
        tl.store(out_ptr + split * sos + rows[:, None] * sot + r[None, :], acc,
                 mask=mine[:, None] & (r[None, :] < R))


@triton.jit(do_not_specialize=["T"])
def _expand_kernel(h_ptr: tl.tensor, b_ptr: tl.tensor, slots_ptr: tl.tensor,
                   y_ptr: tl.tensor, T: int, N: int, R: int, SPLIT: int, shs: int, sht: int,
                   sbl: int, sbn: int,
                   sbr: int, syt: int, syn: int, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   DOT_FP32: tl.constexpr, PDL: tl.constexpr) -> None:
    pdl_prologue(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_slot = tl.load(slots_ptr + rows, mask=rows < T, other=-1)
    mine = row_slot == slot
    if tl.sum(mine.to(tl.int32), axis=0) > 0:
        r = tl.arange(0, BLOCK_R)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        bt = tl.load(b_ptr + slot * sbl + n[:, None] * sbn + r[None, :] * sbr,
                     mask=(n[:, None] < N) & (r[None, :] < R), other=0.0)
        out = y_ptr + rows[:, None] * syt + n[None, :] * syn
        keep = mine[:, None] & (n[None, :] < N)
        y = tl.load(out, mask=keep, other=0.0)
        h_mask = mine[:, None] & (r[None, :] < R)
        h_rows = h_ptr + rows[:, None] * sht + r[None, :]
        h = tl.load(h_rows, mask=h_mask, other=0.0)
        for split in range(1, SPLIT):  # the shrink's K chunks, summed in order
            h += tl.load(h_rows + split * shs, mask=h_mask, other=0.0)
        if DOT_FP32:
            delta = tl.dot(h, tl.trans(bt.to(tl.float32)), input_precision="ieee")
        else:
            # the intermediate rounded to the adapter's dtype, as the reference does
            delta = tl.dot(h.to(bt.dtype), tl.trans(bt))
        tl.store(out, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=keep)


def shrink_split(t: int, k: int, block_m: int, block_k: int, on_cuda: bool) -> int:
    """How many K chunks the shrink of ``t`` tokens over ``K = k`` runs: on CUDA enough that
    the token tiles times the chunks make ~64 programs a slot (chunks of at least two
    ``block_k`` steps); one on the CPU, and once the token tiles alone are that many.

    Measured on an H200 (BENCHMARKS.md 2026-12-05): this (up to 64 chunks of 128, summed one
    after another by the expand) beat at most 16 chunks of 256 loaded at once by the expand
    at every batch of Qwen3-8B (batch 1 with an adapter 5.99 against 6.39 ms a step)."""
    if not on_cuda:
        return 1
    return max(1, min(cdiv(k, 2 * block_k), 64 // cdiv(t, block_m)))


def lora_apply_triton(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor,
                      lora_b: torch.Tensor, slots: torch.Tensor, *, block_m: int | None = None,
                      block_n: int | None = None, block_k: int | None = None,
                      split_k: int | None = None) -> torch.Tensor:
    """The Triton implementation of :func:`lora_apply` (adds into ``y``; returns it).
    ``split_k``: the shrink's K chunks (default :func:`shrink_split`)."""
    _check(x, y, lora_a, lora_b, slots)
    t, k = x.shape
    num_slots, rank, _ = lora_a.shape
    n = y.shape[1]
    if t == 0 or num_slots == 0 or rank == 0:
        return y
    bm = default_block(x, 16, 16, block_m)
    bn = default_block(x, 64, 32, block_n)
    bk = default_block(x, 64, 32, block_k)
    br = max(16, next_power_of_2(rank))
    split = split_k if split_k is not None else shrink_split(t, k, bm, bk, x.is_cuda)
    if split < 1:
        raise ValueError(f"split_k must be >= 1, got {split}")
    chunk = cdiv(cdiv(k, split), bk) * bk
    split = cdiv(k, chunk)  # (no empty chunk)
    fp32 = lora_b.dtype == torch.float32
    shrunk = torch.empty((split, t, rank), dtype=torch.float32, device=x.device)
    slots = slots if slots.dtype == torch.int32 else slots.to(torch.int32)
    _shrink_kernel[(cdiv(t, bm), split, num_slots)](
        x, lora_a, slots, shrunk, t, k, rank, chunk, x.stride(0), x.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), shrunk.stride(0),
        shrunk.stride(1), BLOCK_M=bm, BLOCK_R=br, BLOCK_K=bk, DOT_FP32=fp32, **pdl(x))
    _expand_kernel[(cdiv(t, bm), cdiv(n, bn), num_slots)](
        shrunk, lora_b, slots, y, t, n, rank, split, shrunk.stride(0), shrunk.stride(1),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), y.stride(0), y.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=br, DOT_FP32=fp32, **pdl(x))
    return y


def _lora_apply_cpu(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor,
                    lora_b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The CPU's path: a batch on one slot (or none) as two dense products, no gathers (the
    usual case: on SmolLM2-135M, one core, batch 1, a rank-16 adapter on every projection
    then cost ~13% of a decode step, ~22% through the reference's gathers; BENCHMARKS.md
    2026-12-05); a batch mixing slots as the reference."""
    t = x.shape[0]
    if t == 0:
        return y
    bounds = torch.aminmax(slots[:t])
    low, high = int(bounds.min), int(bounds.max)
    if low != high:
        return lora_apply_ref(x, y, lora_a, lora_b, slots)
    if low < 0:
        return y
    if x.dtype == y.dtype == lora_a.dtype == lora_b.dtype == torch.float32:
        return y.addmm_(x @ lora_a[low].t(), lora_b[low].t())  # (the same sums, fused)
    shrunk = (x.float() @ lora_a[low].float().t()).to(lora_b.dtype)
    y.copy_((y.float() + shrunk.float() @ lora_b[low].float().t()).to(y.dtype))
    return y


def lora_apply(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
    """``y[t] += (x[t] @ lora_a[slots[t]].T) @ lora_b[slots[t]].T`` where ``slots[t] >= 0``
    (``slots`` may be longer than ``x``: its first ``T`` entries count); in place, returns
    ``y``. Triton on CUDA (no host read); on the CPU the reference's arithmetic (dense
    products when the batch is on one slot)."""
    if use_triton(x):
        return lora_apply_triton(x, y, lora_a, lora_b, slots)
    _check(x, y, lora_a, lora_b, slots)
    return _lora_apply_cpu(x, y, lora_a, lora_b, slots)
