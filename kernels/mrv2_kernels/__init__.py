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
    "row_key_ref",
    "uniform_hash_ref",
    "uniform_hash_triton",
    "use_triton",
]
