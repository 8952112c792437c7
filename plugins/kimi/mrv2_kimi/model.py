"""Kimi-Linear (``KimiLinearForCausalLM``, moonshotai/Kimi-Linear-48B-A3B): Kimi Delta Attention
(KDA) layers interleaved with multi-head latent attention (MLA) layers without RoPE, and a
DeepSeek-V3-style MoE, as transformers models it.

``config.layer_types`` names each layer's token mixer (HF reads it from the checkpoint's
``linear_attn_config``: ``kda_layers`` / ``full_attn_layers``, 1-based):

* ``"linear_attention"``: KDA (:class:`KimiDeltaAttention`, HF's ``KimiLinearDeltaAttention``):
  ``q_proj``, ``k_proj``, ``v_proj`` (``linear_num_heads`` heads of ``linear_head_dim``, fused
  here into one ``[q | k | v]`` projection) through causal depthwise convolutions of width
  ``linear_conv_kernel_dim`` (``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, no bias) with SiLU;
  then the gated delta rule with a decay **per key channel**: ``g = -exp(A_log[h]) *
  softplus(f_b_proj(f_a_proj(x)) + dt_bias)`` (``[T, H, K]``, HF's ``KimiLinearForgetGate``),
  ``beta = sigmoid(b_proj(x))``, q/k L2-normed, scale ``K ** -0.5``: ``S = diag(exp(g)) S``,
  ``S += k (beta (v - S^T k))^T``, ``o = S^T q``
  (:func:`mrv2_kernels.linear_attention.gated_delta_rule` with a ``[T, H, K]`` gate, the
  decays made inside the kernel from the raw projection). The output is RMS-normed per head
  (``o_norm``, fp32) and gated by ``sigmoid(g_b_proj(g_a_proj(x)))``, then ``o_proj``. Per
  request the layer keeps the convolutions' last inputs and the recurrent state
  (:mod:`mrv2.contract.request_state`), so prefix caching keeps snapshots of it and
  speculative decoding keeps it after each token of a verify step, as for Qwen3-Next.
  Prompts past the delta rule's threshold run its chunked form
  (:func:`mrv2_kernels.chunk_delta_rule.gated_delta_rule_auto`; the per-channel kernels:
  :mod:`mrv2_kernels.chunk_kda_kernels`), decodes the token-serial kernel.
* ``"full_attention"``: the core's MLA (:mod:`mrv2.layers.mla`) with no rotation at all (HF's
  ``KimiLinearAttention``: the ``qk_rope_head_dim`` part of the query and of the shared key is
  used as projected), softmax scale ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``.

The MLP is ``mlp_layer_types[i]``: ``"dense"``, a SwiGLU of ``intermediate_size``; ``"sparse"``,
``num_experts`` routed experts of ``moe_intermediate_size`` (sigmoid scores with a correction
bias, group-limited top-k over ``num_expert_group`` / ``topk_group``, renormalized per
``moe_renormalize``, times ``routed_scaling_factor``) plus ``num_shared_experts`` shared ones
(``block_sparse_moe.*`` with ``experts.{e}.w1/w2/w3`` in the checkpoints).

Tensor parallelism splits KDA by heads: ``q/k/v_proj``, ``f_b_proj``, ``b_proj``, ``g_b_proj``
column-parallel (whole heads), the convolutions' channels, ``A_log`` and ``dt_bias`` sliced
alike, ``f_a_proj`` and ``g_a_proj`` (the low-rank inputs every head reads) replicated,
``o_proj`` row-parallel; MLA and the MoE split as the core's layers do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from mrv2.contract.request_state import RequestStateLayer, StateShapes
from mrv2.layers import CausalLM, DecoderModel, FusedMoE, GatedMLP, GroupedTopKRouter, MoEBlock
from mrv2.layers.linear import (
    ColumnLinear,
    LinearBase,
    MergedColumnLinear,
    RowLinear,
    resolve_tp,
    split_evenly,
)
from mrv2.layers.mla import MLAAttention, MLADecoderLayer, check_mla_config
from mrv2.layers.weights import StackedMapping
from mrv2_kernels.chunk_delta_rule import gated_delta_rule_auto
from mrv2_kernels.linear_attention import causal_conv1d

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["KimiDeltaAttention", "KimiLinearForCausalLM", "layer_types_of"]

LAYER_TYPES = ("linear_attention", "full_attention")
#: KDA's q/k/v projections (renamed ``kda_q`` ... by :meth:`KimiLinearForCausalLM.rename`: MLA's
#: ``q_proj`` stays whole) and convolutions fused, and the MLPs' gate/up projections.
STACKED: StackedMapping = (
    ("qkv_proj", "kda_q", 0), ("qkv_proj", "kda_k", 1), ("qkv_proj", "kda_v", 2),
    ("conv1d", "q_conv1d", 0), ("conv1d", "k_conv1d", 1), ("conv1d", "v_conv1d", 2),
    ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
)


def layer_types_of(config: Any) -> list[str]:
    """Each layer's mixer (``config.layer_types``); ValueError naming an unknown type or a
    list of the wrong length."""
    types = list(getattr(config, "layer_types", None) or [])
    bad = sorted({str(t) for t in types if t not in LAYER_TYPES})
    if bad or len(types) != config.num_hidden_layers:
        raise ValueError(f"KimiLinearForCausalLM: layer_types must list one of "
                         f"{list(LAYER_TYPES)} per layer ({config.num_hidden_layers}); got "
                         f"{types}")
    return types


def _copy(param: nn.Parameter, src: torch.Tensor, what: str) -> None:
    if tuple(src.shape) != tuple(param.shape):
        raise ValueError(f"{what}: this rank's part has shape {tuple(src.shape)}, the parameter "
                         f"{tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(src)


def _rank_rows(loaded: torch.Tensor, rows: int, rank: int, size: int) -> torch.Tensor:
    """This rank's ``rows`` of a tensor split by heads along dim 0 (whole when it has them)."""
    return loaded.narrow(0, rank * rows, rows) if size > 1 and loaded.shape[0] == rows * size \
        else loaded


