"""AI2's OLMo hybrid (``OlmoHybridForCausalLM``: Olmo-Hybrid-7B): Gated DeltaNet linear
attention layers and OLMo 3's attention layers, per ``config.layer_types``
(``"linear_attention"`` / ``"full_attention"``), with each kind's own norm placement, as
transformers 5.17's ``OlmoHybrid*DecoderLayer``:

    linear_attention (pre-norm):  h = h + linear_attn(input_layernorm(h))
                                  h = h + mlp(post_attention_layernorm(h))
    full_attention (post-norm):   h = h + post_attention_layernorm(self_attn(h))
                                  h = h + post_feedforward_layernorm(mlp(h))

* ``linear_attn`` (:class:`OlmoGatedDeltaNet`): separate ``q_proj`` / ``k_proj`` (
  ``linear_num_key_heads`` heads of ``linear_key_head_dim``), ``v_proj`` and the output gate
  ``g_proj`` (``linear_num_value_heads`` of ``linear_value_head_dim``), ``a_proj`` / ``b_proj``
  (one per value head); q, k, v through a causal depthwise convolution of width
  ``linear_conv_kernel_dim`` without bias, then SiLU; the gated delta rule with queries and
  keys L2-normed, ``beta = sigmoid(b)`` (times 2 with ``linear_allow_neg_eigval``: a write
  strength in ``[0, 2]``) and the log decay ``g = -exp(A_log) * softplus(a + dt_bias)``; the
  output RMS-normed per value head (epsilon 1e-5, as HF), times ``silu(g_proj(x))``, then
  ``o_proj``. Per request the layer keeps the convolution's last inputs and the recurrent
  state (:mod:`mrv2.contract.request_state`), so prefix caching (state snapshots) and
  speculative decoding work as for the other linear-attention families. Built here on the
  core's kernels (:func:`~mrv2_kernels.linear_attention.causal_conv1d`,
  :func:`~mrv2_kernels.chunk_delta_rule.gated_delta_rule_auto`,
  :func:`~mrv2_kernels.norm.gated_rms_norm`).
* ``self_attn``: OLMo 2 / 3's attention (whole-projection q/k RMSNorms; the core's
  ``SelfAttention(qk_norm="projection")``), RoPE only where ``rope_parameters`` gives a
  ``rope_theta``, HF's test (:func:`rope_of`). The config is read as transformers 5.17
  resolves it, which fills in its default theta where ``config.json`` says ``null``: such a
  checkpoint rotates here exactly as it does in transformers (and vLLM).
* ``mlp``: a SwiGLU of ``intermediate_size``.

Tensor parallelism: the linear-attention layers by key-head groups (each rank its key heads
and their value heads: q/k/v/g/a/b rows, the convolution's channels, the states), the
attention by heads (its projection norms all-reduce their statistics), the MLP by columns.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.contract.request_state import RequestStateLayer, StateShapes
from mrv2.layers import (
    CausalLM,
    DecoderModel,
    GatedMLP,
    PostNormDecoderLayer,
    RMSNorm,
    RowLinear,
    SelfAttention,
    get_rope,
    head_dim_of,
    norm_mlp,
)
from mrv2.layers.decoder import STACKED_PARAMS
from mrv2.layers.linear import MergedColumnLinear, resolve_tp, split_evenly
from mrv2.layers.rotary import RotaryEmbedding
from mrv2.layers.weights import StackedMapping
from mrv2_kernels.chunk_delta_rule import gated_delta_rule_auto
from mrv2_kernels.linear_attention import causal_conv1d
from mrv2_kernels.norm import gated_rms_norm

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FAMILY = "OLMo hybrid"
KINDS = ("linear_attention", "full_attention")
#: HF's gated output norm's epsilon (fixed, FLA's default; not a config field).
O_NORM_EPS = 1e-5


def layer_kinds_of(config: Any) -> list[str]:
    """Each layer's mixer (``config.layer_types``); ValueError naming the field."""
    layers = int(config.num_hidden_layers)
    kinds = [str(k) for k in (getattr(config, "layer_types", None) or [])]
    if len(kinds) != layers or any(k not in KINDS for k in kinds):
        raise ValueError(f"{FAMILY}: layer_types must list 'linear_attention' or "
                         f"'full_attention' for each of the {layers} layers, got {kinds}")
    return kinds


class NamedMergedColumnLinear(MergedColumnLinear):
    """A :class:`MergedColumnLinear` whose shards are named (``names[i]`` is shard ``i``): the
    core's q/k/v stacked mapping fills the linear attention's ``[q | k | v]`` (whose value
    part is as wide as the value heads, not the key heads)."""

    def __init__(self, input_size: int, output_sizes: list[int], names: tuple[str, ...]
                 ) -> None:
        super().__init__(input_size, output_sizes)
        self.names = names

    def shard_rows(self, shard_id: object = None) -> tuple[int, int]:
        return super().shard_rows(self.names.index(cast(str, shard_id))
                                  if shard_id in self.names else shard_id)

    def shard_part(self, loaded: torch.Tensor, shard_id: object) -> torch.Tensor:
        return super().shard_part(loaded, self.names.index(cast(str, shard_id))
                                  if shard_id in self.names else shard_id)


