"""Pooling requests in the runner (embeddings, a classifier's labels, either per prompt
token): which rows pool, and each step's pooled vectors.

A request with ``pooling_params`` runs as a prompt whose first sampled token nobody reads: the
step that completes its prompt also takes the final hidden state of its last prompt token
(its logits row's), truncated to ``dimensions`` and normalized on the device, and copies it
to the host with the step's tokens (:meth:`AsyncStepOutput.pooled`). A per-token request
(``token_embed``, ``token_classify``) takes a row for each of its tokens in every step that
computes some (a chunked prompt's come in chunks; the engine joins them). Nothing is read back
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

#: ``(request ids, one pooled fp32 vector each, or one row per token of a per-token
#: request)`` of a step.
Pooled = tuple[list[str], list[torch.Tensor]]


class RowPooler:
    """The state-table rows of pooling requests, and their pooled vectors: embeddings, or a
    classifier's label probabilities through its ``head`` (``[N, hidden] -> [N, labels]``
    logits, given raw where ``use_activation`` is False; None: the model is no
    classifier)."""

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
        """The pooled states of the step's pooling requests: of those that complete their
        prompt, the last token's; of per-token requests, a row for each of their tokens in
        the step (a long prompt's come chunk by chunk). None when there are none."""
        if not self._rows:
            return None
        last: list[tuple[int, PoolingParams]] = []
        every: list[tuple[int, PoolingParams]] = []
        for i, row in enumerate(batch.idx_mapping_cpu[: batch.num_reqs]):
            params = self._rows.get(int(row))
            if params is not None and params.per_token:
                every.append((i, params))
            elif params is not None and batch.do_sample[i]:
                last.append((i, params))
        if not last and not every:
            return None
        req_ids: list[str] = []
        vectors: list[torch.Tensor] = []
        if last:
            rows = [int(batch.cu_num_logits[i]) for i, _ in last]  # each one's logits row
            index = torch.tensor(rows, dtype=torch.int64, pin_memory=hidden.is_cuda)
            index = batch.logits_indices[index.to(hidden.device, non_blocking=True)]
            selected = hidden.index_select(0, index)
            logits = probs = None
            if self.head is not None and any(p.kind == "classify" for _, p in last):
                logits = self.head(selected)  # (every pick's: one product)
                probs = label_probs(logits)
            for k, (i, params) in enumerate(last):
                req_ids.append(batch.req_ids[i])
                if params.kind == "classify" and logits is not None and probs is not None:
                    vectors.append(logits[k].float() if params.use_activation is False
                                   else probs[k])
                else:
                    vectors.append(self._embed(selected[k], params))
        starts = batch.query_start_loc_cpu
        for i, params in every:
            states = hidden[int(starts[i]):int(starts[i + 1])]
            req_ids.append(batch.req_ids[i])
            if params.kind == "token_classify":
                assert self.head is not None  # (PoolingParams.check: a classifier's)
                logits = self.head(states)
                vectors.append(logits.float() if params.use_activation is False
                               else label_probs(logits))
            else:
                vectors.append(self._embed(states, params))
        return req_ids, vectors

    @staticmethod
    def _embed(states: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """An embedding of each state (the last dimension): its first ``dimensions``
        entries, scaled to unit length with ``normalize`` (None, the engine's default left
        unresolved: yes)."""
        states = states.float()
        if params.dimensions:
            states = states[..., : params.dimensions]
        return F.normalize(states, dim=-1) if params.normalize is not False else states
