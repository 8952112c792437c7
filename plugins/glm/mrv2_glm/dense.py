"""GLM-4 dense models, as transformers models them: ``GlmForCausalLM`` (GLM-4-9B-chat-hf,
GLM-4-9B-hf) and ``Glm4ForCausalLM`` (GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1).

- Attention: GQA, q/k/v biased per ``attention_bias`` (the output projection never is), RoPE
  over the first ``head_dim * partial_rotary_factor`` dims of each head (0.5 in the published
  configs) in *interleaved* pairs ``(x0, x1), (x2, x3), ...`` (GPT-J's layout); the rest of
  the head passes through. The core rotates halves (``(x_i, x_{i + r/2})``), so as each q/k
  projection tensor loads, every head's first ``rotary_dim`` output rows (weight and bias) are
  put in the halves order, even rows then odd (:func:`~mrv2.layers.rope_heads_to_halves`):
  q and k move alike, so the scores are GLM's, and v / o are untouched. The whole checkpoint
  tensor is permuted before a rank takes its heads; a LoRA adapter's ``B`` rows take the same order
  (``qkv_proj.row_order``).
- MLP: SwiGLU of ``intermediate_size`` with gate and up stored as one ``mlp.gate_up_proj``
  (``[gate | up]``), cut into its parts as it loads so tensor parallelism splits each as
  usual.
- Block-FP8 checkpoints: the q/k weights' rows are moved as bytes with their per-row scales,
  block scales kept where each block holds whole heads; the fused gate/up tensor's block
  scales cut with it where no block holds rows of both halves. Other layouts of those tensors
  (GPTQ's, AWQ's) are refused by name.
- ``Glm4ForCausalLM`` adds a norm after the attention (``post_self_attn_layernorm``) and one
  after the MLP (``post_mlp_layernorm``), each before its residual add
  (:class:`Glm4DecoderLayer`); ``GlmForCausalLM`` is the plain pre-norm layer.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from mrv2.layers import (
    CausalLM,
    DecoderLayer,
    DecoderModel,
    GatedMLP,
    RMSNorm,
    RotaryEmbedding,
    SelfAttention,
    get_rope,
    head_dim_of,
    norm_mlp,
    qk_rows_to_halves,
    rope_heads_to_halves,
)
from mrv2.layers.linear import norm_linear
from mrv2_glm.model import partial_rotary_factor_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: A checkpoint tensor of a q or k projection: (``q`` / ``k``, what it is).
_QK = re.compile(r"\.self_attn\.([qk])_proj\.(\w+)$")
#: The fused gate/up projection's tensors.
_GATE_UP = ".mlp.gate_up_proj."


def validate_config(config: Any, arch: str) -> int:
    """Raise a ``ValueError`` naming the field if ``config`` is not a GLM-4 dense model this
    plugin runs; returns the rotated dims of each head."""

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise ValueError(f"{arch}: config.{field} = {getattr(config, field, None)!r}: {what}")

    need(config.hidden_act == "silu", "hidden_act", "the MLP supports 'silu' only")
    kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    need(config.num_attention_heads % kv_heads == 0, "num_key_value_heads",
         f"must divide num_attention_heads ({config.num_attention_heads})")
    head_dim = head_dim_of(config)
    rotary_dim = int(head_dim * partial_rotary_factor_of(config))
    need(0 < rotary_dim <= head_dim and rotary_dim % 2 == 0, "partial_rotary_factor",
         f"head_dim ({head_dim}) x partial_rotary_factor must be an even number of dims in "
         f"(0, head_dim], got {rotary_dim}")
    return rotary_dim


class Glm4DecoderLayer(nn.Module):
    """GLM-4-0414's layer (HF's names): ``input_layernorm``, ``self_attn``,
    ``post_self_attn_layernorm``, residual add; ``post_attention_layernorm``, ``mlp``,
    ``post_mlp_layernorm``, residual add. The input norm runs fused with the QKV projection,
    the residual adds fused into the next norm (the residual stream passed on as
    ``(hidden, residual)``, as the core's layers pass theirs)."""

    def __init__(self, config: Any, self_attn: SelfAttention, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps=eps)
        self.post_self_attn_layernorm = RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps=eps)
        self.post_mlp_layernorm = RMSNorm(hidden, eps=eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = norm_linear(self.input_layernorm, self.self_attn.qkv_proj,
                                    hidden_states, residual)
        attn = self.post_self_attn_layernorm(self.self_attn.attend(positions, qkv))
        out, residual = norm_mlp(self.post_attention_layernorm, self.mlp, attn, residual)
        return self.post_mlp_layernorm(out), residual


class _GlmDense(CausalLM):
    """What both GLM-4 dense models share (module docstring); ``sandwich``: GLM-4-0414's extra
    norms."""

    sandwich: ClassVar[bool] = False

    def __init__(self, config: PretrainedConfig) -> None:
        arch = type(self).__name__
        self._rotary_dim = validate_config(config, arch)
        self._head_dim = head_dim = head_dim_of(config)
        rope = self.make_rope(config, head_dim, self._rotary_dim)
        bias = bool(getattr(config, "attention_bias", True))
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        #: The whole q and k projections' output rows; gate / up rows of the fused tensor.
        self._qk_rows = {"q": heads * head_dim, "k": kv_heads * head_dim}
        self._gate_up = int(config.intermediate_size)

        def layer(i: int) -> nn.Module:
            attention = SelfAttention(config, i, rope, qkv_bias=bias, o_bias=False)
            qkv = attention.qkv_proj
            qkv.row_order = functools.partial(qk_rows_to_halves, qkv,
                                              rotary_dim=self._rotary_dim, leading=True)
            mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
            if self.sandwich:
                return Glm4DecoderLayer(config, attention, mlp)
            return DecoderLayer(config, attention, mlp)

        super().__init__(config, DecoderModel(config, layer))

    @classmethod
    def make_rope(cls, config: Any, head_dim: int, rotary_dim: int) -> RotaryEmbedding:
        """The RoPE every layer shares (``rotary_dim`` of each head's dims rotated, in the
        halves order the q/k rows are put in): the config's 1-D RoPE (GLM-4.1V: M-RoPE)."""
        return get_rope(config, head_dim)

    def _qk_tensor(self, name: str, kind: str, what: str, t: torch.Tensor) -> torch.Tensor:
        """A q/k projection's checkpoint tensor with each head's rotary rows in the halves
        order: the weight (fp8 moved as bytes), the bias and per-row scales permuted; a
        per-tensor scale, and block scales whose blocks hold whole heads, kept as they are."""
        rows, d = self._qk_rows[kind], self._head_dim
        if what in ("weight", "bias", "weight_scale", "weight_scale_inv") and (
                t.dim() >= 1 and t.shape[0] == rows):
            return rope_heads_to_halves(t, d, self._rotary_dim, leading=True)
        if what.endswith("scale") and t.numel() == 1 or (
                what == "weight_scale_inv" and t.dim() == 2 and -(-rows // t.shape[0]) % d == 0):
            return t  # (no row leaves its block)
        raise ValueError(f"checkpoint tensor {name!r} {tuple(t.shape)}: GLM-4 reorders the q/k "
                         f"projections' {rows} rows for its interleaved RoPE, which this "
                         f"tensor's layout does not allow (a quantized format?)")

    def _gate_up_parts(self, name: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused ``[gate | up]`` tensor's two halves: weight / bias rows, fp8 block scales
        where no block holds rows of both, a per-tensor scale for each."""
        inter = self._gate_up
        if name.endswith("_scale") and t.numel() == 1:
            return t, t  # (a per-tensor scale: both halves')
        if name.endswith("weight_scale_inv") and t.dim() == 2 and t.shape[0] > 1:
            block = -(-2 * inter // t.shape[0])
            if inter % block == 0:
                return t[: inter // block], t[inter // block:]
        elif name.endswith((".weight", ".bias")) and t.shape[0] == 2 * inter:
            return t[:inter], t[inter:]
        raise ValueError(f"checkpoint tensor {name!r} {tuple(t.shape)}: the config's gate/up "
                         f"projections need {2 * inter} rows (whole fp8 blocks in each)")

    def _convert(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in weights:
            m = _QK.search(name)
            if m is not None:
                yield name, self._qk_tensor(name, m.group(1), m.group(2), t)
            elif _GATE_UP in name:
                gate, up = self._gate_up_parts(name, t)
                yield name.replace(_GATE_UP, ".mlp.gate_proj."), gate
                yield name.replace(_GATE_UP, ".mlp.up_proj."), up
            else:
                yield name, t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors, the q/k rows put in the halves order and the fused
        ``gate_up_proj`` cut into its parts as they stream (module docstring)."""
        return super().load_weights(self._convert(weights))


class GlmForCausalLM(_GlmDense):
    """GLM-4-9B-chat-hf / GLM-4-9B-hf causal LM in the mrv2 model contract: pre-norm layers
    (module docstring)."""

    sandwich = False


class Glm4ForCausalLM(_GlmDense):
    """GLM-4-0414 / GLM-Z1 causal LM in the mrv2 model contract: each sublayer's output
    normed again before its residual add (:class:`Glm4DecoderLayer`)."""

    sandwich = True
