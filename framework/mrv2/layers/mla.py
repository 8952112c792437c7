"""Multi-head latent attention (MLA: DeepSeek-V2/V3, GLM-4.7-Flash, any family of that
layout) over a latent KV cache, in the absorbed form.

Per token the layer computes the compressed latent ``c = kv_a_layernorm(x W_DKV)`` (``R =
kv_lora_rank`` values) and one roped key ``k_pe`` (``P = qk_rope_head_dim``) shared by every
head; the cache keeps just those ``R + P`` values per token and layer
(:class:`~mrv2.contract.kv_cache.LatentKVSpec`), against ``2 * H * D`` for multi-head attention.
Head ``h``'s key is ``[c W_UK[h] ; k_pe]`` and its value ``c W_UV[h]`` (``kv_b_proj`` holds
``W_UK`` and ``W_UV``). Attention never decompresses them: the key up-projection folds into
the query (``q_lat[h] = q_nope[h] W_UK[h]^T``, so ``q_lat[h] . c = q_nope[h] . (c W_UK[h])``),
the scores are ``q_lat . c + q_pe . k_pe``, the weighted sum of latents comes out per head and
the value up-projection runs after (``out[h] = o_lat[h] W_UV[h]^T``). One latent row serves
all heads, so the kernel reads each cached token once per head group
(:mod:`mrv2_kernels.mla_attention`, behind the core's ``mla`` attention backend,
:class:`mrv2.attention.mla_backend.MLABackend`).

Tensor parallelism (as vLLM and SGLang split MLA): the heads are split across the ranks, rank
``r`` of ``size`` computing heads ``r * H/size : (r + 1) * H/size`` (``H =
num_attention_heads``, which must divide evenly). ``q_proj`` / ``q_b_proj`` and ``kv_b_proj``
are column-parallel over those heads (their output rows are head-major, so a rank's rows are
whole heads, ``W_UK`` and ``W_UV`` included), ``o_proj`` row-parallel over the heads' values
(the partial outputs are all-reduced). ``q_a_proj`` and ``kv_a_proj_with_mqa`` are replicated:
the query latent, the KV latent ``c`` and ``k_pe`` are shared by every head, so every rank
computes all of them and caches the same ``R + P`` values per token (the cache spec does not
change with the split; each rank holds a full copy).

RoPE: DeepSeek rotates interleaved pairs ``(x0, x1), (x2, x3), ...``. The same scores come from
the core's half-split (neox) rotation if the rope rows of the query and key projections are
permuted (even dimensions first, then odd) at load time: both sides move together, so every
dot product is unchanged, and the rotary kernel stays the shared one (:func:`mla_rope` builds
it from the config; ``interleaved_rope=False`` where a checkpoint already rotates halves).

No RoPE (``rope=None``: Kimi-Linear's MLA layers): the ``qk_rope_head_dim`` parts of the query
and the cached key are used as projected, unrotated.

A family builds its layers from :class:`MLAAttention` (HF's ``self_attn.*`` names) and
:class:`MLADecoderLayer` around its own MLP / MoE; the core registers the backend, so no other
plugin is needed.
"""

from __future__ import annotations

import functools
import math
from typing import Any, cast

import torch
from torch import nn

from mrv2.attention.mla_backend import MLABackend
from mrv2.contract.forward_context import get_forward_context
from mrv2.contract.kv_cache import KVCacheLayer, LatentKVSpec
from mrv2.distributed.parallel_state import tp_size
from mrv2.layers.decoder import norm_mlp
from mrv2.layers.fp8 import FP8, Fp8LinearMixin
from mrv2.layers.int_quant import IntLinearMixin
from mrv2.layers.linear import ColumnLinear, LinearBase, RowLinear, split_evenly
from mrv2.layers.norm import RMSNorm
from mrv2.layers.rotary import (
    RotaryEmbedding,
    context_limit,
    rope_parameters_of,
    rope_rows_to_halves,
)
from mrv2.layers.weights import is_fresh

__all__ = ["LATENT_NORM_EPS", "MLAAttention", "MLABackend", "MLADecoderLayer", "check_mla_config",
           "mla_rope"]

#: The eps of DeepSeek's q_a / kv_a RMSNorms (HF builds them with the default).
LATENT_NORM_EPS = 1e-6


def _row_tensors(layer: LinearBase) -> list[torch.Tensor]:
    """Every tensor indexed by the layer's output rows (this rank's, once loaded) that was
    loaded since the weights were last processed (:func:`~mrv2.layers.weights.is_fresh`:
    a tensor not given again is in the halves order already), 2-D: the weight (an fp8 one
    viewed as bytes), its per-row fp8 scales, the bias."""
    weight = layer.weight.data
    rows = [weight.view(torch.uint8) if weight.dtype == FP8 else weight] if is_fresh(
        layer.weight) else []
    scale = getattr(layer, "weight_scale_inv", None)
    if scale is not None and is_fresh(scale):
        rows.append(scale.data)
    if layer.bias is not None and is_fresh(layer.bias):
        rows.append(layer.bias.data[:, None])
    return rows


