"""MiniMax-Text-01 / MiniMax-M1 (``MiniMaxForCausalLM``; the original remote-code names
``MiniMaxText01ForCausalLM`` and ``MiniMaxM1ForCausalLM``): a hybrid of lightning attention and
softmax attention, a mixture of experts in every layer, DeepNorm-style residual scaling.

Each layer's token mixer is ``config.layer_types[i]`` (the original configs'
``attn_type_list``: 0 lightning, 1 softmax):

* ``"linear_attention"``, lightning attention (:class:`LightningAttention`, HF's
  ``MiniMaxLightningAttention``): ``qkv_proj`` (per head its query, key and value rows) then
  SiLU, and per head ``h`` the linear recurrence ``S_t = exp(-s_h) S_{t-1} + k_t v_t^T``,
  ``o_t = q_t S_t`` with no query/key norm and no scale. The decay rate is fixed: ``s_h =
  2^(-8 (h + 1) / H) * (1 - l / (L - 1 + 1e-5) + 1e-5)`` for layer ``l`` of ``L`` (HF's
  formula; vLLM's ALiBi slopes equal it where ``H`` is a power of two, as in the published
  models). It is the core's gated delta rule without the delta term (``delta=False``,
  Mamba-2's form) with the constant log decay ``g = -s_h`` and ``beta = 1``, token-serial or
  chunked (:func:`mrv2_kernels.chunk_delta_rule.gated_delta_rule_auto`). The output (all
  heads) is RMS-normed over the whole ``H * D`` width (eps 1e-6 as HF's module; not
  ``rms_norm_eps``, and vLLM's 1e-5 differs too), times ``sigmoid(output_gate(x))``, then
  ``out_proj``. Per request the layer keeps the state ``[H, D, D]`` fp32
  (:mod:`mrv2.contract.request_state`: prefix caching's snapshots and speculative decoding's
  rows come with it).
* ``"full_attention"``: the core's :class:`~mrv2.layers.SelfAttention` with RoPE (over the
  first ``rotary_dim`` of each head where the config names one, MiniMax's own field), no q/k
  norm.

A layer is ``n = input_layernorm(x)``, ``h = alpha_a n + beta_a attn(n)``, ``m =
post_attention_layernorm(h)``, ``out = alpha_m m + beta_m moe(m)``: the residuals are the
*normed* values (HF's layer; the original configs' ``postnorm: true``). The factors are
``full_attn_alpha_factor`` / ``linear_attn_alpha_factor`` / ``mlp_alpha_factor`` and their
``beta`` ones (the original ``layernorm_full_attention_alpha`` ... ``layernorm_mlp_beta``). The
MoE: softmax top-k router renormalized, SwiGLU experts (checkpoints: HF 5.x ``mlp.experts``
stacked tensors, or the published ``block_sparse_moe.experts.{e}.w1/w2/w3``).

Tensor parallelism splits lightning attention by heads (``qkv_proj`` and ``output_gate``
column-parallel, each rank its heads' decays and states, the output norm's mean square
all-reduced over the ranks, ``out_proj`` row-parallel); softmax attention and the experts
split as the core's layers do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.contract.request_state import RequestStateLayer, StateShapes
from mrv2.layers import (
    CausalLM,
    DecoderModel,
    FusedMoE,
    MoEBlock,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    SoftmaxTopKRouter,
    get_rope,
    head_dim_of,
)
from mrv2.layers.linear import ColumnLinear, RowLinear, resolve_tp, split_evenly
from mrv2.layers.norm import ShardedRMSNorm
from mrv2_kernels.chunk_delta_rule import gated_delta_rule_auto

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["LightningAttention", "MiniMaxForCausalLM", "layer_types_of", "slope_rates"]

LAYER_TYPES = ("linear_attention", "full_attention")
#: HF's lightning-attention buffers, saved in its checkpoints: recomputed here, never loaded.
_DECAY_BUFFERS = (".slope_rate", ".query_decay", ".key_decay", ".diagonal_decay")
#: The residual factors: HF's config field, then the original config's.
_FACTORS = {
    "full_attn": ("full_attn_{}_factor", "layernorm_full_attention_{}"),
    "linear_attn": ("linear_attn_{}_factor", "layernorm_linear_attention_{}"),
    "mlp": ("mlp_{}_factor", "layernorm_mlp_{}"),
}


def layer_types_of(config: Any) -> list[str]:
    """Each layer's mixer: the original configs' ``attn_type_list`` (0 lightning, 1 softmax)
    where present, else ``config.layer_types``; ValueError naming a bad list."""
    raw = getattr(config, "attn_type_list", None)
    if raw is not None:
        names = {0: "linear_attention", 1: "full_attention"}
        types = [names.get(int(t), str(t)) for t in raw]
    else:
        types = list(getattr(config, "layer_types", None) or [])
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad or len(types) != config.num_hidden_layers:
        raise ValueError(f"MiniMax: layer_types must list one of {list(LAYER_TYPES)} per layer "
                         f"({config.num_hidden_layers}); got {types}")
    return types


def residual_factors(config: Any, kind: str) -> tuple[float, float]:
    """``(alpha, beta)`` of ``kind`` (``full_attn``, ``linear_attn``, ``mlp``): the original
    config's ``layernorm_*`` field where present, else HF's ``*_factor`` (default 1)."""
    hf, original = _FACTORS[kind]
    out: list[float] = []
    for which in ("alpha", "beta"):
        value: Any = getattr(config, original.format(which), None)
        if value is None:
            value = getattr(config, hf.format(which), None)
        out.append(1.0 if value is None else float(value))
    return out[0], out[1]


def slope_rates(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """Every head's decay rate ``s_h`` in layer ``layer_idx`` (module docstring), fp32 on the
    host, computed as HF's ``get_slope_rate`` does (same operations, same rounding)."""
    base = 1 / (2 ** (8 / num_heads))
    exponent = (torch.arange(num_heads, device="cpu") + 1).to(torch.float32)
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return (base ** exponent) * factor  # (fp32 whatever the default dtype: the build's)


