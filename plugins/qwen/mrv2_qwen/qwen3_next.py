"""Qwen3-Next (``Qwen3NextForCausalLM``, e.g. Qwen3-Next-80B-A3B): a hybrid of Gated DeltaNet
linear attention and gated full attention, with a sparse MoE whose shared expert is gated.

``config.layer_types`` names each layer's token mixer:

* ``"linear_attention"``: Gated DeltaNet (:class:`GatedDeltaNet`): ``in_proj_qkvz`` and
  ``in_proj_ba`` project the normed input, grouped per key head (each group: its query and key
  heads of ``linear_key_head_dim``, then its ``linear_num_value_heads / linear_num_key_heads``
  value heads and as many output-gate heads ``z``, then as many ``b`` and ``a``); the queries,
  keys and values go through a causal depthwise convolution of width
  ``linear_conv_kernel_dim`` with SiLU, then the gated delta rule with ``beta = sigmoid(b)``
  and the per-head log decay ``g = -exp(A_log) * softplus(a + dt_bias)``, queries and keys
  L2-normed; the output is RMS-normed per value head, gated by ``silu(z)``, projected by
  ``out_proj``. Per request the layer keeps the convolution's last inputs and the recurrent
  state (:mod:`mrv2.contract.request_state`): prefix caching keeps snapshots of it, and
  speculative decoding keeps it after each token of a verify step.
* ``"full_attention"``: Qwen3's attention (q/k RMSNorm per head, RoPE over the first
  ``partial_rotary_factor`` of each head) whose ``q_proj`` also yields a gate per head
  (``[q_h, gate_h]`` per head): the attention output is scaled by ``sigmoid(gate)`` before
  ``o_proj``.

The MLP is the routed experts (softmax top-k) plus a shared expert scaled per token by
``sigmoid(shared_expert_gate(x))`` on the sparse layers (Qwen3-MoE's rule), a dense SwiGLU
elsewhere. Every RMSNorm but the gated one multiplies by ``1 + weight``: the loader adds the 1.
Checkpoints' ``mtp.*`` (the multi-token-prediction head) are not loaded here:
:meth:`Qwen3NextForCausalLM.build_mtp` builds it (:mod:`mrv2_qwen.qwen3_next_mtp`) for the MTP
speculator.

Tensor parallelism splits the linear-attention layers by key-head groups: each rank projects
``linear_num_key_heads / tp`` whole groups (their rows are contiguous in both projections),
convolves its slice of the query, key and value channels, keeps its heads' states and
all-reduces after ``out_proj``; the attention, the experts and the dense MLPs split as the
core's layers do (the query/gate pairs stay on one rank).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.contract.request_state import RequestStateLayer, StateShapes
from mrv2.layers import (
    Attention,
    CausalLM,
    ColumnLinear,
    DecoderModel,
    FusedMoE,
    GatedMLP,
    MoEBlock,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    RowLinear,
    SoftmaxTopKRouter,
    get_rope,
    head_dim_of,
    norm_mlp,
)
from mrv2.layers.int_quant import IntLinearMixin
from mrv2.layers.linear import LinearBase, norm_linear, resolve_tp, split_evenly
from mrv2.layers.moe import is_sparse_layer
from mrv2.layers.weights import is_fresh
from mrv2_kernels.chunk_delta_rule import gated_delta_rule_auto
from mrv2_kernels.linear_attention import causal_conv1d
from mrv2_kernels.norm import gated_rms_norm
from mrv2_qwen.qwen3_moe import shared_expert_size, skip_absent_shared_expert

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from mrv2_qwen.qwen3_next_mtp import Qwen3NextMTP

LAYER_TYPES = ("linear_attention", "full_attention")


def layer_types_of(config: Any) -> list[str]:
    """Each layer's mixer: ``config.layer_types``, else every ``full_attention_interval``-th
    layer full attention (HF's default); ValueError naming an unknown type."""
    types = getattr(config, "layer_types", None)
    if types is None:
        interval = int(getattr(config, "full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(config.num_hidden_layers)]
    types = list(types)[: config.num_hidden_layers]
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad or len(types) != config.num_hidden_layers:
        raise ValueError(f"layer_types must list one of {list(LAYER_TYPES)} per layer "
                         f"({config.num_hidden_layers}); got {types}")
    return types


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dimension, then ``* silu(gate)`` (HF's ``Qwen3NextRMSNormGated``:
    the normed value cast to the input dtype before the weight multiply, the gate in fp32)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return ((self.weight * normed) * F.silu(gate.float())).to(x.dtype)


def _by_kind(groups: int, sizes: list[int]) -> torch.Tensor:
    """The row permutation from ``groups`` groups of ``sizes`` consecutive parts to every
    group's part 0, then every group's part 1, ...: new row ``i`` is old row ``perm[i]``."""
    width = sum(sizes)
    starts = [sum(sizes[:j]) for j in range(len(sizes))]
    # on the host whatever the default device (a quantized model is built on the meta
    # device, where the permutation would hold no values)
    return torch.cat([torch.arange(g * width + starts[j], g * width + starts[j] + n,
                                   device="cpu")
                      for j, n in enumerate(sizes) for g in range(groups)])


def _reorder_rows(perm: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (indexed by a projection's output rows) regrouped by :func:`_by_kind`, in
    place (``LinearBase.row_order``: a LoRA adapter's ``B`` takes it too)."""
    raw = rows.view(torch.uint8) if rows.element_size() == 1 else rows  # (fp8: as bytes)
    raw.copy_(raw[perm.to(raw.device)].clone())
    return rows


def _load_ungrouped(base: Any, param: nn.Parameter, loaded: torch.Tensor,
                    *args: Any) -> None:
    """A projection's weight loader: the rows arrive grouped per key head (regrouped after
    loading: ``GatedDeltaNet.process_weights_after_loading``)."""
    base(param, loaded, *args)
    param.rows_by_kind = False  # type: ignore[attr-defined]


def _rows_by_kind(linear: LinearBase) -> bool:
    """Whether a projection's rows are regrouped (:meth:`GatedDeltaNet.
    process_weights_after_loading`): its weight's mark, or, where its weight is packed
    integers, none of its row tensors loaded since the last regrouping
    (:func:`~mrv2.layers.weights.is_fresh`)."""
    weight = linear._parameters.get("weight")
    if weight is not None:
        return bool(getattr(weight, "rows_by_kind", False))
    return not any(is_fresh(p) for p in linear._parameters.values())


def _copy(param: nn.Parameter, src: torch.Tensor, what: str) -> None:
    if tuple(src.shape) != tuple(param.shape):
        raise ValueError(f"{what}: this rank's part has shape {tuple(src.shape)}, the parameter "
                         f"{tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(src)


class GatedDeltaNet(RequestStateLayer):
    """Qwen3-Next's linear-attention mixer (module docstring); HF's ``linear_attn.*`` names.
    Keeps per request ``conv`` ``[W - 1, conv_dim]`` (model dtype) and ``recurrent``
    ``[Hv, K, V]`` (fp32)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        total_k, total_v = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        if total_v % total_k:
            raise ValueError(f"linear_num_value_heads ({total_v}) must be a multiple "
                             f"of linear_num_key_heads ({total_k})")
        self.tp_rank, self.tp_size = resolve_tp(None)
        #: This rank's key and value heads (whole key-head groups).
        self.num_k_heads = split_evenly(total_k, self.tp_size, "linear_num_key_heads")
        self.num_v_heads = total_v // total_k * self.num_k_heads
        self.head_k_dim = int(config.linear_key_head_dim)
        self.head_v_dim = int(config.linear_value_head_dim)
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = int(config.linear_conv_kernel_dim)
        if config.hidden_act != "silu":
            raise ValueError(f"Qwen3-Next: hidden_act must be 'silu' (the convolution's and "
                             f"the experts' activation), got {config.hidden_act!r}")
        hidden = int(config.hidden_size)
        size = self.tp_size
        self.build_in_projections(hidden)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel_size))
        self.conv_weight.weight_loader = self._load_conv  # type: ignore[attr-defined]
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        for param in (self.dt_bias, self.A_log):
            param.weight_loader = self._load_heads  # type: ignore[attr-defined]
        self.norm = GatedRMSNorm(self.head_v_dim, float(config.rms_norm_eps))
        self.out_proj = RowLinear(self.value_dim * size, hidden)

    def build_in_projections(self, hidden: int) -> None:
        """``in_proj_qkvz`` and ``in_proj_ba``, this rank's rows of every kind, which the
        forward reads as ``[q | k | v | z]`` and ``[b | a]``. Qwen3-Next's checkpoints group
        the rows per key head (``[q, k, v, z]`` and ``[b, a]`` per group): they are regrouped
        by kind after loading (:meth:`process_weights_after_loading`), so the convolution
        reads q, k, v as one slice of the output and the gates come without a copy."""
        size = self.tp_size
        self.in_proj_qkvz = ColumnLinear(hidden, (2 * self.key_dim + 2 * self.value_dim) * size)
        self.in_proj_ba = ColumnLinear(hidden, 2 * self.num_v_heads * size)
        r = self.num_v_heads // self.num_k_heads
        group = [self.head_k_dim, self.head_k_dim, r * self.head_v_dim, r * self.head_v_dim]
        for linear, sizes in ((self.in_proj_qkvz, group), (self.in_proj_ba, [r, r])):
            perm = _by_kind(self.num_k_heads, sizes)
            linear.row_order = functools.partial(_reorder_rows, perm)
            base = linear.weight.weight_loader  # type: ignore[attr-defined]
            linear.weight.weight_loader = functools.partial(  # type: ignore[attr-defined]
                _load_ungrouped, base)

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """The depthwise Conv1d weight ``[D, 1, W]`` (or ``[D, W]``) over all query, key and
        value channels: this rank's slice of each, as ``[conv_dim, W]``."""
        src = loaded.reshape(loaded.shape[0], -1) if loaded.dim() == 3 else loaded
        size, rank, kd, vd = self.tp_size, self.tp_rank, self.key_dim, self.value_dim
        if size > 1 and src.shape[0] == self.conv_dim * size:
            src = torch.cat([src[rank * kd:(rank + 1) * kd],
                             src[size * kd + rank * kd:size * kd + (rank + 1) * kd],
                             src[2 * size * kd + rank * vd:2 * size * kd + (rank + 1) * vd]])
        _copy(param, src, "linear_attn.conv1d.weight")

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A per-value-head vector (``dt_bias``, ``A_log``): this rank's heads."""
        n = self.num_v_heads
        src = loaded.narrow(0, self.tp_rank * n, n) if loaded.shape[0] == n * self.tp_size \
            and self.tp_size > 1 else loaded
        _copy(param, src, "linear_attn.dt_bias / A_log")

    def process_weights_after_loading(self) -> None:
        """Regroup the projections' freshly loaded rows by kind (``__init__``), with an fp8
        layer's per-row scales alike (an integer layer's packed weight, scales and zero
        points by their output columns); rows already regrouped stay (a reload of other
        parameters)."""
        for linear in (self.in_proj_qkvz, self.in_proj_ba):
            if isinstance(linear, IntLinearMixin):  # integer weights (GPTQ, AWQ, ...): the
                linear.process_weights_after_loading()  # layer's own first (the CPU's: plain)
            if _rows_by_kind(linear) or linear.row_order is None:
                continue
            if isinstance(linear, IntLinearMixin):  # (kept packed: their output columns;
                linear.reorder_rows(linear.row_order, fresh_only=True)  # those loaded anew)
                continue
            weight = linear.weight
            with torch.no_grad():
                for name in ("weight", "weight_scale_inv"):
                    param = getattr(linear, name, None)
                    if param is not None:
                        linear.row_order(param.data)
            weight.rows_by_kind = True  # type: ignore[attr-defined]

    def in_projections_by_kind(self) -> bool:
        """Whether the input projections' rows are laid out by kind yet (here: regrouped
        after loading)."""
        return _rows_by_kind(self.in_proj_qkvz)

    def request_state_shapes(self) -> StateShapes:
        return {"conv": ((self.kernel_size - 1, self.conv_dim), None),
                "recurrent": ((self.num_v_heads, self.head_k_dim, self.head_v_dim),
                              torch.float32)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` (normed) -> ``[T, hidden]``; the step's requests' states advance."""
        st = self.step_states()
        qsl, seq_lens, rows = st.query_start_loc, st.seq_lens, st.rows
        t = x.shape[0]
        hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        if not self.in_projections_by_kind():
            raise RuntimeError("GatedDeltaNet: the projections' rows are not regrouped yet "
                               "(process_weights_after_loading runs after loading)")
        proj = self.in_proj_qkvz(x)  # [q | k | v | z]
        ba = self.in_proj_ba(x)  # [b | a]
        states = self.request_states
        mixed = causal_conv1d(proj[:, : self.conv_dim], self.conv_weight, None, states["conv"],
                              qsl, seq_lens, rows, "silu", state_table=st.state_table,
                              row_slots=st.row_slots)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        out = gated_delta_rule_auto(
            q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv), ba[:, hv:], ba[:, :hv],
            states["recurrent"], qsl, seq_lens, rows, dk ** -0.5, l2norm_qk=True,
            state_table=st.state_table, gate_params=(self.A_log, self.dt_bias),
            max_query_len=st.max_query_len, row_slots=st.row_slots)
        out = gated_rms_norm(out.view(t, hv * dv), proj[:, self.conv_dim:], self.norm.weight,
                             self.norm.eps, dv, norm_before_gate=True)
        return cast(torch.Tensor, self.out_proj(out.reshape(t, hv * dv)))


class GatedAttention(nn.Module):
    """Qwen3-Next's full attention (module docstring); HF's ``self_attn.*`` names, q/k/v
    fused into ``qkv_proj`` (its query part twice the heads: each head's query then gate)."""

    def __init__(self, config: Any, cache_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        heads = int(config.num_attention_heads)
        split_evenly(heads, resolve_tp(None)[1], "num_attention_heads")  # (pairs on one rank)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, 2 * heads, kv_heads,
                                  bias=bias)
        self.o_proj = RowLinear(heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = rope
        self.attn = Attention(self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads,
                              self.head_dim, self.head_dim ** -0.5, cache_idx)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """After the projection: split the gate off, attend, gate, project."""
        q_gate, k, v = self.qkv_proj.split(qkv)
        t, h, d = q_gate.shape[0], self.attn.num_heads, self.head_dim
        q_gate = q_gate.reshape(t, h, 2, d)
        q, gate = q_gate[:, :, 0].reshape(t, h * d), q_gate[:, :, 1].reshape(t, h * d)
        out = self.attn(q, k, v, positions=positions, rotary=self.rotary_emb,
                        qk_norm=(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps))
        return cast(torch.Tensor, self.o_proj(out * torch.sigmoid(gate)))


def qwen3_next_mlp(config: Any, layer_idx: int) -> nn.Module:
    """The gated-shared-expert MoE on sparse layers, else a dense SwiGLU. A config without
    ``num_experts`` (Qwen3.5's dense one) is dense throughout; one without ``norm_topk_prob``
    (Qwen3.5-MoE's, whose router always does) renormalizes the picked weights."""
    if getattr(config, "num_experts", None) is None or not is_sparse_layer(config, layer_idx):
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
    router = SoftmaxTopKRouter(config.hidden_size, config.num_experts,
                               config.num_experts_per_tok,
                               bool(getattr(config, "norm_topk_prob", True)))
    experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size)
    shared = None
    if shared_expert_size(config) > 0:
        shared = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size,
                          config.hidden_act)
    return MoEBlock(router, experts, shared, shared_expert_gate=shared is not None)


class Qwen3NextLayer(nn.Module):
    """One pre-norm layer: ``linear_attn`` or ``self_attn`` per its type, then the MLP."""

    def __init__(self, config: Any, layer_idx: int, kind: str, cache_idx: int,
                 rope: RotaryEmbedding, delta_net: type[GatedDeltaNet] | None = None) -> None:
        super().__init__()
        self.linear = kind == "linear_attention"
        if self.linear:
            self.linear_attn = (delta_net or GatedDeltaNet)(config)
        else:
            self.self_attn = GatedAttention(config, cache_idx, rope)
        self.mlp = qwen3_next_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.linear:
            if residual is None:
                residual = hidden_states
                normed = cast(torch.Tensor, self.input_layernorm(hidden_states))
            else:
                normed, residual = self.input_layernorm(hidden_states, residual)
            hidden_states = self.linear_attn(normed)
        else:
            qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj,
                                        hidden_states, residual)
            hidden_states = self.self_attn.attend(positions, qkv)
        return norm_mlp(self.post_attention_layernorm, self.mlp, hidden_states, residual)


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next in the mrv2 model contract (module docstring)."""

    #: The linear-attention mixer (Qwen3.5's lays its projections out otherwise).
    delta_net: ClassVar[type[GatedDeltaNet]] = GatedDeltaNet
    #: The Gated DeltaNet's projections take LoRA adapters too (beside the attention's and
    #: the dense MLPs'; the routed experts take none): an adapter's ``in_proj_qkvz`` /
    #: ``in_proj_ba`` ``B`` rows are regrouped as the weight's (``row_order``).
    lora_targets: ClassVar[frozenset[str]] = frozenset({"in_proj_qkvz", "in_proj_ba",
                                                        "out_proj"})

    def __init__(self, config: PretrainedConfig) -> None:
        types = layer_types_of(config)
        rope = type(self).rope_of(config)
        cache_idx = [types[:i].count("full_attention") for i in range(len(types))]
        super().__init__(config, DecoderModel(config, lambda i: Qwen3NextLayer(
            config, i, types[i], cache_idx[i], rope, type(self).delta_net)))

    @staticmethod
    def rope_of(config: Any) -> RotaryEmbedding:
        """The full-attention layers' rotation: RoPE over the first ``partial_rotary_factor``
        of each head (Qwen3.5's vision-language model: M-RoPE)."""
        return get_rope(config, head_dim_of(config))

    def rename(self, name: str) -> str | None:
        if name.startswith(("mtp.", "model.mtp.")) or skip_absent_shared_expert(
                name, self.config) is None:
            return None
        name = name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
        name = name.replace(".linear_attn.conv1d.weight", ".linear_attn.conv_weight")
        return super().rename(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors; every RMSNorm weight but the gated norm's loaded as
        ``1 + w`` (in fp32). The ``mtp.*`` tensors are skipped (:meth:`build_mtp`'s)."""
        return super().load_weights((name, _fold_norm(name, t)) for name, t in weights)

    def build_mtp(self, first_layer_idx: int | None = None) -> Qwen3NextMTP:
        """The checkpoint's MTP head as a :class:`~mrv2_qwen.qwen3_next_mtp.Qwen3NextMTP`
        sharing this model's token embedding and LM head (same tensors), on this model's
        device and dtype, with unloaded weights: load them with
        ``load_model_weights(mtp, iter_safetensors(model_dir))`` (it takes the ``mtp.*``
        tensors), then run ``mrv2.model_loader.build.process_weights_after_loading(mtp)``.

        ``first_layer_idx`` numbers the MTP attention layers' KV caches (default: this model's
        full-attention layer count, right after its cache layers; a speculator passes the
        index the runner gives its ``kv_cache_specs``). The MTP layers keep no per-request
        state. See :mod:`mrv2_qwen.qwen3_next_mtp` for the math and the contract (that of
        :mod:`mrv2.layers.mtp`).
        """
        from mrv2.layers.mtp import build_mtp
        from mrv2_qwen.qwen3_next_mtp import Qwen3NextMTP

        return cast("Qwen3NextMTP", build_mtp(self, Qwen3NextMTP,
                                               first_layer_idx=first_layer_idx))


def _fold_norm(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if name.endswith("norm.weight") and ".linear_attn.norm." not in name:
        return tensor.float() + 1.0
    return tensor
