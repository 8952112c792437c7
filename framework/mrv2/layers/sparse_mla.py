"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5): multi-head latent attention
(:mod:`mrv2.layers.mla`) over the ``index_topk`` cached tokens a *lightning indexer* picks
for each query, instead of over all of them.

The indexer (:class:`DSAIndexer`, HF's ``self_attn.indexer.*``) has projections of its own:
``index_n_heads`` query heads of ``index_head_dim`` from the attention's normed query latent
(``wq_b``), one key per token from the layer's input (``wk``, then the LayerNorm ``k_norm``),
RoPE over the first ``qk_rope_head_dim`` dims of both (half-split in DeepSeek-V3.2,
interleaved pairs in GLM-5), and per-head weights ``weights_proj(x) / sqrt(index_n_heads)``.
Token ``t``'s score of key ``s`` is ``sum_h w[t, h] * relu(q[t, h] . k[s] / sqrt(D))`` over
the keys of its request up to its own position; the ``index_topk`` best are attended
(every one while the context is no longer than that, which is plain causal MLA).

Cache: the indexer keys are cached per token, like the latents: the indexer is a
:class:`~mrv2.contract.kv_cache.KVCacheLayer` of its own (a
:class:`~mrv2.contract.kv_cache.LatentKVSpec` of ``index_head_dim`` values, its ``layer_idx``
after the attention layers'), in the same block pool and addressed by the same block table,
so decode steps and later prefill chunks read earlier keys from it (vLLM's
``DeepseekV32IndexerCache`` is the same idea, stored as fp8 there), and a prefix-cache hit
reuses a block's indexer keys with its latents.

Per step: the indexer writes its keys, scores every query against its request's cached keys
(:func:`mrv2_kernels.sparse_mla.indexer_logits`, ``[T, max_seq_len]``, in chunks of query
rows) and picks each row's best as flat cache slots through the block table
(:func:`mrv2_kernels.indexer_topk.indexer_topk_slots`, a radix select a program per row,
reading only the positions up to each token's own, for rows up to
:data:`BOUNDED_TOPK_MAX_SPAN` wide; ``torch.topk`` over the full width past that, where one
program a row is slower, after filling the columns past each token with ``-inf``); the
score kernel computes only up to each token's own position, so under CUDA graphs, whose
``max_seq_len`` is ``max_model_len``, it costs what the real contexts cost;
:func:`mrv2_kernels.sparse_mla.sparse_mla_attention` attends over those slots. GLM-5's
``"shared"`` layers (``indexer_types``) have no indexer and reuse the last full layer's slots
of the same step (kept in the step metadata's ``derived`` scratch).

Tensor parallelism: the indexer is replicated (every rank computes the same selection); the
attention heads split as MLA's do.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from mrv2.attention.mla_backend import MLABackend
from mrv2.contract.attention import AttentionMetadata
from mrv2.contract.forward_context import get_forward_context
from mrv2.contract.kv_cache import KVCacheLayer, LatentKVSpec
from mrv2.layers.linear import LinearBase
from mrv2.layers.mla import MLAAttention
from mrv2.layers.mtp import mtp_layer_count
from mrv2.layers.norm import LayerNorm
from mrv2.layers.rotary import RotaryEmbedding
from mrv2_kernels.indexer_topk import indexer_topk_slots, indexer_topk_slots_full_width
from mrv2_kernels.mla_attention import mla_cache_write
from mrv2_kernels.sparse_mla import indexer_logits, sparse_mla_attention

__all__ = ["DSAIndexer", "SparseMLAAttention", "check_dsa_config", "indexer_cache_layers",
           "mtp_indexer_cache_layer", "sparse_mla_attention_layer", "token_maps"]

#: ``metadata.derived`` keys: the step's token maps, the last full indexer's slots.
_MAPS_KEY = "dsa_token_maps"
_SLOTS_KEY = "dsa_topk_slots"
#: fp32 indexer scores one chunk of query rows may hold (256 MiB).
_LOGITS_BUDGET = 1 << 26
#: The widest score rows (``metadata.max_seq_len``: the step's longest context, or
#: ``max_model_len`` under CUDA graphs) whose top-k the per-row bounded kernel takes; wider
#: ones go to ``torch.topk`` over the full width. On an H100 the bounded kernel was 3.7-5.7x
#: faster at 2,048 positions of 163,840, even at 32,768 and 0.27-0.69x at 131,072 (one
#: program a row; ``mrv2_kernels.bench_dsa_indexer``, BENCHMARKS.md 2026-12-07).
#: ``MRV2_DSA_BOUNDED_TOPK=1`` takes it at every width (to measure it).
BOUNDED_TOPK_MAX_SPAN = 16384
#: HF's eps of the indexer's ``k_norm``.
INDEXER_NORM_EPS = 1e-6


def check_dsa_config(config: Any, arch: str) -> None:
    """ValueError naming the field where ``config``'s sparse attention is not one this module
    runs: ``q_lora_rank`` set (the indexer's queries come from the query latent), the
    indexer's sizes at least 1, a rotated part narrower than its head."""

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise ValueError(f"{arch}: config.{field} = {getattr(config, field, None)!r}: {what}")

    need(getattr(config, "q_lora_rank", None) is not None, "q_lora_rank",
         "sparse attention's indexer reads the query latent: q_lora_rank must be set")
    for field in ("index_topk", "index_n_heads", "index_head_dim"):
        need(int(getattr(config, field, 0) or 0) >= 1, field, "must be at least 1")
    need(int(config.index_head_dim) > int(config.qk_rope_head_dim), "index_head_dim",
         f"must be more than qk_rope_head_dim ({config.qk_rope_head_dim})")


def token_maps(metadata: AttentionMetadata, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query row's request (``-1``: padding) and absolute position (``seq_len - q_len +
    i``, what the causal rule of the attention kernels uses), int32 ``[num_tokens]``, from
    device tensors only; built once a step (``metadata.derived``)."""
    cached = metadata.derived.get(_MAPS_KEY)
    if cached is not None and cached[0].shape[0] == num_tokens:
        return cached[0], cached[1]
    num_reqs = metadata.num_reqs
    device = metadata.query_start_loc.device
    t = torch.arange(num_tokens, device=device)
    if num_reqs == 0:
        none = torch.full((num_tokens,), -1, dtype=torch.int32, device=device)
        return none, none
    qsl = metadata.query_start_loc[: num_reqs + 1].long()
    req = torch.searchsorted(qsl[1:].contiguous(), t, right=True)
    real = req < num_reqs
    req = req.clamp(max=num_reqs - 1)
    pos = metadata.seq_lens[req].long() - (qsl[req + 1] - qsl[req]) + (t - qsl[req])
    maps = (torch.where(real, req, -1).to(torch.int32), torch.where(real, pos, -1).to(torch.int32))
    metadata.derived[_MAPS_KEY] = maps
    return maps


def _to_halves(x: torch.Tensor) -> torch.Tensor:
    """Interleaved rope pairs ``(x0, x1), (x2, x3), ...`` to halves (even dims, then odd): the
    half-split rotation of the result is the pair rotation, permuted; q and k permuted alike
    keep every score."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class DSAIndexer(KVCacheLayer):
    """The lightning indexer of one DSA layer (HF's ``indexer.wq_b``, ``wk``, ``k_norm``,
    ``weights_proj``); caches ``index_head_dim`` values per token in KV cache layer
    ``layer_idx``. Calling it writes the step's keys and returns each query row's selected
    flat cache slots ``[T, min(index_topk, max_seq_len)]`` int64, ``-1`` where it has fewer
    visible keys. Replicated under tensor parallelism."""

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding,
                 interleaved_rope: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.heads = int(config.index_n_heads)
        self.dim = int(config.index_head_dim)
        self.rope_dim = int(config.qk_rope_head_dim)
        self.index_topk = int(config.index_topk)
        hidden = int(config.hidden_size)
        self.wq_b = LinearBase(int(config.q_lora_rank), self.heads * self.dim, bias=False)
        self.wk = LinearBase(hidden, self.dim, bias=False)
        self.k_norm = LayerNorm(self.dim, eps=INDEXER_NORM_EPS)
        self.weights_proj = LinearBase(hidden, self.heads, bias=False)
        self.rotary_emb = rope
        self.interleaved_rope = interleaved_rope
        self.scale = self.dim**-0.5

    def kv_cache_spec(self) -> LatentKVSpec:
        """``index_head_dim`` values (the roped key) per token."""
        return LatentKVSpec(self.dim)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """``weights_proj(x) / sqrt(index_n_heads)`` in fp32 (HF keeps the projection in
        fp32; a plain weight is multiplied in fp32 here too)."""
        proj = self.weights_proj
        if type(proj) is LinearBase and proj.weight.dtype.is_floating_point:
            w = torch.nn.functional.linear(x.float(), proj.weight.float())
        else:
            w = proj(x).float()
        return w * self.heads**-0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                q_resid: torch.Tensor) -> torch.Tensor:
        num_tokens, p = x.shape[0], self.rope_dim
        q = self.wq_b(q_resid).view(num_tokens, self.heads, self.dim)
        k = self.k_norm(self.wk(x))
        q_rot, q_pass = q.split([p, self.dim - p], dim=-1)
        k_rot, k_pass = k.split([p, self.dim - p], dim=-1)
        if self.interleaved_rope:
            q_rot, k_rot = _to_halves(q_rot), _to_halves(k_rot)
        q_rot, k_rot = self.rotary_emb(positions, q_rot.contiguous(), k_rot.contiguous())
        q = torch.cat([q_rot.reshape(num_tokens, self.heads, p), q_pass], dim=-1)
        ctx = get_forward_context()
        metadata = ctx.metadata_of(self.layer_idx)
        cache = ctx.kv_cache(self.layer_idx)
        mla_cache_write(k_rot.reshape(num_tokens, p), k_pass.contiguous(), cache,
                        metadata.slot_mapping)
        weights = self.head_weights(x)
        token_req, token_pos = token_maps(metadata, num_tokens)
        span = max(1, int(metadata.max_seq_len))
        top = min(self.index_topk, span)
        slots = torch.empty(num_tokens, top, dtype=torch.int64, device=x.device)
        rows = max(1, _LOGITS_BUDGET // span)
        bounded = span <= BOUNDED_TOPK_MAX_SPAN or os.environ.get(
            "MRV2_DSA_BOUNDED_TOPK") == "1"
        select = indexer_topk_slots if bounded else indexer_topk_slots_full_width
        for t0 in range(0, num_tokens, rows):
            t1 = min(num_tokens, t0 + rows)
            logits = torch.empty(t1 - t0, span, dtype=torch.float32, device=x.device)
            indexer_logits(q[t0:t1], weights[t0:t1], cache, metadata.block_table,
                           token_req[t0:t1], token_pos[t0:t1], self.scale, logits)
            select(logits, token_req[t0:t1], token_pos[t0:t1], metadata.block_table,
                   cache.shape[1], slots[t0:t1])
        return slots


class SparseMLAAttention(MLAAttention):
    """:class:`~mrv2.layers.mla.MLAAttention` over the cached tokens its indexer selects
    (HF's ``self_attn.*`` names, ``self_attn.indexer.*`` for the indexer). ``indexer`` None:
    a GLM-5 ``"shared"`` layer, which attends over the selection of the last layer of this
    step that has one."""

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding,
                 interleaved_rope: bool, indexer: DSAIndexer | None) -> None:
        super().__init__(config, layer_idx, rope, interleaved_rope)
        self.indexer = indexer

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q_nope, q_pe, latent, k_pe, q_resid = self.project(positions, x)
        ctx = get_forward_context()
        metadata = ctx.metadata_of(self.layer_idx)
        cache = ctx.kv_cache(self.layer_idx)
        backend = ctx.backend(self.layer_idx)
        assert isinstance(backend, MLABackend), "sparse MLA runs on the core's latent cache"
        backend.write(latent, k_pe, cache, metadata.slot_mapping)
        if self.indexer is not None:
            assert q_resid is not None
            slots = self.indexer(positions, x, q_resid)
            metadata.derived[_SLOTS_KEY] = slots
        else:
            slots = metadata.derived.get(_SLOTS_KEY)
            if slots is None:
                raise RuntimeError(f"sparse attention layer {self.layer_idx} shares the top-k "
                                   "of an earlier layer, but none ran an indexer this step")
        q_latent = self.absorb(q_nope)
        out = torch.empty_like(q_latent)
        sparse_mla_attention(q_latent, q_pe.contiguous(), cache, slots, self.scale, out)
        return self.output(out)


def indexer_cache_layers(config: Any, types: list[str] | None = None) -> list[int | None]:
    """Each main layer's indexer KV cache layer: ``num_hidden_layers + j`` for the ``j``-th
    layer that runs an indexer, None for a layer that reuses an earlier one's selection.
    ``types`` per layer: ``"full"`` (an indexer) or ``"shared"`` (GLM-5's
    ``indexer_types``); None: every layer ``"full"`` (DeepSeek-V3.2). ValueError unless it
    gives every layer one of the two, the first ``"full"``."""
    count = int(config.num_hidden_layers)
    types = ["full"] * count if types is None else [str(t) for t in types]
    if len(types) != count or not set(types) <= {"full", "shared"} or types[0] != "full":
        raise ValueError(f"config.indexer_types = {types!r}: must give each of the {count} "
                         "layers 'full' or 'shared', the first 'full'")
    indices: list[int | None] = []
    for kind in types:
        indices.append(count + sum(i is not None for i in indices) if kind == "full" else None)
    return indices


def mtp_indexer_cache_layer(config: Any, cache_idx: int) -> int:
    """The indexer KV cache layer of the MTP layer whose attention caches in layer
    ``cache_idx``: ``cache_idx + num_nextn_predict_layers``, i.e. after every MTP layer's
    attention (MTP layer ``i`` of a drafter caching from ``first_layer_idx`` keeps its latents
    in ``first_layer_idx + i`` and its indexer keys in ``first_layer_idx + count + i``, so the
    drafter's cache layers stay contiguous). An MTP layer always runs an indexer of its own
    (as vLLM runs DeepSeek-V3.2's and GLM-5's), whatever the main layers share."""
    return cache_idx + mtp_layer_count(config)


def sparse_mla_attention_layer(config: Any, layer_idx: int, rope: RotaryEmbedding,
                               indexer_idx: int | None, indexer_interleaved: bool
                               ) -> SparseMLAAttention:
    """Layer ``layer_idx``'s DSA attention (KV cache layer ``layer_idx``; MLA's rope in
    interleaved pairs, as both DSA families rotate it), with an indexer caching in layer
    ``indexer_idx`` (None: a shared layer), its rope interleaved per
    ``indexer_interleaved``."""
    indexer = None if indexer_idx is None else DSAIndexer(config, indexer_idx, rope,
                                                         indexer_interleaved)
    return SparseMLAAttention(config, layer_idx, rope, True, indexer)
