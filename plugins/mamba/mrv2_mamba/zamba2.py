"""Zyphra's Zamba2 (``Zamba2ForCausalLM``: Zamba2-1.2B, 2.7B, 7B, their -instruct versions):
Mamba-2 layers, some of them (``hybrid_layer_ids``, HF's ``"hybrid"`` entries of
``layers_block_type``) preceded by an invocation of one of ``num_mem_blocks`` SHARED
transformer blocks (invocation ``j`` runs block ``j % num_mem_blocks``):

    mamba layer:   h = h + mamba(input_layernorm(h))
    hybrid layer:  x = input_layernorm(concat(h, e))          # e: the token embeddings
                   t = feed_forward(pre_ff_layernorm(self_attn(x)))  # the shared block
                   h = h + mamba(input_layernorm(h + linear(t)))

as transformers 5.17's ``Zamba2HybridLayer`` / ``Zamba2AttentionDecoderLayer`` (the shared
block has no residual of its own; its output only enters the Mamba layer's input).

* ``mamba``: the core's Mamba-2 mixer (:class:`~mrv2.layers.Mamba2Mixer`) of ``n_mamba_heads``
  heads (``mamba_expand * hidden_size`` channels), ``mamba_ngroups`` B/C groups of
  ``mamba_d_state``, a biased convolution of width ``mamba_d_conv`` then SiLU, ``dt`` clamped
  below at ``time_step_min`` (HF's full forward; its one-token step does not clamp), the gated
  RMSNorm per group (gate first, epsilon 1e-5 as HF), biases on ``in_proj`` / ``out_proj``
  per ``add_bias_linear``.
* ``self_attn`` (shared): attention over ``2 * hidden_size`` input channels,
  ``num_attention_heads`` heads of ``2 * hidden_size / num_attention_heads``, scaled by
  ``(head_dim / 2) ** -0.5``, RoPE (``rope_parameters``) only with ``use_mem_rope``. With
  ``use_shared_attention_adapter`` each invocation adds its own low-rank adapters
  (``linear_{q,k,v}_adapter_list.{j}``: ``B(A(x))`` of rank ``adapter_rank``) to the shared
  q, k and v projections. Each invocation has its own KV cache layer (its keys differ).
* ``feed_forward`` (shared): ``down_proj(act(gate) * up)`` with ``[gate | up] =
  gate_up_proj(x) + B(A(x))``, the adapter ``gate_up_proj_adapter_list.{j}`` per invocation
  (HF builds it whatever ``use_shared_mlp_adapter`` says; false is refused), ``hidden_act``
  elementwise (Zamba2: exact GELU).
* ``linear``: per invocation, ``hidden_size`` to ``hidden_size``, no bias.

Checkpoint names: HF's (``model.layers.{i}.mamba.*`` / ``input_layernorm``, a hybrid layer's
``mamba_decoder.*``, ``linear`` and ``shared_transformer.*``, ``model.final_layernorm``). Each
block's weights are held once (``model.shared_blocks.{b}``); every hybrid layer's
``shared_transformer.*`` copy loads into its block (transformers saves only the first). With
``tie_word_embeddings`` false transformers 5.17 ties nothing, the blocks included: each hybrid
layer then runs its own copy (saved under its own name), as HF does. Tensor
parallelism: the mixers by heads, the attention by heads (the adapters' ``B`` by the same
rows), the MLP by columns.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from mrv2.layers import CausalLM, DecoderModel, Mamba2Mixer, RMSNorm, get_rope, norm_linear
from mrv2.layers.activation import DENSE_ACTIVATIONS, dense_activation
from mrv2.layers.attention import Attention
from mrv2.layers.linear import (
    ColumnLinear,
    LinearBase,
    MergedColumnLinear,
    QKVLinear,
    RowLinear,
    resolve_tp,
)
from mrv2.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FAMILY = "Zamba2"
KINDS = ("mamba", "hybrid")
#: HF's older ``layers_block_type`` names.
LEGACY_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "hybrid": "hybrid"}


def layer_kinds_of(config: Any) -> list[str]:
    """Each layer's kind, ``"mamba"`` or ``"hybrid"``; ValueError naming the field unless
    ``layers_block_type`` lists one per layer."""
    layers = int(config.num_hidden_layers)
    raw = [str(k) for k in config.layers_block_type]
    if len(raw) != layers or any(k not in LEGACY_KINDS for k in raw):
        raise ValueError(f"{FAMILY}: layers_block_type must list 'mamba' / 'linear_attention' "
                         f"or 'hybrid' for each of the {layers} layers, got {raw}")
    return [LEGACY_KINDS[k] for k in raw]


def check_config(config: Any) -> None:
    """What this model cannot run, refused naming the field."""
    if getattr(config, "use_shared_mlp_adapter", True) is False:
        raise ValueError(f"{FAMILY}: use_shared_mlp_adapter is false, but transformers builds "
                         f"and runs the shared MLP's adapters whatever it says: such a "
                         f"checkpoint is not supported")
    act = str(config.hidden_act)
    if act not in DENSE_ACTIVATIONS:
        raise ValueError(f"{FAMILY}: hidden_act (the shared MLP's) must be one of "
                         f"{sorted(DENSE_ACTIVATIONS)}, got {act!r}")
    heads = int(config.num_attention_heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    if bool(config.use_shared_attention_adapter) and kv != heads:
        raise ValueError(f"{FAMILY}: with use_shared_attention_adapter the k/v adapters are "
                         f"as wide as the queries: num_key_value_heads ({kv}) must equal "
                         f"num_attention_heads ({heads})")
    if (2 * int(config.hidden_size)) % heads:
        raise ValueError(f"{FAMILY}: 2 * hidden_size ({2 * config.hidden_size}) must be a "
                         f"multiple of num_attention_heads ({heads})")
    if int(config.num_mem_blocks) < 1:
        raise ValueError(f"{FAMILY}: num_mem_blocks must be at least 1, got "
                         f"{config.num_mem_blocks}")


def zamba2_mixer(config: Any) -> Mamba2Mixer:
    """The core's Mamba-2 mixer from Zamba2's ``mamba_*`` fields (module docstring)."""
    hidden = int(config.hidden_size)
    heads, groups = int(config.n_mamba_heads), int(config.mamba_ngroups)
    intermediate = int(config.mamba_expand * hidden)
    if intermediate % heads:
        raise ValueError(f"{FAMILY}: mamba_expand * hidden_size ({intermediate}) must be a "
                         f"multiple of n_mamba_heads ({heads})")
    if groups < 1 or heads % groups:
        raise ValueError(f"{FAMILY}: n_mamba_heads ({heads}) must be a multiple of "
                         f"mamba_ngroups ({groups})")
    _, size = resolve_tp(None)
    if (groups % size and size % groups) or 1 < groups < size:
        raise ValueError(f"{FAMILY}: mamba_ngroups ({groups}) must be divisible by "
                         f"tensor_parallel_size ({size}), or 1")
    bias = bool(getattr(config, "add_bias_linear", False))
    return Mamba2Mixer(
        hidden, heads, intermediate // heads, groups, int(config.mamba_d_state),
        int(config.mamba_d_conv), "silu", dt_min=float(config.time_step_min),
        proj_bias=bias, conv_bias=True, norm_eps=1e-5, norm_per_group=True,
        out_proj_bias=bias)


def tied_blocks(config: Any) -> bool:
    """Whether the hybrid layers share their blocks: transformers 5.17 ties them (and the LM
    head) only with ``tie_word_embeddings`` (every published checkpoint); else each hybrid
    layer keeps its own copy, saved under its own name, as HF runs it."""
    return bool(getattr(config, "tie_word_embeddings", True))


def shared_block_count(config: Any, invocations: int) -> int:
    """How many distinct blocks the model holds (module docstring, :func:`tied_blocks`)."""
    return min(int(config.num_mem_blocks), invocations) if tied_blocks(config) else invocations


def block_of(config: Any, invocation: int) -> int:
    """The held block that invocation ``invocation`` runs."""
    return invocation % int(config.num_mem_blocks) if tied_blocks(config) else invocation


class WholeGateUp(MergedColumnLinear):
    """``[gate | up]`` (two equal shards) that also loads a checkpoint's fused tensor whole
    (HF Zamba2's ``gate_up_proj`` and its adapters' ``B``), each half to its shard."""

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        if shard_id is not None:
            super().weight_loader(param, loaded, shard_id)
            return
        if loaded.shape[0] % 2:
            raise ValueError(f"a fused [gate | up] tensor needs an even row count, got "
                             f"{tuple(loaded.shape)}")
        for i, half in enumerate(loaded.chunk(2, dim=0)):
            super().weight_loader(param, half, i)


def adapter(input_size: int, rank: int, out: LinearBase) -> nn.Sequential:
    """A low-rank adapter ``B(A(x))`` in HF's layout (``0``: ``A``, replicated; ``1``:
    ``B``, split like the projection it adds to)."""
    return nn.Sequential(LinearBase(input_size, rank), out)


def adapter_list(config: Any, block: int, make: Any) -> nn.ModuleList:
    """One slot per invocation of any block (HF's layout): this block's invocations get
    ``make()``, the others an ``Identity``."""
    blocks, count = int(config.num_mem_blocks), len(config.hybrid_layer_ids)
    return nn.ModuleList(make() if j % blocks == block else nn.Identity()
                         for j in range(count))


class SharedAttention(nn.Module):
    """The shared block's attention weights (module docstring); each invocation brings its
    own KV cache layer to :meth:`forward`."""

    def __init__(self, config: Any, block: int) -> None:
        super().__init__()
        width = 2 * int(config.hidden_size)
        heads = int(config.num_attention_heads)
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        self.head_dim = width // heads
        self.qkv_proj = QKVLinear(width, self.head_dim, heads, kv)
        self.o_proj = RowLinear(heads * self.head_dim, int(config.hidden_size))
        self.adapters = bool(config.use_shared_attention_adapter)
        if self.adapters:
            rank = int(config.adapter_rank)
            for part in "qkv":
                setattr(self, f"linear_{part}_adapter_list", adapter_list(
                    config, block, lambda: adapter(width, rank, ColumnLinear(rank, width))))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, invocation: int,
                attn: Attention, rope: RotaryEmbedding | None) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        if self.adapters:
            q, k, v = (t + cast(nn.ModuleList, getattr(self, f"linear_{p}_adapter_list")
                                )[invocation](x) for t, p in zip((q, k, v), "qkv", strict=True))
        return cast(torch.Tensor, self.o_proj(attn(q, k, v, positions=positions,
                                                   rotary=rope)))


class SharedMLP(nn.Module):
    """The shared block's gated MLP with per-invocation ``gate_up`` adapters."""

    def __init__(self, config: Any, block: int) -> None:
        super().__init__()
        hidden, inter = int(config.hidden_size), int(config.intermediate_size)
        bias = bool(getattr(config, "add_bias_linear", False))
        rank = int(config.adapter_rank)
        self.gate_up_proj = WholeGateUp(hidden, [inter, inter], bias=bias)
        self.down_proj = RowLinear(inter, hidden, bias=bias)
        self.act_fn = dense_activation(str(config.hidden_act))
        self.gate_up_proj_adapter_list = adapter_list(
            config, block, lambda: adapter(hidden, rank, WholeGateUp(rank, [inter, inter])))

    def forward(self, x: torch.Tensor, invocation: int) -> torch.Tensor:
        gate_up = self.gate_up_proj(x) + self.gate_up_proj_adapter_list[invocation](x)
        gate, up = gate_up.chunk(2, dim=-1)
        return cast(torch.Tensor, self.down_proj(self.act_fn(gate) * up))


class SharedBlock(nn.Module):
    """One shared transformer block (HF's ``Zamba2AttentionDecoderLayer``'s weights)."""

    def __init__(self, config: Any, block: int) -> None:
        super().__init__()
        eps = float(config.rms_norm_eps)
        self.input_layernorm = RMSNorm(2 * int(config.hidden_size), eps=eps)
        self.self_attn = SharedAttention(config, block)
        self.pre_ff_layernorm = RMSNorm(int(config.hidden_size), eps=eps)
        self.feed_forward = SharedMLP(config, block)


class MambaLayer(nn.Module):
    """``h = h + mamba(input_layernorm(h))`` (HF's ``Zamba2MambaDecoderLayer``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(int(config.hidden_size), eps=float(config.rms_norm_eps))
        self.mamba = zamba2_mixer(config)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden_states, residual)`` in and out, as the core's decoder layers."""
        proj, residual = norm_linear(self.input_layernorm, self.mamba.in_proj, hidden_states,
                                     residual)
        return self.mamba.mix(proj), residual


class HybridLayer(nn.Module):
    """A shared block's invocation ``invocation`` then a Mamba layer (module docstring): the
    block (held by the model, not here), this invocation's ``linear`` and KV cache layer."""

    def __init__(self, config: Any, block: SharedBlock, invocation: int,
                 rope: RotaryEmbedding | None) -> None:
        super().__init__()
        self._block = (block,)  # (not a submodule: the model holds it once)
        self.invocation = invocation
        self.rope = rope
        attn = block.self_attn
        heads, kv = attn.qkv_proj.num_heads, attn.qkv_proj.num_kv_heads
        self.attn = Attention(heads, kv, attn.head_dim, (attn.head_dim / 2) ** -0.5,
                              invocation)
        hidden = int(config.hidden_size)
        self.linear = LinearBase(hidden, hidden)
        self.mamba_decoder = MambaLayer(config)

    @property
    def block(self) -> SharedBlock:
        """The shared block this layer invokes."""
        return self._block[0]

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None, embeddings: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden_states, residual)`` in and out; ``embeddings``: the token embeddings."""
        block = self.block
        stream = hidden_states if residual is None else hidden_states + residual
        x = cast(torch.Tensor, block.input_layernorm(torch.cat([stream, embeddings], dim=-1)))
        t = block.self_attn(positions, x, self.invocation, self.attn, self.rope)
        t = cast(torch.Tensor, block.pre_ff_layernorm(t))
        t = self.linear(block.feed_forward(t, self.invocation))
        decoder = self.mamba_decoder
        proj, _ = norm_linear(decoder.input_layernorm, decoder.mamba.in_proj, stream + t, None)
        return decoder.mamba.mix(proj), stream


class Zamba2Model(DecoderModel):
    """The core's decoder model whose forward hands the hybrid layers the token embeddings;
    ``shared_blocks``: the ``num_mem_blocks`` shared transformer blocks (one per invocation
    where transformers unties them: :func:`tied_blocks`)."""

    def __init__(self, config: Any, kinds: list[str]) -> None:
        count = kinds.count("hybrid")
        blocks = [SharedBlock(config, b % int(config.num_mem_blocks))
                  for b in range(shared_block_count(config, count))]
        rope = get_rope(config, blocks[0].self_attn.head_dim) \
            if bool(config.use_mem_rope) and blocks else None
        invocation = [kinds[:i].count("hybrid") for i in range(len(kinds))]

        def layer(i: int) -> nn.Module:
            if kinds[i] == "mamba":
                return MambaLayer(config)
            j = invocation[i]
            return HybridLayer(config, blocks[block_of(config, j)], j, rope)

        super().__init__(config, layer, num_layers=len(kinds))
        self.shared_blocks = nn.ModuleList(blocks)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        embeddings, residual = hidden_states, None
        for layer in self.layers:
            if isinstance(layer, HybridLayer):
                hidden_states, residual = layer(positions, hidden_states, residual, embeddings)
            else:
                hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


_SHARED = re.compile(r"^model\.layers\.(\d+)\.shared_transformer\.")


class Zamba2ForCausalLM(CausalLM):
    """Zamba2 in the mrv2 model contract (module docstring)."""

    renames: ClassVar[tuple[tuple[str, str], ...]] = (
        (".mamba.conv1d.weight", ".mamba.conv_weight"),
        (".mamba.conv1d.bias", ".mamba.conv_bias"),
        ("model.final_layernorm.", "model.norm."),
    )

    def __init__(self, config: PretrainedConfig) -> None:
        check_config(config)
        kinds = layer_kinds_of(config)
        model = Zamba2Model(config, kinds)
        super().__init__(config, model)
        self.layer_kinds = kinds
        #: A hybrid layer's index -> the shared block it invokes.
        self.block_of = {i: block_of(config, j) for j, i in
                         enumerate(i for i, k in enumerate(kinds) if k == "hybrid")}

    def rename(self, name: str) -> str | None:
        """HF's names onto this model's (module docstring)."""
        shared = _SHARED.match(name)
        if shared is not None:
            layer = int(shared.group(1))
            if layer not in self.block_of:
                raise ValueError(f"{FAMILY}: checkpoint tensor {name!r} belongs to a shared "
                                 f"block, but layer {layer} is not a hybrid layer")
            name = f"model.shared_blocks.{self.block_of[layer]}." + name[shared.end():]
        for old, new in self.renames:
            name = name.replace(old, new)
        return super().rename(name)
