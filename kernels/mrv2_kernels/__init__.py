"""Triton kernels of mrv2, each beside a plain-torch reference of the same function.

Every op ``op`` comes as ``op_ref`` (torch, the specification), ``op_triton`` (the kernel)
and ``op`` (dispatches with :func:`use_triton`). This package imports only torch and triton.
"""

from ._backend import default_block, use_triton
from .gumbel import (
    gumbel_noise_ref,
    gumbel_sample,
    gumbel_sample_ref,
    gumbel_sample_triton,
    hash_row_key,
    hash_uniform,
    mix32_ref,
    row_key_ref,
    uniform_hash_ref,
    uniform_hash_triton,
)
from .input_prep import (
    post_update,
    post_update_ref,
    post_update_triton,
    prepare_inputs,
    prepare_inputs_ref,
    prepare_inputs_triton,
)
from .norm import (
    rms_norm,
    rms_norm_ref,
    rms_norm_triton,
    silu_and_mul,
    silu_and_mul_ref,
    silu_and_mul_triton,
)
from .rotary import rotary_embedding, rotary_embedding_ref, rotary_embedding_triton

__all__ = [
    "default_block",
    "gumbel_noise_ref",
    "gumbel_sample",
    "gumbel_sample_ref",
    "gumbel_sample_triton",
    "hash_row_key",
    "hash_uniform",
    "mix32_ref",
    "post_update",
    "post_update_ref",
    "post_update_triton",
    "prepare_inputs",
    "prepare_inputs_ref",
    "prepare_inputs_triton",
    "rms_norm",
    "rms_norm_ref",
    "rms_norm_triton",
    "rotary_embedding",
    "rotary_embedding_ref",
    "rotary_embedding_triton",
    "row_key_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "silu_and_mul_triton",
    "uniform_hash_ref",
    "uniform_hash_triton",
    "use_triton",
]
