"""Shared model layers: linear, norm, rotary, embedding, activation, attention."""

from mrv2.layers.activation import SiluAndMul
from mrv2.layers.attention import Attention
from mrv2.layers.embedding import LMHead, VocabEmbedding
from mrv2.layers.linear import (
    ColumnLinear,
    LinearBase,
    MergedColumnLinear,
    QKVLinear,
    RowLinear,
    norm_linear,
)
from mrv2.layers.norm import RMSNorm
from mrv2.layers.rotary import RotaryEmbedding, get_rope, rope_parameters_of

__all__ = [
    "Attention",
    "ColumnLinear",
    "LMHead",
    "LinearBase",
    "MergedColumnLinear",
    "QKVLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowLinear",
    "SiluAndMul",
    "VocabEmbedding",
    "get_rope",
    "norm_linear",
    "rope_parameters_of",
]
