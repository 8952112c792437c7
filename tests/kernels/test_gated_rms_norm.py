"""The gated RMSNorm of linear-attention and Mamba-2 mixers (``mrv2_kernels.norm.gated_rms_norm``):
Triton (interpreted on CPU) against the torch reference, and the reference against the layers'
torch code it replaces (Qwen3-Next's per-head norm after the gate's ``silu``, the Mamba-2
mixers' norm of the gated value per group)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

try:
    import mrv2_kernels  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from mrv2_kernels import norm
from mrv2_kernels.norm import gated_rms_norm_ref, gated_rms_norm_triton

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)


@pytest.fixture
def poisoned(poison: Callable[[ModuleType], None]) -> None:
    poison(norm)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels,group,shared,before", [
    (24, 8, True, True),    # a norm per head, one weight for every head (Qwen3-Next)
    (24, 12, False, False),  # per group of channels, a weight per channel (Mamba-2)
    (20, 20, False, False),  # one group over every channel (Granite 4.0-H), not a power of 2
])
def test_triton_matches_ref(dtype: torch.dtype, channels: int, group: int, shared: bool,
                            before: bool, poisoned: None) -> None:
    fused = randn(5, 3 * channels, seed=1, dtype=dtype)  # x and z as strided column slices
    x, z = fused[:, :channels], fused[:, 2 * channels:]
    weight = randn(group if shared else channels, seed=2, dtype=dtype)
    want = gated_rms_norm_ref(x, z, weight, 1e-5, group, before)
    got = gated_rms_norm_triton(x, z, weight, 1e-5, group, before)
    assert got.dtype == dtype and got.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    got32 = gated_rms_norm_triton(x, z, weight, 1e-5, group, before, torch.float32)
    assert got32.dtype == torch.float32


def test_ref_matches_the_layers_torch_code() -> None:
    x, z = randn(4, 16, seed=3), randn(4, 16, seed=4)
    w_head, w_all = randn(8, seed=5), randn(16, seed=6)
    heads = x.view(8, 8)  # Qwen3-Next: rows of one head, normed, then gated
    qwen = w_head * (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6))
    qwen = (qwen * F.silu(z.view(8, 8))).view(4, 16)
    torch.testing.assert_close(gated_rms_norm_ref(x, z, w_head, 1e-6, 8, True), qwen)
    h = (x * F.silu(z)).view(4, 2, 8)  # Mamba-2: gated, then normed per group of 8
    mamba = w_all * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).view(4, 16)
    torch.testing.assert_close(gated_rms_norm_ref(x, z, w_all, 1e-6, 8), mamba)


def test_bad_shapes_refused() -> None:
    x = randn(2, 12, seed=7)
    with pytest.raises(ValueError, match="whole groups of 5"):
        gated_rms_norm_triton(x, x, randn(12, seed=8), 1e-6, 5)
    with pytest.raises(ValueError, match=r"weight must have shape \(12,\) or \(4,\)"):
        gated_rms_norm_triton(x, x, randn(6, seed=8), 1e-6, 4)
