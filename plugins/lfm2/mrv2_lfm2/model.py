"""Liquid AI's LFM2 (``Lfm2ForCausalLM``: LFM2-350M, 700M, 1.2B, 2.6B): a stack of pre-norm
layers, each

    h = h + operator(operator_norm(h));  h = h + feed_forward(ffn_norm(h))

with one operator per ``config.layer_types`` (older configs: the ``full_attn_idxs`` list, every
other layer a convolution; neither: every layer attention, as transformers 5.17 reads them):

* ``"conv"``: the gated short convolution (:class:`ShortConv`, HF's ``Lfm2ShortConv``):
  ``in_proj`` gives ``B``, ``C`` and ``x`` (``hidden_size`` channels each); ``B * x`` goes
  through a causal depthwise convolution of width ``conv_L_cache`` (no activation), the
  result is gated by ``C`` and projected by ``out_proj``; biases on all three per
  ``conv_bias``. It is a Mamba-2 mixer's convolution without the scan: the core's
  :func:`~mrv2_kernels.linear_attention.causal_conv1d` with its per-request state (the last
  ``conv_L_cache - 1`` inputs, :mod:`mrv2.contract.request_state`), so prefix caching keeps
  snapshots of it and speculative decoding keeps it after each token of a verify step, as
  for the other hybrid families.
* ``"full_attention"``: grouped-query attention with RoPE (``rope_parameters``), per-head
  RMSNorms on the queries and keys before the rotation (``q_layernorm`` / ``k_layernorm``),
  scale ``head_dim ** -0.5``, no biases; the output projection is HF's ``out_proj``.

The feed-forward is a SwiGLU (``w2(silu(w1(x)) * w3(x))``) whose width is HF's
(:func:`ff_dim_of`): with ``block_auto_adjust_ff_dim``, ``int(2 * intermediate_size / 3)``,
then (only where ``block_ffn_dim_multiplier`` is set) times the multiplier and rounded up to
``block_multiple_of``. vLLM rounds up to ``block_multiple_of`` even without a multiplier; the
checkpoints are saved by transformers, whose sizing this follows. Every RMSNorm uses
``norm_eps``; the final norm is HF's ``embedding_norm``; the LM head is tied to the embedding
by default (``tie_embedding`` / ``tie_word_embeddings``).

Tensor parallelism: the convolution by channels (``hidden_size`` divisible by the ranks: each
rank projects, convolves and gates its slice of ``B``, ``C`` and ``x``, all-reduces after
``out_proj``), the attention by heads, the MLP by columns.

LFM2-MoE (:mod:`mrv2_lfm2.moe`) is these layers with other feed-forwards
(:meth:`Lfm2ForCausalLM.feed_forward_of`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from mrv2.contract.request_state import RequestStateLayer, StateShapes
from mrv2.layers import (
    CausalLM,
    DecoderModel,
    GatedMLP,
    RMSNorm,
    RowLinear,
    SelfAttention,
    get_rope,
    head_dim_of,
    norm_linear,
    norm_mlp,
)
from mrv2.layers.linear import resolve_tp, split_evenly
from mrv2.layers.mamba import InProj
from mrv2.layers.rotary import RotaryEmbedding
from mrv2_kernels.linear_attention import causal_conv1d

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FAMILY = "LFM2"
#: ``layer_types`` values and the operator each names (``short_conv``: a spelling some
#: converted configs use for ``conv``).
LAYER_KINDS = {"full_attention": "full_attention", "conv": "conv", "short_conv": "conv"}


def layer_types_of(config: Any) -> list[str]:
    """Each layer's operator, ``"full_attention"`` or ``"conv"``: ``layer_types``, else from
    ``full_attn_idxs`` (every layer attention where both are unset, as transformers 5.17
    reads such a config); ValueError naming the field for an unknown kind or a list of the
    wrong length."""
    count = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None)
    if types is None:
        idxs = getattr(config, "full_attn_idxs", None)
        attn = set(range(count)) if idxs is None else {int(i) for i in idxs}
        types = ["full_attention" if i in attn else "conv" for i in range(count)]
    types = list(types)
    if len(types) != count:
        raise ValueError(f"{FAMILY}: layer_types lists {len(types)} layers, num_hidden_layers "
                         f"is {count}")
    bad = sorted({str(t) for t in types if t not in LAYER_KINDS})
    if bad:
        raise ValueError(f"{FAMILY}: layer_types must list one of {sorted(LAYER_KINDS)} per "
                         f"layer, got {bad}")
    return [LAYER_KINDS[t] for t in types]


def ff_dim_of(config: Any) -> int:
    """The feed-forward's width as transformers 5.17's ``Lfm2MLP`` sizes it (module
    docstring); ValueError unless positive."""
    dim = int(config.intermediate_size)
    if getattr(config, "block_auto_adjust_ff_dim", True):
        dim = int(2 * dim / 3)
        multiplier = getattr(config, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            multiple = int(getattr(config, "block_multiple_of", 256))
            if multiple < 1:
                raise ValueError(f"{FAMILY}: block_multiple_of must be at least 1, got "
                                 f"{multiple}")
            dim = int(float(multiplier) * dim)
            dim = multiple * ((dim + multiple - 1) // multiple)
    if dim < 1:
        raise ValueError(f"{FAMILY}: the feed-forward width (intermediate_size "
                         f"{config.intermediate_size} after block_auto_adjust_ff_dim) must be "
                         f"at least 1, got {dim}")
    return dim


def shape_of(config: Any) -> SimpleNamespace:
    """The fields the core's decoder pieces read, ``rms_norm_eps`` from LFM2's ``norm_eps``
    (RoPE reads the config itself: :func:`~mrv2.layers.get_rope`)."""
    heads = int(config.num_attention_heads)
    return SimpleNamespace(
        vocab_size=int(config.vocab_size), hidden_size=int(config.hidden_size),
        num_hidden_layers=int(config.num_hidden_layers), num_attention_heads=heads,
        num_key_value_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=head_dim_of(config), rms_norm_eps=float(config.norm_eps))


class ShortConv(RequestStateLayer):
    """LFM2's gated short convolution (module docstring) over ``hidden_size`` channels of a
    width ``kernel``: ``out_proj(C * conv(B * x))``, ``[B | C | x] = in_proj(h)``. Keeps per
    request ``conv`` ``[kernel - 1, channels]`` (model dtype), this rank's channels.

    Checkpoint names are HF's: ``in_proj``, ``conv.weight`` ``[hidden, 1, kernel]`` /
    ``conv.bias`` (the family's ``rename`` sends them to :attr:`conv_weight` /
    :attr:`conv_bias`), ``out_proj``."""

    def __init__(self, hidden_size: int, kernel: int, bias: bool) -> None:
        super().__init__()
        if kernel < 2:
            raise ValueError(f"{FAMILY}: conv_L_cache must be at least 2, got {kernel}")
        self.tp_rank, self.tp_size = resolve_tp(None)
        #: This rank's channels of each of ``B``, ``C``, ``x``.
        self.channels = split_evenly(hidden_size, self.tp_size,
                                     f"{FAMILY}'s hidden_size (the short convolution's "
                                     f"channels)")
        self.kernel_size = int(kernel)
        self.in_proj = InProj(hidden_size, [hidden_size] * 3, bias=bias)
        self.conv_weight = nn.Parameter(torch.empty(self.channels, self.kernel_size))
        self.conv_weight.weight_loader = self._load_conv  # type: ignore[attr-defined]
        self.conv_bias: nn.Parameter | None = None
        if bias:
            self.conv_bias = nn.Parameter(torch.zeros(self.channels))
            self.conv_bias.weight_loader = self._load_conv  # type: ignore[attr-defined]
        self.out_proj = RowLinear(hidden_size, hidden_size, bias=bias)

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """The depthwise Conv1d weight ``[hidden, 1, kernel]`` (or ``[hidden, kernel]``) or
        its bias ``[hidden]``: this rank's channels."""
        src = loaded.reshape(loaded.shape[0], -1) if loaded.dim() == 3 else loaded
        whole = self.channels * self.tp_size
        if src.shape[0] != whole or tuple(src.shape[1:]) != tuple(param.shape[1:]):
            raise ValueError(f"{FAMILY}: conv.conv has shape {tuple(loaded.shape)}, expected "
                             f"{(whole, 1, self.kernel_size) if param.dim() == 2 else (whole,)}")
        with torch.no_grad():
            param.copy_(src.narrow(0, self.tp_rank * self.channels, self.channels))

    def request_state_shapes(self) -> StateShapes:
        """``conv``: the convolution's last ``kernel - 1`` inputs (``B * x``)."""
        return {"conv": ((self.kernel_size - 1, self.channels), None)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` (normed) -> ``[T, hidden]``; the step's requests' states advance."""
        return self.mix(cast(torch.Tensor, self.in_proj(x)))

    def mix(self, proj: torch.Tensor) -> torch.Tensor:
        """After ``in_proj`` (``[T, B | C | x]``, e.g. fused with the norm before it): gate,
        convolve, gate, project."""
        st = self.step_states()
        b, c, x = proj.split(self.channels, dim=-1)
        y = causal_conv1d(b * x, self.conv_weight, self.conv_bias,
                          self.request_states["conv"], st.query_start_loc, st.seq_lens,
                          st.rows, None, state_table=st.state_table, row_slots=st.row_slots)
        return cast(torch.Tensor, self.out_proj(c * y))

    def extra_repr(self) -> str:
        return f"channels={self.channels}, kernel={self.kernel_size}"


class Lfm2Layer(nn.Module):
    """One LFM2 layer (module docstring): ``operator_norm``, then ``conv`` or ``self_attn``,
    then ``ffn_norm`` and ``feed_forward`` (the module given: LFM2's SwiGLU, or LFM2-MoE's
    dense SwiGLU or MoE block); the residual add fused into the next norm, as the core's
    decoder layers do (HF keeps the residual stream in the model dtype too)."""

    def __init__(self, config: Any, kind: str, cache_idx: int,
                 rope: RotaryEmbedding | None, feed_forward: nn.Module) -> None:
        super().__init__()
        shape = shape_of(config)
        eps = shape.rms_norm_eps
        self.kind = kind
        self.operator_norm = RMSNorm(shape.hidden_size, eps=eps)
        self.ffn_norm = RMSNorm(shape.hidden_size, eps=eps)
        self.conv: ShortConv | None = None
        self.self_attn: SelfAttention | None = None
        if kind == "conv":
            self.conv = ShortConv(shape.hidden_size, int(config.conv_L_cache),
                                  bool(getattr(config, "conv_bias", False)))
        else:
            self.self_attn = SelfAttention(shape, cache_idx, rope, qk_norm=True)
        self.feed_forward = feed_forward

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden_states, residual)`` in and out; the operator norm runs fused with the
        projection after it (a decode step's norm + GEMV kernel)."""
        if self.conv is not None:
            proj, residual = norm_linear(self.operator_norm, self.conv.in_proj, hidden_states,
                                         residual)
            out = self.conv.mix(proj)
        else:
            attn = cast(SelfAttention, self.self_attn)
            qkv, residual = norm_linear(self.operator_norm, attn.qkv_proj, hidden_states,
                                        residual)
            out = attn.attend(positions, qkv)
        return norm_mlp(self.ffn_norm, self.feed_forward, out, residual)


class Lfm2ForCausalLM(CausalLM):
    """LFM2 in the mrv2 model contract (module docstring)."""

    #: HF's names inside a layer -> the core's.
    RENAMES = ((".self_attn.out_proj.", ".self_attn.o_proj."),
               (".self_attn.q_layernorm.", ".self_attn.q_norm."),
               (".self_attn.k_layernorm.", ".self_attn.k_norm."),
               (".feed_forward.w1.", ".feed_forward.gate_proj."),
               (".feed_forward.w3.", ".feed_forward.up_proj."),
               (".feed_forward.w2.", ".feed_forward.down_proj."),
               (".conv.conv.weight", ".conv.conv_weight"),
               (".conv.conv.bias", ".conv.conv_bias"))

    def __init__(self, config: PretrainedConfig) -> None:
        types = layer_types_of(config)
        shape = shape_of(config)
        rope = get_rope(config, shape.head_dim) if "full_attention" in types else None
        cache_idx = [types[:i].count("full_attention") for i in range(len(types))]
        model = DecoderModel(shape, lambda i: Lfm2Layer(
            config, types[i], cache_idx[i], rope, self.feed_forward_of(config, i)))
        super().__init__(config, model)
        self.layer_types = types

    @classmethod
    def feed_forward_of(cls, config: Any, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward: LFM2's SwiGLU of :func:`ff_dim_of` (a
        subclass, LFM2-MoE, gives its own per layer)."""
        return GatedMLP(int(config.hidden_size), ff_dim_of(config), "silu")

    def rename(self, name: str) -> str | None:
        """HF's names onto this model's: ``model.embedding_norm`` (the final norm) -> the
        core's ``model.norm``, and the layers' (:attr:`RENAMES`)."""
        if name.startswith("model.embedding_norm."):
            name = "model.norm." + name[len("model.embedding_norm."):]
        for old, new in self.RENAMES:
            if old in name:
                name = name.replace(old, new)
        return super().rename(name)
