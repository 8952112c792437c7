"""The Triton attention backend: paged attention and KV writes through ``mrv2_kernels``.

Small-query steps (decode: ``max_query_len * gqa_group <= 16``, or ``metadata.uniform_decode``
where the runner sets it) take the split-KV path; everything else the packed-GQA prefill path.
No host syncs: only the CPU-known bounds of the metadata size the grids.
"""

from __future__ import annotations

import os

import torch

from mrv2.contract.attention import AttentionMetadata, PagedAttentionBackend, RopeInputs
from mrv2_kernels.kv_cache import write_kv_triton
from mrv2_kernels.paged_attention import FusedRope, paged_attention

#: ``0`` turns off RoPE inside decode attention (then a RoPE kernel runs first, as for prefill).
ROPE_IN_ATTENTION_ENV_VAR = "MRV2_ROPE_IN_ATTENTION"


class TritonAttentionBackend(PagedAttentionBackend):
    """Paged attention (prefill + decode, GQA, any block size) written in Triton."""

    name = "triton"
    fp8_kv_cache = True
    kv_write_in_rope = True
    sliding_window = True
    logit_softcap = True
    attention_sinks = True
    attention_chunk = True

    def __init__(self) -> None:
        # Split decode steps (decode and spec decode at small batches) rotate the query and
        # store the step's K/V inside the attention kernel: at batch 1 the RoPE kernel is one
        # of five launches per layer (BENCHMARKS.md 2026-12-01, seventh session). Other
        # steps run the RoPE kernel first.
        self.rope_in_attention = os.environ.get(ROPE_IN_ATTENTION_ENV_VAR, "1") != "0"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv_triton(key, value, kv_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        attention_chunk: int | None = None,
    ) -> torch.Tensor:
        return self._attend(query, kv_cache, metadata, scale, None, sliding_window,
                            logit_softcap, sinks, attention_chunk)

    def forward_rope(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        rope: RopeInputs,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        attention_chunk: int | None = None,
    ) -> torch.Tensor:
        fused = FusedRope(rope.positions, rope.cos_sin, key, value, metadata.slot_mapping,
                          rope.qk_norm)
        return self._attend(query, kv_cache, metadata, scale, fused, sliding_window,
                            logit_softcap, sinks, attention_chunk)

    @staticmethod
    def _attend(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                scale: float, rope: FusedRope | None, window: int | None,
                softcap: float | None = None, sinks: torch.Tensor | None = None,
                chunk: int | None = None) -> torch.Tensor:
        return paged_attention(
            query, kv_cache, metadata.query_start_loc, metadata.seq_lens, metadata.block_table,
            scale, max_query_len=metadata.max_query_len, max_seq_len=metadata.max_seq_len,
            num_reqs=metadata.num_reqs, uniform_decode=metadata.uniform_decode, rope=rope,
            sliding_window=window, logit_softcap=softcap, sinks=sinks, attention_chunk=chunk,
        )
