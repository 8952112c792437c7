"""Shared model layers: linear, norm, rotary, embedding, activation, attention (multi-head latent
attention too: :mod:`mrv2.layers.mla`), MLP, MoE, and the decoder-only outer classes
(:class:`DecoderModel`, :class:`CausalLM`)."""

from mrv2.layers.activation import XIELU, ReLUSquared, SiluAndMul
from mrv2.layers.attention import Attention
from mrv2.layers.decoder import (
    QKV_PARAMS,
    STACKED_PARAMS,
    CausalLM,
    DecoderLayer,
    DecoderModel,
    ParallelDecoderLayer,
    PostNormDecoderLayer,
    ScaledQueryAttention,
    SelfAttention,
    head_dim_of,
    llama4_query_scaling,
    norm_mlp,
    projection_norms,
    sliding_window_of,
)
from mrv2.layers.embedding import LMHead, VocabEmbedding
from mrv2.layers.linear import (
    ColumnLinear,
    FusedColumnLinear,
    LinearBase,
    MergedColumnLinear,
    QKVLinear,
    RowLinear,
    norm_linear,
)
from mrv2.layers.mamba import Mamba2Mixer
from mrv2.layers.mamba1 import Mamba1Mixer
from mrv2.layers.mla import MLAAttention, MLADecoderLayer, mla_rope
from mrv2.layers.mlp import DenseMLP, GatedMLP
from mrv2.layers.moe import FusedMoE, GroupedTopKRouter, MoEBlock, SoftmaxTopKRouter
from mrv2.layers.norm import LayerNorm, RMSNorm, ShardedRMSNorm
from mrv2.layers.rotary import (
    RotaryEmbedding,
    get_rope,
    layer_ropes,
    qk_rows_to_halves,
    qk_tensor_to_halves,
    rope_heads_to_halves,
    rope_parameters_of,
    rope_rows_to_halves,
)

__all__ = [
    "QKV_PARAMS",
    "STACKED_PARAMS",
    "XIELU",
    "Attention",
    "CausalLM",
    "ColumnLinear",
    "DecoderLayer",
    "ParallelDecoderLayer",
    "DecoderModel",
    "DenseMLP",
    "PostNormDecoderLayer",
    "FusedColumnLinear",
    "FusedMoE",
    "GatedMLP",
    "GroupedTopKRouter",
    "LMHead",
    "LayerNorm",
    "LinearBase",
    "MLAAttention",
    "MLADecoderLayer",
    "Mamba1Mixer",
    "Mamba2Mixer",
    "MergedColumnLinear",
    "MoEBlock",
    "QKVLinear",
    "RMSNorm",
    "ReLUSquared",
    "ShardedRMSNorm",
    "RotaryEmbedding",
    "RowLinear",
    "ScaledQueryAttention",
    "SelfAttention",
    "SiluAndMul",
    "SoftmaxTopKRouter",
    "VocabEmbedding",
    "get_rope",
    "head_dim_of",
    "layer_ropes",
    "llama4_query_scaling",
    "mla_rope",
    "sliding_window_of",
    "norm_linear",
    "norm_mlp",
    "projection_norms",
    "qk_rows_to_halves",
    "qk_tensor_to_halves",
    "rope_heads_to_halves",
    "rope_parameters_of",
    "rope_rows_to_halves",
]