class LightningAttention(RequestStateLayer):
    """MiniMax's lightning attention (module docstring); HF's ``self_attn.*`` names. Keeps per
    request ``recurrent`` ``[H, D, D]`` (fp32) for this rank's ``H`` heads."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = resolve_tp(None)
        total = int(config.num_attention_heads)
        #: This rank's heads.
        self.num_heads = h = split_evenly(total, self.tp_size, "num_attention_heads")
        self.head_dim = d = head_dim_of(config)
        if config.hidden_act != "silu":
            raise ValueError(f"MiniMax: hidden_act must be 'silu' (lightning attention's and "
                             f"the experts' activation), got {config.hidden_act!r}")
        hidden = int(config.hidden_size)
        self.qkv_proj = ColumnLinear(hidden, 3 * total * d)
        self.output_gate = ColumnLinear(hidden, total * d)
        self.norm = ShardedRMSNorm(total * d, 1e-6, self.tp_rank * h * d, h * d)
        self.out_proj = RowLinear(total * d, hidden)
        self.layer_idx, self.num_layers = layer_idx, int(config.num_hidden_layers)
        #: This rank's heads' log decays ``-s_h``, fp32 (not in checkpoints).
        self.log_decay: torch.Tensor
        self.register_buffer("log_decay", self._log_decay(), persistent=False)

    def _log_decay(self) -> torch.Tensor:
        rates = slope_rates(self.num_heads * self.tp_size, self.layer_idx, self.num_layers)
        h, rank = self.num_heads, self.tp_rank
        return -rates[rank * h:(rank + 1) * h]

    def process_weights_after_loading(self) -> None:
        """The log decays computed again in fp32 on the weights' device: the loader's cast to
        the model dtype rounded them (and a model built on the meta device has none)."""
        self.log_decay = self._log_decay().to(self.out_proj.weight.device)

    def request_state_shapes(self) -> StateShapes:
        return {"recurrent": ((self.num_heads, self.head_dim, self.head_dim), torch.float32)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` (normed) -> ``[T, hidden]``; the step's requests' states advance."""
        st = self.step_states()
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        qkv = F.silu(self.qkv_proj(x)).view(t, h, 3 * d)
        q, k, v = (part.contiguous() for part in torch.split(qkv, d, dim=-1))
        g = self.log_decay.float().expand(t, h).contiguous()
        beta = torch.ones((t, h), dtype=v.dtype, device=v.device)
        out = gated_delta_rule_auto(
            q, k, v, g, beta, self.request_states["recurrent"], st.query_start_loc,
            st.seq_lens, st.rows, 1.0, l2norm_qk=False, delta=False, state_table=st.state_table,
            max_query_len=st.max_query_len, row_slots=st.row_slots)
        out = self.norm(out.reshape(t, h * d))
        out = torch.sigmoid(self.output_gate(x)) * out
        return cast(torch.Tensor, self.out_proj(out))


