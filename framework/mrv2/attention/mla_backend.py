"""The ``mla`` attention backend: multi-head latent attention over a ``"latent"`` KV cache
(:class:`~mrv2.contract.kv_cache.LatentKVSpec`), in the absorbed form.

The layer (:class:`mrv2.layers.mla.MLAAttention`) folds the key up-projection into the query and
hands this backend the per-head query latents and roped query parts; the backend writes the
step's latents and roped keys into the cache and returns the per-head weighted latents, the
value up-projection running after it in the layer. Triton kernels on CUDA, their torch
references on the CPU (the dispatch of :mod:`mrv2_kernels.mla_attention`). The core registers
it (:mod:`mrv2.defaults`) for every family whose layers cache latents.
"""

from __future__ import annotations

import torch

from mrv2.contract.attention import AttentionBackend, AttentionMetadata
from mrv2_kernels.mla_attention import flat_grid_enabled, mla_cache_write, mla_decode_attention


class MLABackend(AttentionBackend):
    """Attention over a ``"latent"`` cache ``[num_blocks, block_size, R + P]`` in the absorbed
    form: Triton kernels on CUDA, their torch references on the CPU (the dispatch of
    :mod:`mrv2_kernels.mla_attention`)."""

    name = "mla"

    def __init__(self) -> None:
        # Steps with prompt tokens replay the runner's mixed graphs only with the kernel's flat
        # grid (the default; MRV2_MLA_FLAT_GRID=0 turns it off): the (query tile, request)
        # grid would launch a program per tile of the graph's baked max_query_len (its padded
        # token count) and request, nearly all exiting at once.
        self.mixed_step_graphs = flat_grid_enabled()

    def write(self, latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Store ``latent`` ``[T, R]`` and ``k_pe`` ``[T, P]`` at the ``slot_mapping`` slots
        (negative: not written)."""
        mla_cache_write(latent, k_pe, cache, slot_mapping)

    def forward(self, q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        """Causal attention of ``q_latent`` ``[T, H, R]`` / ``q_pe`` ``[T, H, P]`` over the
        cache; returns the per-head weighted latents ``[T, H, R]``."""
        out = torch.empty_like(q_latent)
        mla_decode_attention(
            q_latent, q_pe, cache, metadata.block_table, metadata.seq_lens,
            metadata.query_start_loc, metadata.max_query_len, scale, out,
            num_reqs=metadata.num_reqs, max_seq_len=metadata.max_seq_len,
        )
        return out
