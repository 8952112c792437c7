"""Persistent per-step input buffers, and the view of them one step uses.

The buffers are allocated once at their maximum size and rewritten in place every step by the
prep kernels, so a captured CUDA graph that reads them replays correctly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class InputBuffers:
    """Device buffers sized for the largest step: ``max_num_tokens`` and ``max_num_reqs``.

    ``idx_mapping``, ``query_start_loc``, ``logits_indices`` and ``logits_idx_mapping`` hold
    the step's *layout*, which the batch builder writes only when it changes (a run of decode
    steps keeps it): after start-up nothing else may write them.
    """

    def __init__(
        self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_req: int,
        device: torch.device,
    ) -> None:
        self.max_num_tokens = max_num_tokens
        self.max_num_reqs = max_num_reqs

        def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = empty(max_num_tokens, dtype=torch.int32)
        self.positions = empty(max_num_tokens, dtype=torch.int64)
        self.slot_mapping = empty(max_num_tokens, dtype=torch.int64)
        self.idx_mapping = empty(max_num_reqs, dtype=torch.int32)
        self.query_start_loc = empty(max_num_reqs + 1, dtype=torch.int32)
        self.seq_lens = empty(max_num_reqs, dtype=torch.int32)
        self.block_table = empty(max_num_reqs, max_blocks_per_req, dtype=torch.int32)
        # Logits rows: at most one per token (decode with drafts samples every token).
        self.logits_indices = empty(max_num_tokens, dtype=torch.int64)
        self.logits_idx_mapping = empty(max_num_tokens, dtype=torch.int32)
        self.logits_positions = empty(max_num_tokens, dtype=torch.int64)
        #: Every block table's step view and slot mapping, ``block_table`` / ``slot_mapping``
        #: first; more with sliding-window tables (:meth:`add_block_tables`).
        self.block_tables = [self.block_table]
        self.slot_mappings = [self.slot_mapping]

    def add_block_tables(self, count: int) -> None:
        """Buffers for ``count`` more block tables (sliding-window layers' own)."""
        for _ in range(count):
            self.block_tables.append(torch.zeros_like(self.block_table))
            self.slot_mappings.append(torch.zeros_like(self.slot_mapping))


@dataclass
class InputBatch:
    """One step's inputs: CPU-known sizes plus views of the persistent device buffers.

    Rows ``num_reqs:num_reqs_padded`` and tokens ``num_tokens:num_tokens_padded`` are padding
    (zero-length requests, slot -1 tokens) added so a CUDA graph of the padded size can replay.

    Logits rows: each request contributes its last ``1 + num_draft_tokens[i]`` tokens (one for a
    request without drafts), in batch order; ``cu_num_logits`` says which rows are whose. The
    sampler draws one token per logits row.
    """

    req_ids: list[str]
    num_reqs: int
    num_reqs_padded: int
    num_tokens: int
    num_tokens_padded: int
    max_query_len: int
    max_seq_len: int
    """Upper bound of any request's sequence length after this step (CPU-known)."""
    uniform_decode: bool
    """Every request has the same query length ``1 + k`` and no prompt tokens (graphs replay)."""
    do_sample: np.ndarray
    """``[num_reqs]`` bool, CPU: which requests produce tokens this step."""
    idx_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    logits_indices: torch.Tensor
    """``[num_logits]`` int64: rows of the step's hidden states whose logits are sampled."""
    idx_mapping_cpu: np.ndarray
    """``[num_reqs]`` int32, CPU copy of ``idx_mapping``."""
    query_start_loc_cpu: np.ndarray
    """``[num_reqs + 1]`` int32, CPU copy of ``query_start_loc``."""
    num_computed_cpu: np.ndarray
    """``[num_reqs]`` int32: position of each request's first scheduled token (exact for prompt
    tokens; an upper bound for decode tokens while drafts are being verified)."""
    num_draft_tokens: np.ndarray
    """``[num_reqs]`` int32: how many of a request's scheduled tokens are drafts (the last)."""
    cu_num_logits: np.ndarray
    """``[num_reqs + 1]`` int32, CPU: request ``i`` owns logits rows
    ``cu_num_logits[i]:cu_num_logits[i + 1]``."""
    logits_idx_mapping: torch.Tensor
    """``[num_logits]`` int32: state-table row of each logits row."""
    logits_positions: torch.Tensor
    """``[num_logits]`` int64: position of the token each logits row predicts (the sampler's
    noise key: the same position gives the same draw with or without speculation)."""
    cu_num_logits_dev: torch.Tensor | None = None
    """``cu_num_logits`` on the device (steps with drafts only)."""
    token_bitmasks: dict[str, np.ndarray] = field(default_factory=dict)
    """``SchedulerOutput.token_bitmasks``: structured outputs' allowed tokens, by request, one
    row a logits row of it."""
    table_inputs: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    """``(block_table, slot_mapping)`` of each block table after the first (sliding-window
    layers' own, :mod:`mrv2.runner.kv_tables`), shaped as ``block_table`` and
    ``slot_mapping``."""

    @property
    def num_logits(self) -> int:
        """Logits rows of the step."""
        return int(self.cu_num_logits[self.num_reqs])

    @property
    def max_draft_tokens(self) -> int:
        """The most drafts any request verifies this step (0: no speculation in the step)."""
        return int(self.num_draft_tokens.max()) if self.num_reqs else 0

    def logits_row_offsets(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(request, offset)`` of each of the first ``n`` logits rows, on the device: the
        batch position of the row's request and the row's place among that request's rows
        (its drafts before it). Steps with drafts only (``cu_num_logits_dev``)."""
        assert self.cu_num_logits_dev is not None
        rows = torch.arange(n, device=self.cu_num_logits_dev.device)
        starts = self.cu_num_logits_dev[: self.num_reqs + 1].long()
        request = torch.searchsorted(starts[1:], rows, right=True).clamp(max=self.num_reqs - 1)
        return request, rows - starts[request]


def last_token_indices(query_start_loc: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Flat token indices of each request's last ``counts[i]`` tokens, in batch order (its
    logits rows): ``query_start_loc`` is the requests' ``[B + 1]`` exclusive prefix sum."""
    ends = np.repeat(query_start_loc[1:], counts)
    within = np.arange(len(ends)) - np.repeat(np.cumsum(counts) - counts, counts)
    return (ends - np.repeat(counts, counts) + within).astype(np.int64)
