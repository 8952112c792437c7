"""Repetition / frequency / presence penalties, applied in place to a batch's fp32 logits.

Semantics (vLLM's): for batch row ``b`` with state-table row ``r = idx_mapping[b]`` and vocab
index ``v``, with ``c = output_counts[r, v]`` (times ``v`` was generated) and
``seen = prompt_mask[r, v] or c > 0``::

    if seen:   x = x / rep[r] if x > 0 else x * rep[r]
    x = x - freq[r] * c - pres[r] * (c > 0)

Per-request parameters are read through ``idx_mapping``; nothing is expanded per request.
"""

import torch
import triton
import triton.language as tl

from ._backend import cdiv, default_block, use_triton

__all__ = ["apply_penalties", "apply_penalties_ref", "apply_penalties_triton"]


def apply_penalties_ref(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> None:
    """Plain-torch specification of :func:`apply_penalties` (same arguments, same effect)."""
    rows = idx_mapping.long()
    x = logits.float()
    counts = output_counts[rows].float()
    out_seen = counts > 0
    seen = prompt_mask[rows].bool() | out_seen
    rep = repetition[rows].float()[:, None]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - frequency[rows].float()[:, None] * counts
    x = x - presence[rows].float()[:, None] * out_seen.float()
    logits.copy_(x)


@triton.jit
def _penalties_kernel(
    logits_ptr: tl.tensor,
    logits_stride: int,
    vocab_size: int,
    idx_ptr: tl.tensor,
    counts_ptr: tl.tensor,
    counts_stride: int,
    mask_ptr: tl.tensor,
    mask_stride: int,
    rep_ptr: tl.tensor,
    freq_ptr: tl.tensor,
    pres_ptr: tl.tensor,
    BLOCK_V: tl.constexpr,
) -> None:
    b = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = v < vocab_size
    r = tl.load(idx_ptr + b).to(tl.int64)
    rep = tl.load(rep_ptr + r).to(tl.float32)
    freq = tl.load(freq_ptr + r).to(tl.float32)
    pres = tl.load(pres_ptr + r).to(tl.float32)
    x = tl.load(logits_ptr + b * logits_stride + v, mask=valid, other=0.0).to(tl.float32)
    c = tl.load(counts_ptr + r * counts_stride + v, mask=valid, other=0).to(tl.float32)
    p = tl.load(mask_ptr + r * mask_stride + v, mask=valid, other=0)
    out_seen = c > 0
    seen = (p != 0) | out_seen
    x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
    x = x - freq * c - tl.where(out_seen, pres, 0.0)
    tl.store(logits_ptr + b * logits_stride + v, x, mask=valid)


def apply_penalties_triton(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    block_v: int | None = None,
) -> None:
    """Triton implementation of :func:`apply_penalties`: one program per (row, vocab tile)."""
    _check(logits, idx_mapping, output_counts, prompt_mask, repetition, frequency, presence)
    n, vocab = logits.shape
    if n == 0 or vocab == 0:
        return
    if prompt_mask.dtype == torch.bool:
        prompt_mask = prompt_mask.view(torch.uint8)
    block = default_block(logits, cuda=1024, cpu=128, block=block_v)
    grid = (n, cdiv(vocab, block))
    _penalties_kernel[grid](
        logits, logits.stride(0), vocab, idx_mapping, output_counts, output_counts.stride(0),
        prompt_mask, prompt_mask.stride(0), repetition, frequency, presence, BLOCK_V=block,
    )


def _check(
    logits: torch.Tensor, idx: torch.Tensor, counts: torch.Tensor, mask: torch.Tensor,
    *params: torch.Tensor,
) -> None:
    if logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError("logits must be 2-D with contiguous rows")
    if logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32, got {logits.dtype}")
    if idx.shape != (logits.shape[0],):
        raise ValueError(f"idx_mapping must have shape ({logits.shape[0]},)")
    for name, t in (("output_counts", counts), ("prompt_mask", mask)):
        if t.dim() != 2 or t.shape[1] < logits.shape[1] or t.stride(1) != 1:
            raise ValueError(f"{name} must be [rows, >= vocab] with contiguous rows")
    for t in params:  # the kernel reads row r's parameter at ``ptr + r``
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError("repetition, frequency and presence must be contiguous 1-D tensors")


def apply_penalties(
    logits: torch.Tensor,
    idx_mapping: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> None:
    """Apply the three penalties in place (see the module docstring).

    Args:
        logits: ``[B, V]`` float32, edited in place.
        idx_mapping: ``[B]`` int32/int64 state-table row of each batch row.
        output_counts: ``[R, V]`` int32 generated-token counts per row.
        prompt_mask: ``[R, V]`` bool, tokens of each row's prompt.
        repetition, frequency, presence: ``[R]`` float32 per-row parameters
            (1, 0, 0 disable them).
    """
    if use_triton(logits):
        apply_penalties_triton(logits, idx_mapping, output_counts, prompt_mask, repetition,
                               frequency, presence)
    else:
        _check(logits, idx_mapping, output_counts, prompt_mask)
        apply_penalties_ref(logits, idx_mapping, output_counts, prompt_mask, repetition,
                            frequency, presence)
