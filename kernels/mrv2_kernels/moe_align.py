"""Step 1 of :mod:`mrv2_kernels.fused_moe`: the (token, slot) pairs sorted by expert, on the GPU.

``moe_align(topk_ids, num_experts, block_m)`` gives the flat pair indices ``t*K + j`` of each
expert in increasing order, padded with the sentinel ``T*K`` to a multiple of ``block_m``; the
expert of every ``block_m`` block (-1 past the last group); and the padded row count, as a
device tensor. Experts without tokens get no block. Every size depends on ``(T, K, E,
block_m)`` only (:func:`moe_max_blocks`), so a CUDA graph can capture it; nothing is read back
on the host. Up to 128 pairs one program does it in registers; beyond, a histogram per chunk of
128 pairs, a scan over the chunks per expert and a scatter by rank within the chunk (stable, so
the result is deterministic). :func:`moe_align_ref` is the plain-torch specification.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import cdiv, next_power_of_2

__all__ = ["moe_align", "moe_align_ref", "moe_max_blocks"]

_ID_DTYPES = (torch.int32, torch.int64)

#: Pairs per program of the align histogram / scatter (the scatter ranks a chunk's pairs with a
#: ``[CHUNK, CHUNK]`` comparison); up to this many pairs, one program aligns them all.
_ALIGN_CHUNK = 128


def _tile(name: str, value: int, minimum: int) -> int:
    """``value`` if it is a power of two ``>= minimum`` (a tile size), else a ValueError."""
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")
    return value


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the align kernels write comes from here (tests poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def moe_max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the ``block_m`` blocks of :func:`moe_align` for ``num_pairs = T*K``
    pairs: each non-empty expert pads at most one partial block."""
    return cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


def moe_align_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int,
    valid_tokens: torch.Tensor | None = None, first_token: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-torch specification of :func:`moe_align` (loops over the experts on the host).

    Returns ``(sorted_ids, block_expert, num_post)``: ``sorted_ids`` int32
    ``[moe_max_blocks(T*K, E, block_m) * block_m]`` holds, expert after expert, the flat
    indices ``t*K + j`` of the pairs routed to it in increasing order, each expert's group
    padded with ``T*K`` to a multiple of ``block_m`` (and ``T*K`` past the last group);
    ``block_expert`` int32 ``[max_blocks]`` the expert of each block (``-1`` past the last);
    ``num_post`` int32 ``[1]`` the padded row count (``block_m`` times the block count).
    With ``valid_tokens`` (an int tensor ``[1]``, on the device) only the pairs of tokens
    ``t < valid_tokens[0] - first_token`` count: the rest are padding, left out like pairs
    whose expert is outside ``[0, E)``.
    """
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    if valid_tokens is not None:
        top_k = topk_ids.shape[-1] if topk_ids.dim() > 1 else 1
        limit = (int(valid_tokens.reshape(-1)[0]) - first_token) * top_k
        flat = torch.where(torch.arange(num_pairs, device=flat.device) < limit, flat, -1)
    max_blocks = moe_max_blocks(num_pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    block_expert = torch.full((max_blocks,), -1, dtype=torch.int32, device=device)
    row = 0
    for e in range(num_experts):
        pairs = (flat == e).nonzero().squeeze(1)
        if pairs.numel() == 0:
            continue
        sorted_ids[row:row + pairs.numel()] = pairs.to(torch.int32)
        blocks = cdiv(pairs.numel(), block_m)
        block_expert[row // block_m:row // block_m + blocks] = e
        row += blocks * block_m
    return sorted_ids, block_expert, torch.tensor([row], dtype=torch.int32, device=device)


@triton.jit
def _chunk_ids(ids_ptr: tl.tensor, chunk: int, num_pairs: int, num_experts: int,
               limit_ptr: tl.tensor, first_token: int, top_k: int, CHUNK: tl.constexpr,
               HAS_LIMIT: tl.constexpr) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """The flat indices of chunk ``chunk``, their experts (-1 where not a real pair), and
    which are real pairs (with ``HAS_LIMIT``: of tokens below ``limit_ptr[0] - first_token``)."""
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    inside = offs < num_pairs
    if HAS_LIMIT:
        inside = inside & (offs < (tl.load(limit_ptr) - first_token) * top_k)
    ids = tl.load(ids_ptr + offs, mask=inside, other=-1).to(tl.int32)
    valid = inside & (ids >= 0) & (ids < num_experts)
    return offs, tl.where(valid, ids, -1), valid


@triton.jit
def _chunk_rank(ids: tl.tensor, CHUNK: tl.constexpr) -> tl.tensor:
    """For each pair of a chunk, the earlier pairs of the chunk with the same expert: the
    scatter is stable, so ``sorted_ids`` does not depend on timing."""
    local = tl.arange(0, CHUNK)
    earlier = (ids[:, None] == ids[None, :]) & (local[None, :] < local[:, None])
    return tl.sum(earlier.to(tl.int32), axis=1)


@triton.jit
def _write_padding(sorted_ptr: tl.tensor, start: tl.tensor, counts: tl.tensor,
                   padded: tl.tensor, num_pairs: int, BLOCK_M: tl.constexpr,
                   E_PAD: tl.constexpr, TILE_P: tl.constexpr) -> None:
    """The sentinel in the padding slots ending each expert's group."""
    first = start + counts
    pad = padded - counts
    for j0 in tl.static_range(0, BLOCK_M, TILE_P):
        j = j0 + tl.arange(0, TILE_P)
        tl.store(sorted_ptr + first[:, None] + j[None, :],
                 tl.zeros([E_PAD, TILE_P], dtype=tl.int32) + num_pairs,
                 mask=j[None, :] < pad[:, None])