class QKVConv(nn.Module):
    """The depthwise convolution's ``weight`` ``[conv_dim, W]`` over this rank's q, k and v
    channels, loaded from a whole ``conv1d.weight`` ``[D, 1, W]`` (transformers' name in
    memory; :meth:`OlmoHybridForCausalLM.load_weights` concatenates the published
    ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` into it, as transformers does): this rank's
    slice of each part."""

    def __init__(self, key_dim: int, value_dim: int, kernel: int, rank: int, size: int
                 ) -> None:
        super().__init__()
        self.key_dim, self.value_dim, self.rank, self.size = key_dim, value_dim, rank, size
        self.weight = nn.Parameter(torch.empty(2 * key_dim + value_dim, kernel))
        self.weight.weight_loader = self.load  # type: ignore[attr-defined]

    def load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """This rank's rows of each of q, k and v of the whole checkpoint tensor."""
        src = loaded.reshape(loaded.shape[0], -1)
        parts = [self.key_dim, self.key_dim, self.value_dim]
        whole = [self.size * n for n in parts]
        if tuple(src.shape) != (sum(whole), param.shape[1]):
            raise ValueError(f"linear_attn.conv1d.weight has shape {tuple(loaded.shape)}, the "
                             f"config's q/k/v channels {sum(whole)} of width {param.shape[1]}")
        mine = [t.narrow(0, self.rank * n, n)
                for t, n in zip(src.split(whole), parts, strict=True)]
        with torch.no_grad():
            param.copy_(torch.cat(mine))


class OlmoGatedDeltaNet(RequestStateLayer):
    """OLMo hybrid's linear-attention mixer (module docstring); HF's ``linear_attn.*`` names
    (q/k/v fused into ``qkv_proj``, g/a/b into ``gab_proj``, the q/k/v convolutions into
    ``conv1d``). Keeps per request ``conv``
    ``[W - 1, conv_dim]`` (model dtype) and ``recurrent`` ``[Hv, K, V]`` (fp32)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        total_k, total_v = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        if total_v % total_k:
            raise ValueError(f"{FAMILY}: linear_num_value_heads ({total_v}) must be a multiple "
                             f"of linear_num_key_heads ({total_k})")
        if str(config.hidden_act) != "silu":
            raise ValueError(f"{FAMILY}: hidden_act (the convolution's and the MLPs' "
                             f"activation) must be 'silu', got {config.hidden_act!r}")
        self.tp_rank, self.tp_size = resolve_tp(None)
        self.num_k_heads = split_evenly(total_k, self.tp_size, "linear_num_key_heads")
        self.num_v_heads = total_v // total_k * self.num_k_heads
        self.head_k_dim = int(config.linear_key_head_dim)
        self.head_v_dim = int(config.linear_value_head_dim)
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = int(config.linear_conv_kernel_dim)
        self.beta_scale = 2.0 if bool(getattr(config, "linear_allow_neg_eigval", True)) else 1.0
        hidden, size = int(config.hidden_size), self.tp_size
        kd, vd = total_k * self.head_k_dim, total_v * self.head_v_dim
        self.qkv_proj = NamedMergedColumnLinear(hidden, [kd, kd, vd], ("q", "k", "v"))
        self.gab_proj = MergedColumnLinear(hidden, [vd, total_v, total_v])
        self.conv1d = QKVConv(self.key_dim, self.value_dim, self.kernel_size, self.tp_rank,
                              self.tp_size)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        for param in (self.dt_bias, self.A_log):
            param.weight_loader = self._load_heads  # type: ignore[attr-defined]
        self.o_norm = RMSNorm(self.head_v_dim, eps=O_NORM_EPS)  # (its weight; gated below)
        self.o_proj = RowLinear(self.value_dim * size, hidden)

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A per-value-head vector (``dt_bias``, ``A_log``): this rank's heads."""
        n = self.num_v_heads
        src = loaded.narrow(0, self.tp_rank * n, n) if self.tp_size > 1 \
            and loaded.shape[0] == n * self.tp_size else loaded
        if tuple(src.shape) != tuple(param.shape):
            raise ValueError(f"linear_attn.dt_bias / A_log: this rank's part has shape "
                             f"{tuple(src.shape)}, the parameter {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(src)

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
        states = self.request_states
        mixed = causal_conv1d(self.qkv_proj(x), self.conv1d.weight, None, states["conv"], qsl,
                              seq_lens, rows, "silu", state_table=st.state_table,
                              row_slots=st.row_slots)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        gate, a, b = torch.split(self.gab_proj(x), [self.value_dim, hv, hv], dim=-1)
        decay = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        beta = b.sigmoid() * self.beta_scale if self.beta_scale != 1.0 else b.sigmoid()
        out = gated_delta_rule_auto(
            q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv), decay, beta,
            states["recurrent"], qsl, seq_lens, rows, dk ** -0.5, l2norm_qk=True,
            state_table=st.state_table, max_query_len=st.max_query_len,
            row_slots=st.row_slots)
        out = gated_rms_norm(out.reshape(t, hv * dv), gate, self.o_norm.weight, O_NORM_EPS, dv,
                             norm_before_gate=True)
        return cast(torch.Tensor, self.o_proj(out))