class MiniMaxLayer(nn.Module):
    """One layer (module docstring): ``self_attn`` (lightning or softmax), ``mlp`` (the MoE),
    ``input_layernorm`` and ``post_attention_layernorm``, the residual factors.

    ``forward`` returns ``(hidden, residual)`` whose sum is the layer's output (``beta_m
    moe(m)`` and ``alpha_m m``), added inside the next norm's kernel."""

    def __init__(self, config: Any, layer_idx: int, kind: str, cache_idx: int,
                 rope: RotaryEmbedding) -> None:
        super().__init__()
        self.linear = kind == "linear_attention"
        self.self_attn: nn.Module = (
            LightningAttention(config, layer_idx) if self.linear
            else SelfAttention(config, cache_idx, rope))
        self.attn_alpha, self.attn_beta = residual_factors(
            config, "linear_attn" if self.linear else "full_attn")
        self.mlp_alpha, self.mlp_beta = residual_factors(config, "mlp")
        experts, top_k = int(config.num_local_experts), int(config.num_experts_per_tok)
        hidden = int(config.hidden_size)
        self.mlp = MoEBlock(SoftmaxTopKRouter(hidden, experts, top_k, renormalize=True),
                            FusedMoE(experts, hidden, int(config.intermediate_size)))
        self.input_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            normed = cast(torch.Tensor, self.input_layernorm(hidden_states))
        else:
            normed, _ = self.input_layernorm(hidden_states, residual)
        if self.linear:
            out = self.self_attn(normed)
        else:
            attn = cast(SelfAttention, self.self_attn)
            out = attn.attend(positions, attn.qkv_proj(normed))
        normed, _ = self.post_attention_layernorm(_scaled(out, self.attn_beta),
                                                  _scaled(normed, self.attn_alpha))
        return _scaled(self.mlp(normed), self.mlp_beta), _scaled(normed, self.mlp_alpha)


def _scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x if factor == 1.0 else x * factor


class MiniMaxForCausalLM(CausalLM):
    """MiniMax-Text-01 / MiniMax-M1 in the mrv2 model contract (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        types = layer_types_of(config)
        if not bool(getattr(config, "postnorm", True)):
            raise ValueError("MiniMax: postnorm=False (residuals before the norms) is not "
                             "supported; HF's MiniMax and the published checkpoints use "
                             "postnorm=True")
        if getattr(config, "sliding_window", None) is not None:
            raise ValueError("MiniMax: sliding_window is not supported (HF would window every "
                             "softmax-attention layer); the published configs set none")
        shared = getattr(config, "shared_intermediate_size", None) or 0
        if (max(shared) if isinstance(shared, list) else int(shared)) > 0:
            raise ValueError("MiniMax: a shared expert (shared_intermediate_size > 0) is not "
                             "supported; MiniMax-Text-01 and M1 have none")
        for field in ("num_local_experts", "num_experts_per_tok"):
            if getattr(config, field, None) is None:
                raise ValueError(f"MiniMax: config.{field} is missing (a MoE in every layer)")
        head_dim = head_dim_of(config)
        rotary_dim = getattr(config, "rotary_dim", None)
        params = getattr(config, "rope_parameters", None) or {}
        if rotary_dim and "partial_rotary_factor" not in params and not getattr(
                config, "partial_rotary_factor", None):  # the original configs' own field
            config.partial_rotary_factor = int(rotary_dim) / head_dim
        rope = get_rope(config, head_dim)
        cache_idx = [types[:i].count("full_attention") for i in range(len(types))]
        super().__init__(config, DecoderModel(config, lambda i: MiniMaxLayer(
            config, i, types[i], cache_idx[i], rope)))

    def rename(self, name: str) -> str | None:
        """The published names (``block_sparse_moe`` for ``mlp``) as the model's; HF's saved
        lightning-attention decay buffers skipped (recomputed)."""
        if name.endswith(_DECAY_BUFFERS):
            return None
        return super().rename(name.replace(".block_sparse_moe.", ".mlp."))
