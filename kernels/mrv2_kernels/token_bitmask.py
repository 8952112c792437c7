"""Structured outputs' allowed-token bitmasks applied to logits, in place.

A bitmask row holds one bit a token, packed in int32 words: token ``t`` is allowed when bit
``t % 32`` of word ``t // 32`` is 1 (llguidance's and vLLM's layout). For mask row ``m`` and
logits row ``rows[m]`` every disallowed token's logit becomes ``-inf``; other logits and other
rows are not touched. The kernel only stores (no logits are read): one program per (mask row,
vocabulary tile) reads its tile's words and writes ``-inf`` where a bit is 0.
"""

import torch
import triton
import triton.language as tl

from ._backend import cdiv, default_block, use_triton

__all__ = ["apply_token_bitmask", "apply_token_bitmask_ref", "apply_token_bitmask_triton"]


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor,
                            rows: torch.Tensor) -> None:
    """Plain-torch specification of :func:`apply_token_bitmask` (same arguments, same
    effect)."""
    vocab = logits.shape[1]
    if bitmask.shape[0] == 0:
        return
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :vocab]
    index = rows.long()
    logits[index] = logits[index].masked_fill(bits == 0, float("-inf"))


@triton.jit
def _bitmask_kernel(
    logits_ptr: tl.tensor,
    logits_stride: int,
    vocab_size: int,
    mask_ptr: tl.tensor,
    mask_stride: int,
    rows_ptr: tl.tensor,
    BLOCK_V: tl.constexpr,
) -> None:
    m = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = t < vocab_size
    word = tl.load(mask_ptr + m * mask_stride + t // 32, mask=valid, other=-1)
    banned = ((word >> (t % 32)) & 1) == 0
    row = tl.load(rows_ptr + m).to(tl.int64)
    minus_inf = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    tl.store(logits_ptr + row * logits_stride + t,
             minus_inf.to(logits_ptr.dtype.element_ty), mask=valid & banned)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor,
                               rows: torch.Tensor, block_v: int | None = None) -> None:
    """Triton implementation of :func:`apply_token_bitmask`: a program per (mask row,
    vocabulary tile)."""
    _check(logits, bitmask, rows)
    n, vocab = bitmask.shape[0], logits.shape[1]
    if n == 0 or vocab == 0:
        return
    block = default_block(logits, cuda=2048, cpu=256, block=block_v)
    _bitmask_kernel[(n, cdiv(vocab, block))](
        logits, logits.stride(0), vocab, bitmask, bitmask.stride(0), rows, BLOCK_V=block,
        num_warps=4,
    )


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    if logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError("logits must be 2-D with contiguous rows")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.stride(1) != 1:
        raise ValueError("bitmask must be a 2-D int32 tensor with contiguous rows")
    if bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(f"bitmask has {bitmask.shape[1]} words a row; the vocabulary of "
                         f"{logits.shape[1]} needs {cdiv(logits.shape[1], 32)}")
    if rows.shape != (bitmask.shape[0],) or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be int32/int64 of shape ({bitmask.shape[0]},)")


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Set to ``-inf``, in place, the logits of ``rows`` whose token's bit is 0.

    Args:
        logits: ``[N, V]`` (any float dtype), edited in place.
        bitmask: ``[M, ceil(V / 32)]`` int32 on the logits' device (extra words are ignored).
        rows: ``[M]`` int32/int64, the logits row each mask row applies to (distinct).
    """
    if use_triton(logits):
        apply_token_bitmask_triton(logits, bitmask, rows)
    else:
        _check(logits, bitmask, rows)
        apply_token_bitmask_ref(logits, bitmask, rows)