def check_mla_config(config: Any, arch: str) -> None:
    """ValueError naming the field where ``config``'s attention is not an MLA layout this module
    runs (before anything is built): the latent and head sizes at least 1, an even rotated
    part, ``q_lora_rank`` None or at least 1; and the MLPs' ``silu``, which every MLA family
    here has."""

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise ValueError(f"{arch}: config.{field} = {getattr(config, field, None)!r}: {what}")

    need(config.hidden_act == "silu", "hidden_act", "the experts and MLPs support 'silu' only")
    for field in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        need(int(getattr(config, field, 0) or 0) >= 1, field, "must be at least 1")
    need(int(config.qk_rope_head_dim) % 2 == 0, "qk_rope_head_dim", "must be even (RoPE pairs)")
    q_lora = getattr(config, "q_lora_rank", None)
    need(q_lora is None or int(q_lora) >= 1, "q_lora_rank", "must be None or at least 1")


def mla_rope(config: Any) -> RotaryEmbedding:
    """RoPE over ``qk_rope_head_dim`` (YaRN per the config), in the half-split layout the
    permuted projections produce; its table reaches the context YaRN derives."""
    base, scaling = rope_parameters_of(config)
    return RotaryEmbedding(int(config.qk_rope_head_dim),
                           max_position=int(config.max_position_embeddings), base=base,
                           scaling=scaling, positions=context_limit(config)[0])


