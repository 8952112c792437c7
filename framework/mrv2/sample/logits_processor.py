"""The logits-processor interface: a plugin's hand on each step's logits before sampling."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mrv2.contract.batch import InputBatch
    from mrv2.contract.state_table import RequestStateTable


class LogitsProcessor(ABC):
    """Edits a batch's fp32 logits in place, before temperature and sampling.

    ``logits`` is ``[num_logits, vocab]``: one row per request of ``batch`` (batch order), or
    ``1 + k`` consecutive rows for a request verifying ``k`` drafts (``batch.cu_num_logits``);
    ``table`` is the persistent request-state table, whose row of each logits row is
    ``batch.logits_idx_mapping``.
    Implementations launch device work only: no ``.item()``, ``.tolist()`` or ``.cpu()``.
    Built once per runner with ``cls(vocab_size, device)``.
    """

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    @abstractmethod
    def apply(self, logits: torch.Tensor, batch: InputBatch, table: RequestStateTable) -> None:
        """Modify ``logits`` in place."""
