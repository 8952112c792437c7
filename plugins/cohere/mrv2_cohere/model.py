"""Cohere's Command models, as HF transformers' ``modeling_cohere`` / ``modeling_cohere2``:
``CohereForCausalLM`` (Command R, Command R+) and ``Cohere2ForCausalLM`` (Command R7B,
Command A).

- A parallel block: one norm (``input_layernorm``) feeds both the attention and the MLP, and
  the layer adds both to its input, ``x + attn(n) + mlp(n)`` with ``n = norm(x)``, summed in
  HF's order (``(x + attn) + mlp``; a layer hands on ``(x + attn, mlp)`` as the core's layers
  hand on ``(hidden, residual)``, and the next one, or the final norm, adds them).
- The norms are LayerNorms without a bias (mean subtracted, fp32 math, the weight multiplied
  in fp32: HF's ``CohereLayerNorm``, ``layer_norm_eps``), not RMSNorms: the core's
  :class:`~mrv2.layers.LayerNorm` (one kernel with the residual add); the fused norm + GEMV
  kernel of decode steps, an RMSNorm's, does not apply.
- RoPE over interleaved pairs ``(x0, x1), (x2, x3), ...`` of each head (HF's
  ``repeat_interleave`` cos/sin and pairwise ``rotate_half``; GPT-J's layout), where the core
  rotates halves ``(x_i, x_{i + d/2})``. As the q and k projections of a RoPE layer load,
  each head's output rows (weight, bias, per-row fp8 scales) are put in the halves order,
  even rows then odd (:func:`~mrv2.layers.rope_heads_to_halves`); q and k permuted alike
  keep their scores, v and o are untouched, and a LoRA adapter's ``B`` rows take the same order
  (``qkv_proj.row_order``). Checkpoint layouts that cannot be reordered by rows (GPTQ / AWQ
  packed integers) are refused by name.
- ``use_qk_norm`` (Command R+): q and k each normalized per head by a LayerNorm over
  ``head_dim`` with a weight of its own per head (``q_norm.weight`` ``[heads, head_dim]``),
  before the rotation; under tensor parallelism a rank keeps its heads' rows. Its columns
  take the same halves order (a LayerNorm does not mind the order of what it normalizes).
- ``Cohere2ForCausalLM``: the layers ``layer_types`` marks ``sliding_attention`` (HF's
  default: three in four, from ``sliding_window_pattern``) attend over the last
  ``sliding_window`` keys with RoPE; the others (``full_attention``) over every key with no
  position encoding at all (NoPE, their q/k rows kept as they are). No q/k norms.
- The logits are the LM head's times ``logit_scale`` (in the model dtype, as HF); the LM head
  is tied to the embedding per ``tie_word_embeddings`` (the published models tie it).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.layers import (
    CausalLM,
    DecoderModel,
    GatedMLP,
    LayerNorm,
    ParallelDecoderLayer,
    RMSNorm,
    SelfAttention,
    get_rope,
    head_dim_of,
    qk_rows_to_halves,
    qk_tensor_to_halves,
    rope_heads_to_halves,
    sliding_window_of,
)
from mrv2.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: A q/k tensor of a layer's attention, by its parameter name: (layer, q/k, proj or
#: layernorm, what).
_QK = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qk])_(proj|layernorm)\.(\w+)$")


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``CohereLayerNorm`` with a weight per head (:class:`HeadLayerNorm`'s) over the last
    dimension: ``(x - mean) / sqrt(var + eps)`` in
    fp32, times ``weight`` (broadcast over the leading dimensions) in fp32, in ``x``'s dtype;
    no bias. A weight of the last dimension's size and ``x``'s dtype goes to torch's layer
    norm whole (one kernel: it normalizes and scales in fp32 and rounds once, as HF)."""
    shape = (x.shape[-1],)
    if weight.shape == shape and weight.dtype == x.dtype:
        return F.layer_norm(x, shape, weight, None, eps)
    return (F.layer_norm(x.float(), shape, None, None, eps) * weight.float()).to(x.dtype)


