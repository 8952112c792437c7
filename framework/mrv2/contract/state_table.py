"""The persistent request-state table: one stable row per live request, on the device.

A request takes a row from the free list when it arrives and keeps it until it finishes
(preemption is a finish, resumption a new request). Each step's tensors are gathered through
``idx_mapping`` (batch position -> row); nothing is expanded per request on the CPU.

Device columns (``R`` rows): ``token_ids [R, max_model_len]`` int32 (prompt, outputs, and past
``num_tokens`` the drafts of speculative decoding), ``num_computed [R]`` (tokens whose KV is in
the cache), ``num_tokens [R]`` (tokens known: prompt + sampled), ``block_table [R, max_blocks]``.
At 256 rows x 4,096 tokens the token table is 4 MiB.

The CPU keeps only counts as a mirror (:class:`RowInfo`); token values live on the device and
are written there by the post-update kernel. Other owners of per-request columns (the sampler's
parameters, a ModelState's extras) keep their own tables indexed by the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class RowInfo:
    """CPU-side counts of one live row (no token values).

    While drafts are being verified both counts are upper bounds: the step counted every
    scheduled draft as computed and its bonus token as known; :meth:`take_back` corrects them
    when the step's accepted count arrives.
    """

    req_id: str
    num_computed: int
    num_known: int
    #: Tokens the request arrived with (its prompt, plus any outputs of a resumed request):
    #: a step computing any of them is a prefill step, never a decode graph's.
    num_prompt: int = 0

    def take_back(self, num_rejected: int) -> None:
        """A step rejected ``num_rejected`` of this request's drafts: lower both counts (an
        info whose row was released since is no longer read, so this is then harmless)."""
        self.num_computed -= num_rejected
        self.num_known -= num_rejected


class RequestStateTable:
    """Device tensors of ``max_num_reqs`` rows plus the CPU mirror of their counts."""

    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, device: torch.device
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_blocks_per_req = max_blocks_per_req
        self.device = device

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.token_ids = zeros(max_num_reqs, max_model_len, dtype=torch.int32)
        self.num_computed = zeros(max_num_reqs, dtype=torch.int32)
        self.num_tokens = zeros(max_num_reqs, dtype=torch.int32)
        self.block_table = zeros(max_num_reqs, max_blocks_per_req, dtype=torch.int32)

        self._free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.rows: dict[str, int] = {}
        self.info: dict[int, RowInfo] = {}
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        #: Every block table, ``block_table`` first; more with sliding-window tables
        #: (:meth:`add_block_tables`). ``table_num_blocks``: the entries of each row in each.
        self.block_tables = [self.block_table]
        self.table_num_blocks = [self.num_blocks]

    def add_block_tables(self, count: int) -> None:
        """``count`` more block tables of the same shape (sliding-window layers' own,
        :mod:`mrv2.runner.kv_tables`)."""
        for _ in range(count):
            self.block_tables.append(torch.zeros_like(self.block_table))
            self.table_num_blocks.append(np.zeros_like(self.num_blocks))

    def __len__(self) -> int:
        return len(self.rows)

    def allocate(self, info: RowInfo) -> int:
        """Take a free row for ``info.req_id``."""
        if info.req_id in self.rows:
            raise ValueError(f"request {info.req_id!r} is already in the state table")
        if not self._free_rows:
            raise RuntimeError(
                f"state table full: {self.max_num_reqs} rows (raise max_num_seqs)"
            )
        row = self._free_rows.pop()
        self.rows[info.req_id] = row
        self.info[row] = info
        for counts in self.table_num_blocks:
            counts[row] = 0
        return row

    def release(self, req_id: str) -> int:
        """Return ``req_id``'s row to the free list; the row's device data is left stale."""
        row = self.rows.pop(req_id)
        self.info.pop(row)
        self._free_rows.append(row)
        return row

    def row_of(self, req_id: str) -> int:
        """The row of a live request; a clear error for an unknown id."""
        try:
            return self.rows[req_id]
        except KeyError:
            raise KeyError(f"request {req_id!r} is not in the state table") from None
