"""The DSA indexer's top-k selection, bounded by each row's own length.

:func:`indexer_topk_slots` takes the lightning indexer's scores ``logits[t, s]`` (fp32,
:func:`mrv2_kernels.sparse_mla.indexer_logits`), reads only the positions ``s <= pos(t)`` of
each row, picks the ``top`` highest (every one while the row has no more than ``top``) and
writes their flat KV-cache slots (through the request's block table) in position order,
``-1`` after them. Ties at the threshold go to the lowest positions. Nothing past a row's
position is read, so the columns past it may hold anything (the score kernel leaves them
unwritten), and the cost follows the real context, not the width of ``logits``: under CUDA
graphs that width is ``max_model_len``, where ``torch.topk`` over every column costs as much
at a 100-token context as at a full one.

The kernel (a program per row) is a radix select on the scores' order-preserving 32-bit keys:
four passes each histogram the next 8 bits of the keys that share the prefix found so far
(``tl.histogram``) and fix that digit of the ``top``-th highest key; a last pass writes the
rows above the threshold and the first rows equal to it, in order, with a running count.
:func:`indexer_topk_slots_ref` is the specification (a stable descending sort).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backend import use_triton

__all__ = ["indexer_topk_slots", "indexer_topk_slots_full_width", "indexer_topk_slots_ref",
           "indexer_topk_slots_triton"]


def _check(logits: torch.Tensor, token_req: torch.Tensor, token_pos: torch.Tensor,
           block_table: torch.Tensor, out: torch.Tensor) -> None:
    assert logits.dim() == 2 and logits.dtype == torch.float32, "logits must be fp32 [T, S]"
    num_tokens = logits.shape[0]
    assert token_req.shape[0] >= num_tokens and token_pos.shape[0] >= num_tokens, "[T] maps"
    assert block_table.dim() == 2, "block_table must be [num_reqs, max_blocks]"
    assert out.dim() == 2 and out.shape[0] == num_tokens and out.dtype == torch.int64, (
        f"out must be int64 [{num_tokens}, top], got {out.dtype} {tuple(out.shape)}")
    assert out.shape[1] <= logits.shape[1], "top must not exceed the logits' width"


def _visible(token_req: torch.Tensor, token_pos: torch.Tensor, num_tokens: int, span: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(request [T] int64, visible [T, span])``: the columns up to each row's position, none
    on padding rows."""
    req, pos = token_req[:num_tokens].long(), token_pos[:num_tokens].long()
    n = torch.arange(span, device=device)
    return req, (n[None, :] <= pos[:, None]) & (req[:, None] >= 0)


def _slots(block_table: torch.Tensor, req: torch.Tensor, positions: torch.Tensor,
           block_size: int) -> torch.Tensor:
    """Flat cache slots of ``positions`` ``[T, k]`` of each row's request (any value where a
    position is past the block table: the callers mask those)."""
    blocks = block_table[req.clamp(min=0)[:, None], (positions // block_size).clamp(
        max=block_table.shape[1] - 1)].long()
    return blocks * block_size + positions % block_size


def indexer_topk_slots_ref(logits: torch.Tensor, token_req: torch.Tensor,
                           token_pos: torch.Tensor, block_table: torch.Tensor,
                           block_size: int, out: torch.Tensor) -> torch.Tensor:
    """The specification: for row ``t`` of request ``token_req[t]`` (``< 0``: a padding row,
    all ``-1``), the ``top = out.shape[1]`` highest of ``logits[t, :token_pos[t] + 1]`` (ties:
    the lower position first), as flat cache slots ``block_table[req, s // block_size] *
    block_size + s % block_size`` in increasing position, ``-1`` past them. Returns ``out``."""
    _check(logits, token_req, token_pos, block_table, out)
    num_tokens, span = logits.shape
    top = out.shape[1]
    if num_tokens == 0 or top == 0:
        return out
    req, visible = _visible(token_req, token_pos, num_tokens, span, logits.device)
    bits = logits.view(torch.int32).long() & 0xFFFFFFFF
    key = torch.where(bits >= 1 << 31, bits ^ 0xFFFFFFFF, bits | 1 << 31)  # float order
    key = torch.where(visible, key + (1 << 32), 0)  # visible first, then by score
    best = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :top]
    taken = key.gather(1, best) > 0
    chosen = torch.sort(torch.where(taken, best, span), dim=1).values  # in position order
    slots = _slots(block_table, req, chosen, block_size)
    out.copy_(torch.where(chosen < span, slots, -1))
    return out


def indexer_topk_slots_full_width(logits: torch.Tensor, token_req: torch.Tensor,
                                  token_pos: torch.Tensor, block_table: torch.Tensor,
                                  block_size: int, out: torch.Tensor) -> torch.Tensor:
    """The same selection (as a set; ``-1`` where a row has fewer positions, ties as
    ``torch.topk`` breaks them) by ``torch.topk`` over the whole width of ``logits`` after
    filling every column past each row (and padding rows) with ``-inf``: a cost of the full
    width whatever the rows' lengths, but multi-block on long rows, where the one program a
    row of :func:`indexer_topk_slots` is slower (the bench: 0.27x at 131,072 positions, batch
    1, H100). Returns ``out``."""
    _check(logits, token_req, token_pos, block_table, out)
    num_tokens, span = logits.shape
    top = out.shape[1]
    if num_tokens == 0 or top == 0:
        return out
    req, visible = _visible(token_req, token_pos, num_tokens, span, logits.device)
    values, index = logits.masked_fill_(~visible, float("-inf")).topk(top, dim=-1)
    slots = _slots(block_table, req, index, block_size)
    out.copy_(torch.where(values > float("-inf"), slots, -1))
    return out