class HeadLayerNorm(nn.Module):
    """Command R+'s q or k norm: a LayerNorm over each head's ``head_dim`` entries with each
    head's own weight; this rank's ``heads`` of the checkpoint's ``total_heads`` from head
    ``first`` (its weight ``[heads, head_dim]`` the rows of the checkpoint's ``[total_heads,
    head_dim]``). ``forward(x)``: ``x`` ``[T, heads * head_dim]`` -> normed, same shape."""

    def __init__(self, total_heads: int, head_dim: int, first: int, heads: int,
                 eps: float) -> None:
        super().__init__()
        self.total_heads, self.first, self.eps = total_heads, first, eps
        self.weight = nn.Parameter(torch.ones(heads, head_dim))
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        heads, head_dim = param.shape
        if loaded.numel() != self.total_heads * head_dim:
            raise ValueError(f"expects the whole q/k norm weight [{self.total_heads}, "
                             f"{head_dim}] (one row a head), got {tuple(loaded.shape)}")
        with torch.no_grad():
            whole = loaded.reshape(self.total_heads, head_dim)
            param.data.copy_(whole.narrow(0, self.first, heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        heads, head_dim = self.weight.shape
        normed = layer_norm(x.reshape(-1, heads, head_dim), self.weight, self.eps)
        return normed.reshape(x.shape)

    def extra_repr(self) -> str:
        heads, head_dim = self.weight.shape
        return (f"heads={heads} of {self.total_heads} from {self.first}, "
                f"head_dim={head_dim}, eps={self.eps}")


class CohereAttention(SelfAttention):
    """:class:`~mrv2.layers.SelfAttention` with Cohere's options (module docstring): biases
    per ``attention_bias``, RoPE (``rope``, its q/k rows reordered to halves as they load) or
    none, the per-head q/k LayerNorms where ``qk_norm`` (``q_layernorm`` / ``k_layernorm``:
    HF's ``q_norm`` / ``k_norm``)."""

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding | None,
                 qk_norm: bool) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_idx, rope, qkv_bias=bias, o_bias=bias)
        qkv = self.qkv_proj
        self.q_layernorm: HeadLayerNorm | None = None
        self.k_layernorm: HeadLayerNorm | None = None
        if qk_norm:
            eps, d = float(config.layer_norm_eps), self.head_dim
            self.q_layernorm = HeadLayerNorm(qkv.num_heads * qkv.tp_size, d,
                                             qkv.tp_rank * qkv.num_heads, qkv.num_heads, eps)
            self.k_layernorm = HeadLayerNorm(qkv.total_kv_heads, d, qkv.first_kv_head,
                                             qkv.num_kv_heads, eps)
        if rope is not None:
            qkv.row_order = functools.partial(qk_rows_to_halves, qkv)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """After the QKV projection: the q/k norms (unfused: the core fuses RMS norms only),
        the rotation (RoPE layers), attention, the output projection."""
        q, k, v = self.qkv_proj.split(qkv)
        if self.q_layernorm is not None and self.k_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        out = self.attn(q, k, v, positions=positions, rotary=self.rotary_emb)
        return cast(torch.Tensor, self.o_proj(out))

    def extra_repr(self) -> str:
        return ("rope" if self.rotary_emb is not None else "nope") + (
            ", qk_norm" if self.q_layernorm is not None else "")


