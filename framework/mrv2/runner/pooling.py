"""Pooling requests in the runner (embeddings, a classifier's labels): which rows pool, and
each step's pooled vectors.

A request with ``pooling_params`` runs as a prompt whose first sampled token nobody reads: the
step that completes its prompt also takes the final hidden state of its last prompt token
(its logits row's), truncated to ``dimensions`` and normalized on the device, and copies it
to the host with the step's tokens (:meth:`AsyncStepOutput.pooled`). Nothing is read back
on the host, and a step without such requests does nothing here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from mrv2.contract.batch import InputBatch
from mrv2.contract.pooling import PoolingParams
from mrv2.contract.requests import NewRequest
from mrv2.model_loader.classification import label_probs

#: ``(request ids, one pooled fp32 vector each)`` of a step.
Pooled = tuple[list[str], list[torch.Tensor]]


class RowPooler:
    """The state-table rows of pooling requests, and their pooled vectors: embeddings, or a
    classifier's label probabilities through its ``head`` (``[N, hidden] -> [N, labels]``
    logits; None: the model is no classifier)."""

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self._rows: dict[int, PoolingParams] = {}
        self.head = head

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
        selected = hidden.index_select(0, index)
        states = selected.float()
        probs = None
        if self.head is not None and any(p.task == "classify" for _, p in picks):
            probs = label_probs(self.head(selected))  # (every pick's: one product)
        vectors = []
        for i, ((_, params), state) in enumerate(zip(picks, states, strict=True)):
            if params.task == "classify":
                assert probs is not None
                vectors.append(probs[i])
                continue
            vector = state[: params.dimensions] if params.dimensions else state
            vectors.append(F.normalize(vector, dim=-1) if params.normalize else vector)
        return [batch.req_ids[i] for i, _ in picks], vectors