@triton.jit
def _ordered_key(x: tl.tensor) -> tl.tensor:
    """fp32 -> uint32 whose unsigned order is the floats' order."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _indexer_topk_kernel(
    logits_ptr: tl.tensor, req_ptr: tl.tensor, pos_ptr: tl.tensor, bt_ptr: tl.tensor,
    out_ptr: tl.tensor, span: tl.tensor, stride_lt: tl.tensor, stride_bt: tl.tensor,
    stride_ot: tl.tensor, TOP: tl.constexpr, KV_BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    tok = tl.program_id(0).to(tl.int64)
    req = tl.load(req_ptr + tok)
    pos = tl.load(pos_ptr + tok)
    n = tl.where(req >= 0, tl.minimum(pos + 1, span), 0)
    row_ptr = logits_ptr + tok * stride_lt
    bt_row = bt_ptr + tl.maximum(req, 0).to(tl.int64) * stride_bt
    out_row = out_ptr + tok * stride_ot
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    # The threshold key: the TOP-th highest, one 8-bit digit a pass (skipped when n <= TOP).
    prefix = tl.zeros((), tl.uint32)
    known = tl.zeros((), tl.uint32)  # the bits of prefix fixed so far
    remaining = tl.zeros((), tl.int32) + TOP  # of the keys sharing the prefix, still to take
    if n > TOP:
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            hist = tl.zeros((256,), tl.int32)
            for start in range(0, n, BLOCK):
                s = start + offs
                ok = s < n
                key = _ordered_key(tl.load(row_ptr + s, mask=ok, other=0.0))
                match = ok & ((key & known) == prefix)
                digit = ((key >> shift) & 0xFF).to(tl.int32)
                hist += tl.histogram(digit, 256, mask=match)
            # at_least[d]: keys with this digit >= d; the digit is the highest d with
            # at_least[d] >= remaining (at_least falls as d grows).
            at_least = tl.sum(hist) - tl.cumsum(hist, 0) + hist
            digit_star = tl.sum((at_least >= remaining).to(tl.int32)) - 1
            above = tl.sum(tl.where(bins > digit_star, hist, 0))
            remaining -= above
            prefix |= digit_star.to(tl.uint32) << shift
            known |= tl.full((), 0xFF, tl.uint32) << shift
    # Write the chosen positions' slots in order: all above the threshold, the first
    # `remaining` equal to it (every position while n <= TOP: the threshold key is 0).
    written = tl.zeros((), tl.int32)
    equal_seen = tl.zeros((), tl.int32)
    for start in range(0, n, BLOCK):
        s = start + offs
        ok = s < n
        key = _ordered_key(tl.load(row_ptr + s, mask=ok, other=0.0))
        equal = (ok & (key == prefix)).to(tl.int32)
        equal_rank = equal_seen + tl.cumsum(equal, 0) - equal
        chosen = ok & ((n <= TOP) | (key > prefix) | ((equal != 0) & (equal_rank < remaining)))
        equal_seen += tl.sum(equal)
        rank = written + tl.cumsum(chosen.to(tl.int32), 0) - chosen.to(tl.int32)
        block = tl.load(bt_row + s // KV_BLOCK_SIZE, mask=chosen, other=0).to(tl.int64)
        tl.store(out_row + rank, block * KV_BLOCK_SIZE + s % KV_BLOCK_SIZE,
                 mask=chosen & (rank < TOP))
        written += tl.sum(chosen.to(tl.int32))
    for start in range(written, TOP, BLOCK):
        s = start + offs
        tl.store(out_row + s, tl.full((BLOCK,), -1, tl.int64), mask=s < TOP)


def indexer_topk_slots_triton(logits: torch.Tensor, token_req: torch.Tensor,
                              token_pos: torch.Tensor, block_table: torch.Tensor,
                              block_size: int, out: torch.Tensor, *,
                              block: int | None = None) -> torch.Tensor:
    """:func:`indexer_topk_slots_ref` as a Triton kernel (a program per row)."""
    _check(logits, token_req, token_pos, block_table, out)
    num_tokens, top = out.shape
    if num_tokens == 0 or top == 0:
        return out
    assert logits.stride(1) == 1 and out.stride(1) == 1, "rows must be contiguous"
    on_gpu = logits.is_cuda
    block = block or (1024 if on_gpu else 64)
    _indexer_topk_kernel[(num_tokens,)](
        logits, token_req, token_pos, block_table, out, logits.shape[1], logits.stride(0),
        block_table.stride(0), out.stride(0), TOP=top, KV_BLOCK_SIZE=block_size, BLOCK=block,
        num_warps=8 if on_gpu else 1,
    )  # fmt: skip
    return out


def indexer_topk_slots(logits: torch.Tensor, token_req: torch.Tensor, token_pos: torch.Tensor,
                       block_table: torch.Tensor, block_size: int,
                       out: torch.Tensor) -> torch.Tensor:
    """Each row's ``out.shape[1]`` best visible positions as flat cache slots
    (:func:`indexer_topk_slots_ref`): Triton (see :func:`use_triton`) or the reference."""
    if use_triton(logits):
        return indexer_topk_slots_triton(logits, token_req, token_pos, block_table,
                                         block_size, out)
    return indexer_topk_slots_ref(logits, token_req, token_pos, block_table, block_size, out)