class MLAAttention(KVCacheLayer):
    """Multi-head latent attention (HF's ``self_attn.*`` names): ``q_proj`` (or ``q_a_proj``,
    ``q_a_layernorm``, ``q_b_proj`` with ``q_lora_rank``), ``kv_a_proj_with_mqa``,
    ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; caches ``kv_lora_rank + qk_rope_head_dim``
    values per token in KV cache layer ``layer_idx``. ``rope`` None: no rotation (the module).

    With tensor parallelism (see the module) :attr:`num_heads` is this rank's head count,
    ``num_attention_heads / tensor_parallel_size`` (:attr:`total_num_heads` all of them);
    ``q_a_proj`` and ``kv_a_proj_with_mqa`` are replicated, ``q_proj`` / ``q_b_proj`` and
    ``kv_b_proj`` hold this rank's heads, ``o_proj`` sums the ranks' partial outputs."""

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding | None,
                 interleaved_rope: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        hidden = config.hidden_size
        self.total_num_heads = total = int(config.num_attention_heads)
        # checked here, by heads: the projections' row counts may divide where heads do not
        self.num_heads = split_evenly(total, tp_size(), "num_attention_heads")
        self.nope = int(config.qk_nope_head_dim)
        self.rope_dim = int(config.qk_rope_head_dim)
        self.v_dim = int(config.v_head_dim)
        self.rank = int(config.kv_lora_rank)
        self.qk_dim = self.nope + self.rope_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = config.q_lora_rank
        self.q_proj: ColumnLinear | None = None
        self.q_a_proj: LinearBase | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnLinear | None = None
        # column-parallel by heads (output rows head-major): this rank's h heads
        if self.q_lora_rank is None:
            self.q_proj = ColumnLinear(hidden, total * self.qk_dim)
        else:
            # the query latent feeds every head: replicated
            self.q_a_proj = LinearBase(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = ColumnLinear(self.q_lora_rank, total * self.qk_dim)
        # the KV latent and k_pe are shared by every head (and cached whole): replicated
        self.kv_a_proj_with_mqa = LinearBase(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, eps=LATENT_NORM_EPS)
        self.kv_b_proj = ColumnLinear(self.rank, total * (self.nope + self.v_dim))
        # over this rank's heads' values; the partial outputs are all-reduced
        self.o_proj = RowLinear(total * self.v_dim, hidden, bias=bias)
        self.rotary_emb = rope
        #: (no RoPE: nothing rotates, so no row order to change)
        self.interleaved_rope = interleaved_rope and rope is not None
        if self.interleaved_rope:  # (a LoRA adapter's q rows take the reorder of the weight's)
            q_rows = self.q_proj if self.q_proj is not None else self.q_b_proj
            assert q_rows is not None
            q_rows.row_order = functools.partial(
                rope_rows_to_halves, head_dim=self.qk_dim, rope_dim=self.rope_dim)
        _, scaling = rope_parameters_of(config)
        scale = self.qk_dim**-0.5
        if scaling is not None and scaling.get("mscale_all_dim") and scaling.get("factor"):
            # DeepSeek's YaRN: the softmax scale carries mscale(factor, mscale_all_dim)^2
            factor = float(scaling["factor"])
            if factor > 1:
                mscale = 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0
                scale *= mscale * mscale
        self.scale = scale
        # the up-projections of this rank's heads, from kv_b_proj after loading
        self.w_uk: torch.Tensor | None = None  # [h, nope, R]
        self.w_uv_t: torch.Tensor | None = None  # [h, R, v]

    def kv_cache_spec(self) -> LatentKVSpec:
        """``kv_lora_rank + qk_rope_head_dim`` values per token."""
        return LatentKVSpec(self.rank + self.rope_dim)

    def process_weights_after_loading(self) -> None:
        """Rope rows to the half-split order (interleaved checkpoints; the rows loaded since
        the last call only: a load of other tensors leaves them) and the per-head
        up-projections out of ``kv_b_proj`` (an fp8 one dequantized), for this rank's heads:
        the loaded column-parallel weights and their per-row scales hold only those. Runs
        before the linears' own hooks."""
        with torch.no_grad():
            q = self.q_proj if self.q_proj is not None else self.q_b_proj
            assert q is not None
            kv_b = self.kv_b_proj
            for layer in (q, self.kv_a_proj_with_mqa, kv_b):
                if isinstance(layer, IntLinearMixin):  # (integer weights: the layout's names,
                    layer.order_inputs()  # the input order, before reading them here)
            if self.interleaved_rope:
                for layer, head_dim in ((q, self.qk_dim),
                                        (self.kv_a_proj_with_mqa, self.rank + self.rope_dim)):
                    reorder = functools.partial(rope_rows_to_halves, head_dim=head_dim,
                                                rope_dim=self.rope_dim)
                    if isinstance(layer, IntLinearMixin):
                        layer.reorder_rows(reorder, fresh_only=True)
                    else:
                        for rows in _row_tensors(layer):
                            reorder(rows)
            dtype = self.kv_a_layernorm.weight.dtype
            if isinstance(kv_b, IntLinearMixin):
                weight = kv_b.dequantized(dtype)
            else:
                weight = kv_b.weight.data
                if isinstance(kv_b, Fp8LinearMixin) and weight.dtype == FP8:
                    weight = kv_b.dequantized(dtype)
            w = weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
            w_uk, w_uv_t = w[:, : self.nope, :], w[:, self.nope:, :].transpose(1, 2)
            if self.w_uk is not None and self.w_uv_t is not None:  # (new weights: in place,
                self.w_uk.copy_(w_uk)  # where the captured CUDA graphs read them)
                self.w_uv_t.copy_(w_uv_t)
            else:
                self.w_uk, self.w_uv_t = w_uk.contiguous(), w_uv_t.contiguous()

    def project(self, positions: torch.Tensor, x: torch.Tensor) -> tuple[
            torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The step's projections: ``(q_nope [T, h, nope], q_pe [T, h, P] roped, latent [T, R]
        normed, k_pe [T, P] roped, q_resid)``, ``q_resid`` the normed query latent
        (``q_a_layernorm(q_a_proj(x))``; None without ``q_lora_rank``), which DeepSeek's
        sparse attention indexer reads (:mod:`mrv2.layers.sparse_mla`)."""
        num_tokens, h = x.shape[0], self.num_heads
        q_resid = None
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        q = q.view(num_tokens, h, self.qk_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = q_pe.contiguous(), k_pe.contiguous()
        if self.rotary_emb is not None:  # (None: no RoPE, the parts used as projected)
            q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        return (q_nope, q_pe.reshape(num_tokens, h, self.rope_dim), latent,
                k_pe.reshape(num_tokens, self.rope_dim), q_resid)

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """``q_nope`` ``[T, h, nope]`` times ``W_UK``: the per-head query latents ``[T, h, R]``."""
        assert self.w_uk is not None and self.w_uv_t is not None, "weights not processed"
        return torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1).contiguous()

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The per-head weighted latents ``[T, h, R]`` through ``W_UV`` and ``o_proj``."""
        assert self.w_uv_t is not None, "weights not processed"
        num_tokens = out.shape[0]
        values = torch.bmm(out.transpose(0, 1), self.w_uv_t).transpose(0, 1)
        return cast(torch.Tensor, self.o_proj(
            values.reshape(num_tokens, self.num_heads * self.v_dim)))

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q_nope, q_pe, latent, k_pe, _ = self.project(positions, x)
        ctx = get_forward_context()
        cache = ctx.kv_cache(self.layer_idx)
        backend = cast(MLABackend, ctx.backend(self.layer_idx))
        backend.write(latent, k_pe, cache, ctx.metadata.slot_mapping)
        out = backend.forward(self.absorb(q_nope), q_pe, cache, ctx.metadata, self.scale)
        return self.output(out)


class MLADecoderLayer(nn.Module):
    """A pre-norm decoder layer around :class:`MLAAttention` (HF's ``input_layernorm``,
    ``self_attn``, ``post_attention_layernorm``, ``mlp``), the residual add fused into the
    norms as in :class:`mrv2.layers.DecoderLayer`."""

    def __init__(self, config: Any, self_attn: MLAAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            x = self.input_layernorm(hidden_states)
        else:
            x, residual = self.input_layernorm(hidden_states, residual)
        out = self.self_attn(positions, x)
        return norm_mlp(self.post_attention_layernorm, self.mlp, out, residual)
