"""The runner's side of per-request state (:mod:`mrv2.contract.request_state`): the start-up
report, the rows each request owns (speculative decoding's ``row_slots``), and the per-row
kernel table of prefix caching's snapshots (:mod:`mrv2.engine.state_snapshots`), written with
each new request's row and handed to the layers through the forward context."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mrv2.contract.forward_context import ForwardContext
from mrv2.contract.requests import NewRequest
from mrv2.contract.staged_edits import StagedEdits
from mrv2.runner.startup import StartupReport
from mrv2_kernels.linear_attention import STATE_TABLE_COLS, default_state_table

__all__ = ["StateRows"]


class StateRows:
    """Per-request state in the runner: :attr:`enabled` when the model has such layers.

    ``max_num_reqs``: the state table's request rows. Each owns ``row_slots`` state rows (1, or
    ``1 + k`` with speculative decoding: :mod:`mrv2.contract.request_state`); snapshot slot
    ``i`` is state row ``max_num_reqs * row_slots + i``."""

    def __init__(self, model_state: Any, max_num_reqs: int, device: torch.device,
                 startup: StartupReport) -> None:
        #: Whether the model keeps per-request state.
        self.enabled = bool(model_state.keeps_request_state)
        #: Snapshot slots for prefix caching (0: prefix caching off for this model).
        self.num_slots = int(getattr(model_state, "request_state_slots", 0))
        #: State rows per request (the kernels' ``row_slots``).
        self.row_slots = int(getattr(model_state, "request_state_row_slots", 1))
        self.max_num_reqs = max_num_reqs
        #: ``[max_num_reqs, 6]`` int32 (the kernels' ``state_table``); None without slots.
        self.table: torch.Tensor | None = None
        if not self.enabled:
            return
        row_bytes = int(model_state.request_state_row_bytes)
        startup.facts.update(request_state_bytes=int(model_state.request_state_bytes),
                             request_state_slots=self.num_slots,
                             request_state_row_slots=self.row_slots)
        startup.log("request state: %d layers keep %.1f MiB per request (x%d rows for "
                    "speculative decoding), %.2f GiB for max_num_seqs=%d and %d prefix-cache "
                    "snapshots", len(model_state.request_state_layers),
                    self.row_slots * row_bytes / (1 << 20), self.row_slots,
                    model_state.request_state_bytes / (1 << 30), max_num_reqs, self.num_slots)
        if self.num_slots:
            self.table = default_state_table(max_num_reqs, device)

    def add_requests(self, requests: list[NewRequest], rows: list[int],
                     staged: StagedEdits) -> None:
        """Write each new request's table row (slots made state rows; none: the defaults)."""
        if self.table is None or not requests:
            return
        values = np.empty((len(requests), STATE_TABLE_COLS), dtype=np.int32)
        base = self.max_num_reqs * self.row_slots
        for i, (request, row) in enumerate(zip(requests, rows, strict=True)):
            entry = request.state_table_row
            if entry is None:
                values[i] = (row, -1, -1, 0, -1, 0)
                continue
            src, src_pos, p0, s0, p1, s1 = entry
            for slot in (src, s0, s1):
                if not -1 <= slot < self.num_slots:
                    raise ValueError(f"request {request.req_id!r}: state snapshot slot {slot} "
                                     f"outside 0..{self.num_slots - 1}")
            values[i] = (row if src < 0 else base + src, src_pos if src >= 0 else -1,
                         p0 if s0 >= 0 else -1, base + max(s0, 0),
                         p1 if s1 >= 0 else -1, base + max(s1, 0))
        staged.put(self.table, (np.asarray(rows, dtype=np.int64),), values)

    def bind(self, context: ForwardContext, idx_mapping: torch.Tensor, num_reqs: int) -> None:
        """Give the forward context the step's state rows and the table."""
        if self.enabled:  # (padding requests' entries: stale, zero queries)
            context.state_rows = idx_mapping[:num_reqs]
            context.state_table = self.table
            context.state_row_slots = self.row_slots
