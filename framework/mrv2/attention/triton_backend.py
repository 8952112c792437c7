"""The Triton attention backend: paged attention and KV writes through ``mrv2_kernels``.

Small-query steps (decode: ``max_query_len * gqa_group <= 16``, or ``metadata.uniform_decode``
where the runner sets it) take the split-KV path; everything else the packed-GQA prefill path.
No host syncs: only the CPU-known bounds of the metadata size the grids.
"""

from __future__ import annotations

import torch

from mrv2.contract.attention import AttentionMetadata, PagedAttentionBackend
from mrv2_kernels.kv_cache import write_kv_triton
from mrv2_kernels.paged_attention import paged_attention


class TritonAttentionBackend(PagedAttentionBackend):
    """Paged attention (prefill + decode, GQA, any block size) written in Triton."""

    name = "triton"
    kv_write_in_rope = True

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
    ) -> torch.Tensor:
        return paged_attention(
            query,
            kv_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_table,
            scale,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            num_reqs=metadata.num_reqs,
            uniform_decode=metadata.uniform_decode,
        )
