"""``ModelState``: everything model-specific the runner needs, behind one lifecycle.

The runner owns the state table, the persistent buffers and the step; a ``ModelState`` turns a
prepared :class:`InputBatch` into the model's inputs and attention metadata, keeps per-request
extras (multimodal embeddings, M-RoPE positions...) and knows how to capture its forward.
This class is the default for decoder-only text models; a family subclasses it and registers
the subclass with its architecture (``register(arch, model, model_state="pkg.mod:MyState")``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from mrv2.attention.backend import AttentionMetadata
from mrv2.config import EngineConfig
from mrv2.runner.input_batch import InputBatch, InputBuffers
from mrv2.runner.scheduler_output import NewRequest


class ModelState:
    """Default decoder-only ModelState: token ids and positions in, paged attention metadata."""

    def __init__(
        self,
        model: nn.Module,
        hf_config: Any,
        config: EngineConfig,
        buffers: InputBuffers,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.hf_config = hf_config
        self.config = config
        self.buffers = buffers
        self.block_size = block_size
        self.device = device
        self._graph_pool: Any = None

    # -- per request -------------------------------------------------------------------------

    def add_request(self, request: NewRequest, row: int) -> None:
        """A request took ``row``. Text models keep nothing beyond the state table."""

    def remove_request(self, req_id: str, row: int) -> None:
        """A request left ``row``."""

    # -- per step ----------------------------------------------------------------------------

    def get_mm_embeddings(self, batch: InputBatch) -> torch.Tensor | None:
        """Multimodal embeddings for the step; text models have none."""
        return None

    def prepare_inputs(self, batch: InputBatch) -> dict[str, Any]:
        """``model.forward`` keyword arguments: token ids and positions of the padded step."""
        return {"input_ids": batch.input_ids, "positions": batch.positions}

    def prepare_attn(self, batch: InputBatch) -> AttentionMetadata:
        """Paged-attention metadata over the batch's device tensors (no host reads)."""
        return AttentionMetadata(
            num_reqs=batch.num_reqs_padded,
            num_tokens=batch.num_tokens_padded,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            block_table=batch.block_table,
            slot_mapping=batch.slot_mapping,
            block_size=self.block_size,
            uniform_decode=batch.uniform_decode,
        )

    # -- start-up ----------------------------------------------------------------------------

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> InputBatch:
        """A harmless batch over the persistent buffers: ``num_tokens`` split over requests.

        Its tokens write no KV (slot -1) and read block 0 only (positions, which feed only the
        rotary embedding, stay below one block); used for the profiling forward
        and for CUDA-graph capture.
        """
        buffers = self.buffers
        if not 1 <= num_reqs <= min(num_tokens, buffers.max_num_reqs):
            raise ValueError(f"dummy batch of {num_reqs} requests and {num_tokens} tokens")
        lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
        lens[: num_tokens % num_reqs] += 1
        starts = np.concatenate([[0], np.cumsum(lens)])
        positions = np.concatenate([np.arange(n) for n in lens])
        positions = np.minimum(positions, self.block_size - 1)
        buffers.input_ids[:num_tokens].fill_(1)
        buffers.positions[:num_tokens].copy_(torch.from_numpy(positions))
        buffers.slot_mapping[:num_tokens].fill_(-1)
        buffers.idx_mapping[:num_reqs].zero_()
        buffers.query_start_loc[: num_reqs + 1].copy_(torch.from_numpy(starts))
        seq_lens = lens.astype(np.int32)
        buffers.seq_lens[:num_reqs].copy_(torch.from_numpy(seq_lens))
        buffers.block_table[:num_reqs].zero_()
        buffers.logits_indices[:num_reqs].copy_(torch.from_numpy(starts[1:] - 1))
        return InputBatch(
            req_ids=[f"dummy-{i}" for i in range(num_reqs)],
            num_reqs=num_reqs,
            num_reqs_padded=num_reqs,
            num_tokens=num_tokens,
            num_tokens_padded=num_tokens,
            max_query_len=int(lens.max()),
            max_seq_len=int(seq_lens.max()),
            uniform_decode=bool((lens == 1).all()),
            do_sample=np.ones(num_reqs, dtype=bool),
            idx_mapping=buffers.idx_mapping[:num_reqs],
            query_start_loc=buffers.query_start_loc[: num_reqs + 1],
            input_ids=buffers.input_ids[:num_tokens],
            positions=buffers.positions[:num_tokens],
            slot_mapping=buffers.slot_mapping[:num_tokens],
            seq_lens=buffers.seq_lens[:num_reqs],
            block_table=buffers.block_table[:num_reqs],
            logits_indices=buffers.logits_indices[:num_reqs],
        )

    def capture_cuda_graph(
        self, batch: InputBatch, forward: Callable[[], torch.Tensor]
    ) -> torch.cuda.CUDAGraph | None:
        """Capture ``forward`` (which reads only persistent buffers) into a CUDA graph.

        All graphs of this state share one memory pool: only one replays at a time.
        """
        if self.device.type != "cuda":
            return None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            forward()
        self._graph_pool = graph.pool()
        return graph
