"""Structured outputs' bitmask kernel (Triton, interpreted on CPU) against its torch reference
and against the layout's definition (bit ``t % 32`` of word ``t // 32`` allows token ``t``)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from mrv2_kernels.token_bitmask import (
    apply_token_bitmask,
    apply_token_bitmask_ref,
    apply_token_bitmask_triton,
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)


def _pack(allowed: np.ndarray, words: int) -> torch.Tensor:
    """``[M, V]`` bools as the layout's int32 words (numpy's little-endian bit order)."""
    padded = np.zeros((allowed.shape[0], words * 32), dtype=bool)
    padded[:, : allowed.shape[1]] = allowed
    packed = np.packbits(padded, axis=1, bitorder="little").view(np.int32)
    return torch.from_numpy(packed.copy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [70, 256])
def test_kernel_matches_the_layout_and_the_reference(dtype: torch.dtype, vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen).to(dtype)
    rng = np.random.default_rng(vocab)
    allowed = rng.random((3, vocab)) < 0.3
    allowed[0] = True  # a row that allows everything
    allowed[1, :] = False
    allowed[1, vocab - 1] = True  # only the last token (a partial last word)
    words = (vocab + 31) // 32 + 1  # an extra word, ignored
    bitmask = _pack(allowed, words).to(DEVICE)
    rows = torch.tensor([4, 1, 2], dtype=torch.int32, device=DEVICE)
    dev = logits.to(DEVICE)
    apply_token_bitmask_triton(dev, bitmask, rows, block_v=64)
    ref = logits.to(DEVICE)
    apply_token_bitmask_ref(ref, bitmask, rows)
    assert torch.equal(dev.cpu(), ref.cpu())
    want = logits.clone()
    for m, r in enumerate([4, 1, 2]):
        want[r][torch.from_numpy(~allowed[m])] = float("-inf")
    assert torch.equal(dev.cpu(), want)  # untouched rows (0, 3, 5) and allowed logits kept


def test_no_rows_is_nothing() -> None:
    logits = torch.randn(2, 40, device=DEVICE)
    before = logits.clone()
    apply_token_bitmask(logits, torch.zeros(0, 2, dtype=torch.int32, device=DEVICE),
                        torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(logits, before)


@pytest.mark.parametrize(("bitmask", "rows", "message"), [
    (torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), "int32"),
    (torch.zeros(1, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), "needs 2"),
    (torch.zeros(1, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), "rows must"),
])
def test_bad_arguments_are_refused(bitmask: torch.Tensor, rows: torch.Tensor,
                                   message: str) -> None:
    with pytest.raises(ValueError, match=message):
        apply_token_bitmask_triton(torch.zeros(2, 40, device=DEVICE), bitmask.to(DEVICE),
                                   rows.to(DEVICE))


_SM90_SCRIPT = r"""
from mrv2_kernels import token_bitmask as t

for logits in ("*bf16", "*fp32"):
    build(t._bitmask_kernel, {"logits_ptr": logits, "mask_ptr": "*i32", "rows_ptr": "*i64"},
          dict(BLOCK_V=2048), num_warps=4)
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU run compiles it for real")
def test_the_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    """The store-only kernel compiles for an H100/H200 over bf16 and fp32 logits."""
    from sm90 import compile_for_sm90

    sizes = compile_for_sm90(_SM90_SCRIPT, tmp_path)
    assert len(sizes["_bitmask_kernel"]) == 2