@triton.jit
def _write_blocks(block_expert_ptr: tl.tensor, end: tl.tensor, total: tl.tensor, lo: int,
                  hi: int, BLOCK_M: tl.constexpr, TILE_B: tl.constexpr) -> None:
    """The experts of blocks ``[lo, hi)`` (-1 past the last group). Block b starts at row
    ``b*BLOCK_M``, inside the group of the first expert whose group ends after it: its index
    is the number of groups (empty ones included) ending at or before that row."""
    for b0 in range(lo, hi, TILE_B):
        blocks = b0 + tl.arange(0, TILE_B)
        first_row = blocks * BLOCK_M
        expert = tl.sum((end[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(first_row < total, expert, -1),
                 mask=blocks < hi)


@triton.jit
def _write_tail(sorted_ptr: tl.tensor, total: tl.tensor, lo: int, hi: int, num_pairs: int,
                TILE_F: tl.constexpr) -> None:
    """The sentinel in the slots of ``[lo, hi)`` past the last group (from ``total`` on)."""
    for r0 in range(lo, hi, TILE_F):
        rows = r0 + tl.arange(0, TILE_F)
        tl.store(sorted_ptr + rows, tl.zeros([TILE_F], dtype=tl.int32) + num_pairs,
                 mask=(rows >= total) & (rows < hi))


@triton.jit
def _groups(counts: tl.tensor, BLOCK_M: tl.constexpr
            ) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """Each expert's padded group size, first slot and end slot, and the padded total."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, axis=0)
    return padded, end - padded, end, tl.sum(padded, axis=0)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks", "first_token", "top_k"])
def _align_single_kernel(
    ids_ptr: tl.tensor,
    sorted_ptr: tl.tensor,
    block_expert_ptr: tl.tensor,
    num_post_ptr: tl.tensor,
    num_pairs: int,
    num_experts: int,
    max_blocks: int,
    limit_ptr: tl.tensor,
    first_token: int,
    top_k: int,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    E_PAD: tl.constexpr,
    TILE_P: tl.constexpr,
    TILE_B: tl.constexpr,
    TILE_F: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
) -> None:
    # All pairs in one chunk, one program, everything in registers: count, scan, scatter.
    offs, ids, valid = _chunk_ids(ids_ptr, 0, num_pairs, num_experts, limit_ptr, first_token,
                                  top_k, CHUNK, HAS_LIMIT)
    experts = tl.arange(0, E_PAD)
    onehot = ids[:, None] == experts[None, :]
    counts = tl.sum(onehot.to(tl.int32), axis=0)
    padded, start, end, total = _groups(counts, BLOCK_M)
    tl.store(num_post_ptr, total)
    base = tl.gather(start, tl.where(valid, ids, 0), 0)
    tl.store(sorted_ptr + base + _chunk_rank(ids, CHUNK), offs, mask=valid)
    _write_padding(sorted_ptr, start, counts, padded, num_pairs, BLOCK_M, E_PAD, TILE_P)
    _write_blocks(block_expert_ptr, end, total, 0, max_blocks, BLOCK_M, TILE_B)
    _write_tail(sorted_ptr, total, 0, max_blocks * BLOCK_M, num_pairs, TILE_F)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "first_token", "top_k"])
def _align_count_kernel(
    ids_ptr: tl.tensor,
    counts_ptr: tl.tensor,
    num_pairs: int,
    num_experts: int,
    num_chunks: int,
    limit_ptr: tl.tensor,
    first_token: int,
    top_k: int,
    CHUNK: tl.constexpr,
    E_PAD: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
) -> None:
    # counts[e, c]: the pairs of chunk c routed to expert e.
    chunk = tl.program_id(0)
    _, ids, _ = _chunk_ids(ids_ptr, chunk, num_pairs, num_experts, limit_ptr, first_token, top_k,
                           CHUNK, HAS_LIMIT)
    experts = tl.arange(0, E_PAD)
    counts = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + experts * num_chunks + chunk, counts)


@triton.jit(do_not_specialize=["num_chunks"])
def _align_scan_kernel(
    counts_ptr: tl.tensor,
    base_ptr: tl.tensor,
    totals_ptr: tl.tensor,
    num_chunks: int,
    TILE_C: tl.constexpr,
) -> None:
    # Program e: base[e, c] = the pairs of expert e in the chunks before c; totals[e].
    expert = tl.program_id(0)
    row = expert * num_chunks
    carry = tl.sum(tl.zeros([TILE_C], dtype=tl.int32), axis=0)
    for c0 in range(0, num_chunks, TILE_C):
        chunks = c0 + tl.arange(0, TILE_C)
        mask = chunks < num_chunks
        tile = tl.load(counts_ptr + row + chunks, mask=mask, other=0)
        tl.store(base_ptr + row + chunks, carry + tl.cumsum(tile, axis=0) - tile, mask=mask)
        carry += tl.sum(tile, axis=0)
    tl.store(totals_ptr + expert, carry)


@triton.jit(do_not_specialize=["num_pairs", "max_blocks", "first_token", "top_k"])
def _align_scatter_kernel(
    ids_ptr: tl.tensor,
    base_ptr: tl.tensor,
    totals_ptr: tl.tensor,
    sorted_ptr: tl.tensor,
    block_expert_ptr: tl.tensor,
    num_post_ptr: tl.tensor,
    num_pairs: int,
    num_experts: int,
    max_blocks: int,
    limit_ptr: tl.tensor,
    first_token: int,
    top_k: int,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    E_PAD: tl.constexpr,
    TILE_P: tl.constexpr,
    TILE_B: tl.constexpr,
    TILE_F: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
) -> None:
    # Program c places chunk c's pairs and writes its share of the block experts and of the
    # sentinels past the last group; program 0 also the padding sentinels and the total.
    chunk = tl.program_id(0)
    num_chunks = tl.num_programs(0)
    experts = tl.arange(0, E_PAD)
    counts = tl.load(totals_ptr + experts)
    padded, start, end, total = _groups(counts, BLOCK_M)
    offs, ids, valid = _chunk_ids(ids_ptr, chunk, num_pairs, num_experts, limit_ptr,
                                  first_token, top_k, CHUNK, HAS_LIMIT)
    base = tl.load(base_ptr + ids * num_chunks + chunk, mask=valid, other=0)
    base += tl.gather(start, tl.where(valid, ids, 0), 0)
    tl.store(sorted_ptr + base + _chunk_rank(ids, CHUNK), offs, mask=valid)
    if chunk == 0:
        tl.store(num_post_ptr, total)
        _write_padding(sorted_ptr, start, counts, padded, num_pairs, BLOCK_M, E_PAD, TILE_P)
    per_program = tl.cdiv(max_blocks, num_chunks)
    lo = chunk * per_program
    hi = tl.minimum(lo + per_program, max_blocks)
    _write_blocks(block_expert_ptr, end, total, lo, hi, BLOCK_M, TILE_B)
    _write_tail(sorted_ptr, total, lo * BLOCK_M, hi * BLOCK_M, num_pairs, TILE_F)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int,
    valid_tokens: torch.Tensor | None = None, first_token: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the ``T*K`` (token, slot) pairs of ``topk_ids`` by expert on the device.

    Same results as :func:`moe_align_ref` (see there); every size depends on
    ``(T, K, num_experts, block_m)`` only and nothing reads back to the host, so CUDA graphs
    can capture it. Up to 128 pairs: one program, in registers. Beyond, three launches: a
    histogram per 128 pairs, a scan over the chunks per expert, and a scatter per 128 pairs
    (each ranks its pairs within the chunk and writes a share of the block experts and of the
    sentinels). Pairs whose expert is outside ``[0, num_experts)`` are left out, and with
    ``valid_tokens`` (int32 ``[1]`` on the device: a CUDA graph's real token count, its
    padding tokens after them) the pairs of tokens ``t >= valid_tokens[0] - first_token``
    too, read on the device.
    """
    if topk_ids.dtype not in _ID_DTYPES:
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    block_m = _tile("block_m", block_m, 1)
    if valid_tokens is not None and (valid_tokens.dtype != torch.int32
                                     or valid_tokens.device != topk_ids.device):
        raise ValueError(f"valid_tokens must be int32 on {topk_ids.device}, got "
                         f"{valid_tokens.dtype} on {valid_tokens.device}")
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    top_k = topk_ids.shape[-1] if topk_ids.dim() > 1 else 1
    limit = {"limit_ptr": ids if valid_tokens is None else valid_tokens,
             "first_token": first_token, "top_k": top_k, "HAS_LIMIT": valid_tokens is not None}
    max_blocks = moe_max_blocks(num_pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = _empty((max_blocks * block_m,), torch.int32, device)
    block_expert = _empty((max_blocks,), torch.int32, device)
    num_post = _empty((1,), torch.int32, device)
    if num_pairs == 0:
        return sorted_ids, block_expert, num_post.zero_()
    e_pad = next_power_of_2(num_experts)
    tiles = {"TILE_P": min(block_m, max(1, 4096 // e_pad)), "TILE_B": max(1, 4096 // e_pad),
             "TILE_F": 1024}
    if num_pairs <= _ALIGN_CHUNK:
        _align_single_kernel[(1,)](
            ids, sorted_ids, block_expert, num_post, num_pairs, num_experts, max_blocks,
            BLOCK_M=block_m, CHUNK=max(16, next_power_of_2(num_pairs)), E_PAD=e_pad,
            num_warps=4, **tiles, **limit,
        )
        return sorted_ids, block_expert, num_post
    chunk = _ALIGN_CHUNK
    num_chunks = cdiv(num_pairs, chunk)
    counts = _empty((e_pad, num_chunks), torch.int32, device)
    base = _empty((e_pad, num_chunks), torch.int32, device)
    totals = _empty((e_pad,), torch.int32, device)
    _align_count_kernel[(num_chunks,)](ids, counts, num_pairs, num_experts, num_chunks,
                                       CHUNK=chunk, E_PAD=e_pad, num_warps=4, **limit)
    _align_scan_kernel[(e_pad,)](counts, base, totals, num_chunks, TILE_C=1024, num_warps=4)
    _align_scatter_kernel[(num_chunks,)](
        ids, base, totals, sorted_ids, block_expert, num_post, num_pairs, num_experts,
        max_blocks, BLOCK_M=block_m, CHUNK=chunk, E_PAD=e_pad, num_warps=8, **tiles, **limit,
    )
    return sorted_ids, block_expert, num_post
