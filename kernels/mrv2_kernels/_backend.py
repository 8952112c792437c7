"""Backend selection shared by every kernel module.

Each op in :mod:`mrv2_kernels` has a plain-torch reference (``*_ref``) and a Triton
implementation (``*_triton``); the public dispatcher picks one with :func:`use_triton`.
Block sizes are ordinary function arguments whose defaults depend on the backend
(:func:`default_block`): small tiles under the CPU interpreter, where every program is
executed by Python, and larger ones on the GPU. Nothing here autotunes.

Integer kernel arguments that change from step to step (row counts, split counts) are listed
in ``do_not_specialize``: Triton otherwise compiles a new variant the first time such a value
is 1 or a multiple of 16, which would stall serving for a compile at an arbitrary step.
"""

from __future__ import annotations

import os

import torch

__all__ = ["ENV_VAR", "default_block", "triton_forced", "use_triton"]

#: Environment variable that forces the Triton path for CPU tensors (``MRV2_KERNELS=triton``),
#: which only works together with ``TRITON_INTERPRET=1``.
ENV_VAR = "MRV2_KERNELS"


def triton_forced() -> bool:
    """Return True when ``MRV2_KERNELS=triton`` asks for Triton kernels on CPU tensors."""
    return os.environ.get(ENV_VAR, "").strip().lower() == "triton"


def use_triton(t: torch.Tensor) -> bool:
    """Return True when the op on ``t`` should run the Triton kernel.

    That is the case for CUDA tensors, and for CPU tensors when ``MRV2_KERNELS=triton``
    (Triton's interpreter, ``TRITON_INTERPRET=1``, then executes the kernel). Reads only
    tensor metadata and the environment: never synchronizes with the device.
    """
    return bool(t.is_cuda) or triton_forced()


def default_block(t: torch.Tensor, cuda: int, cpu: int, block: int | None = None) -> int:
    """Pick a tile size: ``block`` if given, else ``cuda`` for CUDA tensors and ``cpu`` otherwise.

    The result must be a power of two (Triton's ``tl.arange`` requirement); a ValueError
    says so otherwise.
    """
    value = block if block is not None else (cuda if t.is_cuda else cpu)
    if value <= 0 or value & (value - 1):
        raise ValueError(f"block size must be a positive power of two, got {value}")
    return value