class _Cohere(CausalLM):
    """What both Cohere models share (module docstring): the parallel blocks, the LayerNorms,
    the q/k rows of the RoPE layers reordered as they load, the scaled logits."""

    def __init__(self, config: PretrainedConfig, rope_layers: list[bool], qk_norm: bool,
                 mlp: Callable[[int], nn.Module] | None = None,
                 norm: Callable[[], LayerNorm | RMSNorm] | None = None) -> None:
        """``mlp(i)``: layer ``i``'s MLP (default: a gated MLP of ``intermediate_size``);
        ``norm()``: a hidden-state norm (default: the bias-free LayerNorm of
        ``layer_norm_eps``)."""
        head_dim = head_dim_of(config)
        rope = get_rope(config, head_dim) if any(rope_layers) else None
        eps = float(config.layer_norm_eps)

        def layer_norm() -> LayerNorm:
            return LayerNorm(config.hidden_size, eps=eps, bias=False)

        def dense(i: int) -> nn.Module:
            return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

        make_norm = norm or layer_norm
        make_mlp = mlp or dense

        def layer(i: int) -> ParallelDecoderLayer:
            attention = CohereAttention(config, i, rope if rope_layers[i] else None, qk_norm)
            return ParallelDecoderLayer(attention, make_mlp(i), make_norm, residual_last=False)

        model = DecoderModel(config, layer, norm=make_norm)
        super().__init__(config, model)
        scale = getattr(config, "logit_scale", None)
        #: What the LM head's logits are multiplied by (HF's ``logit_scale``; 1 where unset).
        self.logit_scale = 1.0 if scale is None else float(scale)
        self._head_dim = head_dim
        self._rope_layers = rope_layers
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        #: The whole q and k projections' output rows.
        self._qk_rows = {"q": heads * head_dim, "k": kv_heads * head_dim}

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The LM head's logits times ``logit_scale``."""
        logits = super().compute_logits(hidden_states)
        return logits * self.logit_scale if self.logit_scale != 1.0 else logits

    def rename(self, name: str) -> str | None:
        """HF's per-head ``self_attn.q_norm`` / ``k_norm`` as ``q_layernorm`` /
        ``k_layernorm``."""
        renamed = super().rename(name)
        if renamed is None:
            return None
        return renamed.replace(".self_attn.q_norm.", ".self_attn.q_layernorm.").replace(
            ".self_attn.k_norm.", ".self_attn.k_layernorm.")

    def _qk_tensor(self, name: str, kind: str, part: str, what: str, t: torch.Tensor
                   ) -> torch.Tensor:
        """A RoPE layer's q/k checkpoint tensor with each head's entries in the halves order:
        a projection's weight, bias and per-row scales by rows, a norm's weight by columns; a
        per-tensor scale, and block scales whose blocks hold whole heads, kept as they are."""
        rows, d = self._qk_rows[kind], self._head_dim
        if part == "layernorm":
            if t.numel() % d:
                raise ValueError(f"checkpoint tensor {name!r} {tuple(t.shape)}: expects "
                                 f"[heads, {d}]")
            return rope_heads_to_halves(t.reshape(-1), d).reshape(t.shape)
        return qk_tensor_to_halves(name, what, t, rows, d, "Cohere")

    def _convert(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            target = self.rename(name)
            m = _QK.match(target) if target is not None else None
            layer = int(m.group(1)) if m is not None else -1
            if m is not None and layer < len(self._rope_layers) and self._rope_layers[layer]:
                t = self._qk_tensor(name, m.group(2), m.group(3), m.group(4), t)
            yield name, t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors, the RoPE layers' q/k rows reordered as they stream (module
        docstring)."""
        return super().load_weights(self._convert(weights))


class CohereForCausalLM(_Cohere):
    """Command R / R+ in the mrv2 model contract: RoPE on every layer, per-head q/k
    LayerNorms per ``use_qk_norm`` (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        layers = int(config.num_hidden_layers)
        super().__init__(config, [True] * layers, bool(getattr(config, "use_qk_norm", False)))


class Cohere2ForCausalLM(_Cohere):
    """Command R7B / A in the mrv2 model contract: sliding-window layers with RoPE, global
    layers without (module docstring)."""

    def __init__(self, config: PretrainedConfig) -> None:
        layers = int(config.num_hidden_layers)
        local = [sliding_window_of(config, i) is not None for i in range(layers)]
        super().__init__(config, local, qk_norm=False)