class _ShortConvs(nn.Module):
    """The q, k and v convolutions' weights as one ``[3 * D, W]`` parameter (``conv1d.weight``:
    each checkpoint tensor ``[D_total, 1, W]`` loads into its third, this rank's channels)."""

    def __init__(self, dim: int, width: int, rank: int, size: int) -> None:
        super().__init__()
        self.dim, self.rank, self.size = dim, rank, size
        self.weight = nn.Parameter(torch.empty(3 * dim, width))
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        src = loaded.reshape(loaded.shape[0], -1)
        src = _rank_rows(src, self.dim, self.rank, self.size)
        part = param.data[shard_id * self.dim:(shard_id + 1) * self.dim]
        if tuple(src.shape) != tuple(part.shape):
            raise ValueError(f"self_attn.{'qkv'[shard_id]}_conv1d.weight: this rank's part has "
                             f"shape {tuple(src.shape)}, the parameter {tuple(part.shape)}")
        part.copy_(src)


class _NormWeight(nn.Module):
    """The output norm's per-channel weight (``o_norm.weight``; the norm runs in the layer)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class KimiDeltaAttention(RequestStateLayer):
    """Kimi Delta Attention (module docstring); HF's checkpoint names (``self_attn.*``, its q/k/v
    projections and convolutions fused). Keeps per request ``conv`` ``[W - 1, 3 * H * K]``
    (model dtype) and ``recurrent`` ``[H, K, K]`` (fp32)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = resolve_tp(None)
        total = int(config.linear_num_heads)
        #: This rank's heads.
        self.num_heads = split_evenly(total, self.tp_size, "linear_num_heads")
        self.head_dim = d = int(config.linear_head_dim)
        self.dim = self.num_heads * d
        self.kernel_size = int(config.linear_conv_kernel_dim)
        self.eps = float(config.rms_norm_eps)
        hidden = int(config.hidden_size)
        self.qkv_proj = MergedColumnLinear(hidden, [total * d] * 3)
        self.conv1d = _ShortConvs(self.dim, self.kernel_size, self.tp_rank, self.tp_size)
        self.f_a_proj = LinearBase(hidden, d)  # (the low-rank inputs: every head reads them)
        self.f_b_proj = ColumnLinear(d, total * d)
        self.b_proj = ColumnLinear(hidden, total)
        self.g_a_proj = LinearBase(hidden, d)
        self.g_b_proj = ColumnLinear(d, total * d)
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.dim))
        for param in (self.A_log, self.dt_bias):
            param.weight_loader = self._load_heads  # type: ignore[attr-defined]
        self.o_norm = _NormWeight(d)
        self.o_proj = RowLinear(total * d, hidden)

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """``A_log`` (``[1, 1, H, 1]`` in the checkpoints) or ``dt_bias`` (``[H * K]``): this
        rank's heads."""
        src = _rank_rows(loaded.reshape(-1), param.shape[0], self.tp_rank, self.tp_size)
        _copy(param, src, "self_attn.A_log / dt_bias")

    def request_state_shapes(self) -> StateShapes:
        return {"conv": ((self.kernel_size - 1, 3 * self.dim), None),
                "recurrent": ((self.num_heads, self.head_dim, self.head_dim), torch.float32)}

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` (normed) -> ``[T, hidden]`` (``positions`` unused: no RoPE); the
        step's requests' states advance."""
        st = self.step_states()
        qsl, seq_lens, rows = st.query_start_loc, st.seq_lens, st.rows
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        states = self.request_states
        mixed = causal_conv1d(self.qkv_proj(x), self.conv1d.weight, None, states["conv"], qsl,
                              seq_lens, rows, "silu", state_table=st.state_table,
                              row_slots=st.row_slots)
        q, k, v = (part.view(t, h, d) for part in torch.split(mixed, self.dim, dim=-1))
        raw_decay = self.f_b_proj(self.f_a_proj(x)).view(t, h, d)
        out = gated_delta_rule_auto(
            q, k, v, raw_decay, self.b_proj(x), states["recurrent"], qsl, seq_lens, rows,
            d ** -0.5, l2norm_qk=True, state_table=st.state_table,
            gate_params=(self.A_log, self.dt_bias.view(h, d)), max_query_len=st.max_query_len,
            row_slots=st.row_slots)
        gate = self.g_b_proj(self.g_a_proj(x)).view(t, h, d)
        o = out.float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        o = o * self.o_norm.weight.float() * torch.sigmoid(gate.float())
        return cast(torch.Tensor, self.o_proj(o.to(x.dtype).reshape(t, h * d)))


def kimi_mlp(config: Any, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``'s MLP: the dense SwiGLU or the routed + shared experts (module
    docstring), per ``config.mlp_layer_types``."""
    kinds = list(getattr(config, "mlp_layer_types", None) or [])
    if len(kinds) != config.num_hidden_layers or kinds[layer_idx] not in ("dense", "sparse"):
        raise ValueError(f"KimiLinearForCausalLM: mlp_layer_types must list 'dense' or "
                         f"'sparse' per layer ({config.num_hidden_layers}); got {kinds}")
    hidden, act = config.hidden_size, config.hidden_act
    if kinds[layer_idx] == "dense":
        return GatedMLP(hidden, config.intermediate_size, act)
    n_group = int(getattr(config, "n_group", None) or 1)
    router = GroupedTopKRouter(
        hidden, int(config.num_local_experts), int(config.num_experts_per_tok),
        n_group=n_group, topk_group=int(getattr(config, "topk_group", None) or 1),
        renormalize=bool(config.norm_topk_prob),
        routed_scaling_factor=float(config.routed_scaling_factor), scoring="sigmoid",
        correction_bias=True)
    experts = FusedMoE(int(config.num_local_experts), hidden, config.moe_intermediate_size)
    shared = int(getattr(config, "n_shared_experts", None) or 0)
    return MoEBlock(router, experts, GatedMLP(hidden, config.moe_intermediate_size * shared, act)
                    if shared else None)


class KimiLinearForCausalLM(CausalLM):
    """Kimi-Linear in the mrv2 model contract (module docstring)."""

    stacked_params: ClassVar[StackedMapping] = STACKED

    def __init__(self, config: PretrainedConfig) -> None:
        check_mla_config(config, "KimiLinearForCausalLM")
        types = layer_types_of(config)
        self.linear_layers = {i for i, kind in enumerate(types) if kind == "linear_attention"}
        cache_idx = [types[:i].count("full_attention") for i in range(len(types))]

        def layer(i: int) -> nn.Module:
            mixer: nn.Module
            if types[i] == "linear_attention":
                mixer = KimiDeltaAttention(config)
            else:
                mixer = MLAAttention(config, cache_idx[i], None, interleaved_rope=False)
            return MLADecoderLayer(config, cast(MLAAttention, mixer), kimi_mlp(config, i))

        super().__init__(config, DecoderModel(config, layer))

    def rename(self, name: str) -> str | None:
        """Checkpoint name -> parameter name: ``block_sparse_moe`` is ``mlp``; a KDA layer's
        ``q/k/v_proj`` go to its fused projection (MLA's ``q_proj`` stays); the HF module
        path of the forget gate (``self_attn.forget_gate.*``) is taken too."""
        name = name.replace(".block_sparse_moe.", ".mlp.").replace(".forget_gate.", ".")
        parts = name.split(".")
        if (len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "self_attn"
                and parts[4] in ("q_proj", "k_proj", "v_proj")
                and int(parts[2]) in self.linear_layers):
            parts[4] = "kda_" + parts[4][0]
            name = ".".join(parts)
        return super().rename(name)
