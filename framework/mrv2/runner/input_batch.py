"""Persistent per-step input buffers, and the view of them one step uses.

The buffers are allocated once at their maximum size and rewritten in place every step by the
prep kernels, so a captured CUDA graph that reads them replays correctly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class InputBuffers:
    """Device buffers sized for the largest step: ``max_num_tokens`` and ``max_num_reqs``."""

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
        self.logits_indices = empty(max_num_reqs, dtype=torch.int64)


@dataclass
class InputBatch:
    """One step's inputs: CPU-known sizes plus views of the persistent device buffers.

    Rows ``num_reqs:num_reqs_padded`` and tokens ``num_tokens:num_tokens_padded`` are padding
    (zero-length requests, slot -1 tokens) added so a CUDA graph of the padded size can replay.
    """

    req_ids: list[str]
    num_reqs: int
    num_reqs_padded: int
    num_tokens: int
    num_tokens_padded: int
    max_query_len: int
    max_seq_len: int
    uniform_decode: bool
    do_sample: np.ndarray
    """``[num_reqs]`` bool, CPU: which requests sample a token this step."""
    idx_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    logits_indices: torch.Tensor
    """``[num_reqs]`` int64, row of each request's last token in the step's hidden states."""
    all_greedy: bool = True
    """CPU flags of the batch's sampling params: which sampler stages can be skipped."""
    any_min_p: bool = False
    any_top_k_top_p: bool = False
    idx_mapping_cpu: np.ndarray | None = None
    """``[num_reqs]`` int32, CPU copy of ``idx_mapping`` (for the sampler's rare stages)."""
