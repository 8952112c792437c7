"""Embedding requests' pooling in the runner: which rows pool, and each step's pooled states.

A request with ``pooling_params`` runs as a prompt whose first sampled token nobody reads: the
step that completes its prompt also takes the final hidden state of its last prompt token
(its logits row's), truncated to ``dimensions`` and normalized on the device, and copies it
to the host with the step's tokens (:meth:`AsyncStepOutput.pooled`). Nothing is read back
on the host, and a step without such requests does nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from mrv2.contract.batch import InputBatch
from mrv2.contract.pooling import PoolingParams
from mrv2.contract.requests import NewRequest

#: ``(request ids, one pooled fp32 vector each)`` of a step.
Pooled = tuple[list[str], list[torch.Tensor]]


class RowPooler:
    """The state-table rows of embedding requests, and their pooled hidden states."""

    def __init__(self) -> None:
        self._rows: dict[int, PoolingParams] = {}

    def add(self, requests: Sequence[NewRequest], rows: Sequence[int]) -> None:
        for request, row in zip(requests, rows, strict=True):
            if request.pooling_params is not None:
                self._rows[row] = request.pooling_params

    def remove(self, row: int) -> None:
        self._rows.pop(row, None)

    def pool(self, batch: InputBatch, hidden: torch.Tensor) -> Pooled | None:
        """The pooled states of the step's embedding requests that complete their prompt
        (None when there are none)."""
        if not self._rows:
            return None
        picks = [(i, self._rows[int(row)])
                 for i, row in enumerate(batch.idx_mapping_cpu[: batch.num_reqs])
                 if int(row) in self._rows and batch.do_sample[i]]
        if not picks:
            return None
        rows = [int(batch.cu_num_logits[i]) for i, _ in picks]  # each one's logits row
        index = torch.tensor(rows, dtype=torch.int64, pin_memory=hidden.is_cuda)
        index = batch.logits_indices[index.to(hidden.device, non_blocking=True)]
        states = hidden.index_select(0, index).float()
        vectors = []
        for (_, params), state in zip(picks, states, strict=True):
            vector = state[: params.dimensions] if params.dimensions else state
            vectors.append(F.normalize(vector, dim=-1) if params.normalize else vector)
        return [batch.req_ids[i] for i, _ in picks], vectors