class LinearAttentionLayer(nn.Module):
    """A pre-norm layer (module docstring): ``input_layernorm``, ``linear_attn``,
    ``post_attention_layernorm`` (before the MLP), ``mlp``; the adds fused into the norms."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        eps, hidden = float(config.rms_norm_eps), int(config.hidden_size)
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.linear_attn = OlmoGatedDeltaNet(config)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        self.mlp = GatedMLP(hidden, int(config.intermediate_size), str(config.hidden_act))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden_states, residual)`` in and out, as the core's decoder layers."""
        if residual is None:
            x, residual = cast(torch.Tensor, self.input_layernorm(hidden_states)), hidden_states
        else:
            x, residual = cast(tuple[torch.Tensor, torch.Tensor],
                               self.input_layernorm(hidden_states, residual))
        return norm_mlp(self.post_attention_layernorm, self.mlp, self.linear_attn(x), residual)


def rope_of(config: Any) -> RotaryEmbedding | None:
    """The attention layers' RoPE where ``rope_parameters`` names a ``rope_theta`` (as HF's
    ``OlmoHybridModel`` decides), else None (no positional encoding)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, Mapping) or params.get("rope_theta") is None:
        return None
    return get_rope(config, head_dim_of(config))


class OlmoHybridForCausalLM(CausalLM):
    """OLMo hybrid in the mrv2 model contract (module docstring)."""

    #: The core's q/k/v and gate/up fusions (the linear attention's q/k/v too), and the
    #: linear attention's ``[g | a | b]``.
    stacked_params: ClassVar[StackedMapping] = (
        *STACKED_PARAMS,
        ("gab_proj", "g_proj", 0), ("gab_proj", "a_proj", 1), ("gab_proj", "b_proj", 2))
    #: The published checkpoints' norm names -> transformers' (and this model's).
    renames: ClassVar[tuple[tuple[str, str], ...]] = (
        (".attention_layer_norm.", ".input_layernorm."),
        (".feedforward_layer_norm.", ".post_attention_layernorm."),
    )

    def __init__(self, config: PretrainedConfig) -> None:
        kinds = layer_kinds_of(config)
        rope = rope_of(config)
        cache_idx = [kinds[:i].count("full_attention") for i in range(len(kinds))]
        bias = bool(getattr(config, "attention_bias", False))

        def layer(i: int) -> nn.Module:
            if kinds[i] == "linear_attention":
                return LinearAttentionLayer(config)
            attention = SelfAttention(config, cache_idx[i], rope, qkv_bias=bias, o_bias=bias,
                                      qk_norm="projection")
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
            return PostNormDecoderLayer(config, attention, mlp)

        super().__init__(config, DecoderModel(config, layer, num_layers=len(kinds)))
        self.layer_kinds = kinds

    def rename(self, name: str) -> str | None:
        """The published names (``attention_layer_norm``, ``feedforward_layer_norm``) onto
        transformers' in-memory ones, which are this model's; the q/k/v, g/a/b projections
        fuse by :attr:`stacked_params`."""
        for old, new in self.renames:
            name = name.replace(old, new)
        return super().rename(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors; a layer's published ``q_conv1d`` / ``k_conv1d`` /
        ``v_conv1d`` concatenated in that order into ``conv1d`` once all three came (as
        transformers' loader does: its saved files split the fused tensor in three near-equal
        parts, not by q/k/v), a layer left short of one a ValueError naming it."""
        return super().load_weights(_fuse_convs(weights))


def _fuse_convs(weights: Iterable[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        match = _CONV_PART.match(name)
        if match is None:
            yield name, tensor
            continue
        parts = pending.setdefault(match.group(1), {})
        parts[match.group(2)] = tensor
        if len(parts) == 3:
            del pending[match.group(1)]
            yield match.group(1) + "conv1d.weight", torch.cat([parts[p] for p in "qkv"])
    if pending:
        raise ValueError(f"{FAMILY}: the checkpoint lacks some q/k/v convolution weights of "
                         f"{sorted(pending)}")


_CONV_PART = re.compile(r"^(.*\.linear_attn\.)([qkv])_conv1d\.weight$")
