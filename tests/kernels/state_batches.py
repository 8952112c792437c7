"""What the state kernels' tests share (not a test module): the device they run on, seeded
random inputs on it, and varlen batches of ``(query length, start, state row)`` sequences
(``query_start_loc``, ``seq_lens``, rows) as the kernels take them."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

#: ``cpu`` under the interpreter (``TRITON_INTERPRET=1``), else ``cuda``.
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
F32, BF16, I32 = torch.float32, torch.bfloat16, torch.int32


def randn(*shape: int, dtype: torch.dtype = F32, seed: int = 0, scale: float = 1.0
          ) -> torch.Tensor:
    """Seeded normal values (drawn on the CPU: the same on every device) on :data:`DEVICE`."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    """Seeded uniform ``[0, 1)`` values on :data:`DEVICE`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=gen).to(device=DEVICE)


@dataclass
class Batch:
    """A step's varlen metadata on :data:`DEVICE`."""

    qsl: torch.Tensor
    seq_lens: torch.Tensor
    rows: torch.Tensor
    num_tokens: int  # with the padding tokens
    real_tokens: int

    @property
    def meta(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(query_start_loc, seq_lens, state_rows)``."""
        return self.qsl, self.seq_lens, self.rows


def make_batch(seqs: list[tuple[int, int, int]], pad_tokens: int = 0) -> Batch:
    """``seqs``: (query length, start, state row) per sequence; ``pad_tokens`` padding tokens
    after them."""
    qsl = [0]
    for length, _, _ in seqs:
        qsl.append(qsl[-1] + length)
    return Batch(
        qsl=torch.tensor(qsl, dtype=I32, device=DEVICE),
        seq_lens=torch.tensor([q + s for q, s, _ in seqs], dtype=I32, device=DEVICE),
        rows=torch.tensor([r for _, _, r in seqs], dtype=I32, device=DEVICE),
        num_tokens=qsl[-1] + pad_tokens,
        real_tokens=qsl[-1],
    )
