"""LayerNorm, optionally fused with the residual add before it: one launch where torch runs the
add and the norm apart (GPT-NeoX, StableLM, StarCoder, Cohere, Phi-MoE and the other families
whose blocks norm by mean and variance, with or without an affine weight and bias).

Contract (``x`` ``[..., H]``; ``weight``, ``bias`` ``[H]`` or None)::

    xf      = x.float()                       # with a residual: x.float() + residual.float()
    mean    = mean(xf, -1);  var = mean((xf - mean) ** 2, -1)
    y       = (xf - mean) * rsqrt(var + eps)  # fp32
    y       = y * weight.float() + bias.float()   # each where given, still fp32
    out     = y.to(x.dtype)                   # one rounding, as torch's layer_norm in bf16/fp16
    new_res = xf.to(x.dtype)                  # returned only with a residual

which is ``torch.nn.functional.layer_norm`` computed in fp32 (what torch does internally for
half types on CUDA and CPU) and HF's ``nn.LayerNorm`` and ``CohereLayerNorm`` alike. The
variance is the biased one, of ``xf - mean`` (two passes over one register tile: no
cancellation of ``E[x^2] - E[x]^2``).
"""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._backend import cdiv, default_block, next_power_of_2, pdl, pdl_prologue, use_triton
from .norm import _residual_rows, _rows_view

__all__ = ["layer_norm", "layer_norm_ref", "layer_norm_triton"]

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit(do_not_specialize=["num_rows", "inner"])
def _layer_norm_kernel(
    x_ptr: tl.tensor, res_ptr: tl.tensor, w_ptr: tl.tensor, b_ptr: tl.tensor,
    out_ptr: tl.tensor, res_out_ptr: tl.tensor,
    num_rows: int, inner: int, hidden: int, eps: float,
    x_s0: int, x_s1: int, res_s0: int, res_s1: int, out_s0: int, out_s1: int,
    res_out_s0: int, res_out_s1: int,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
) -> None:
    pdl_prologue(PDL)
    # Rows are the [A, B] leading dims of [A, B, H] views (as the RMSNorm kernel's): per-head
    # rows of a strided slice need no copy. One tile covers a row.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < hidden
    mask = (rows < num_rows)[:, None] & cmask[None, :]
    a = rows // inner
    b = rows % inner
    x = tl.load(x_ptr + (a * x_s0 + b * x_s1)[:, None] + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + (a * res_s0 + b * res_s1)[:, None] + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
        tl.store(res_out_ptr + (a * res_out_s0 + b * res_out_s1)[:, None] + cols[None, :],
                 x.to(res_out_ptr.dtype.element_ty), mask=mask)
    mean = tl.sum(x, axis=1) / hidden
    centred = tl.where(cmask[None, :], x - mean[:, None], 0.0)
    var = tl.sum(centred * centred, axis=1) / hidden
    y = centred * tl.rsqrt(var + eps)[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + (a * out_s0 + b * out_s1)[:, None] + cols[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
           residual: torch.Tensor | None) -> None:
    hidden = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.shape != (hidden,):
            raise ValueError(f"layer_norm: {name} must have shape ({hidden},), got "
                             f"{tuple(t.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"layer_norm: residual shape {tuple(residual.shape)} must equal x "
                         f"shape {tuple(x.shape)}")


def layer_norm_ref(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
    residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch specification of :func:`layer_norm` (never modifies its inputs)."""
    _check(x, weight, bias, residual)
    xf = x.float() if residual is None else x.float() + residual.float()
    normed = F.layer_norm(xf, (x.shape[-1],), None if weight is None else weight.float(),
                          None if bias is None else bias.float(), eps).to(x.dtype)
    if out is not None:
        normed = out.copy_(normed)
    return normed if residual is None else (normed, xf.to(x.dtype))


def layer_norm_triton(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
    residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
    block_r: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of :func:`layer_norm`: one launch, ``block_r`` rows a program, a
    row one tile of ``next_power_of_2(H)`` columns (meant for ``H <= 8192``). Strides, the
    in-place residual and ``out`` as :func:`mrv2_kernels.norm.rms_norm_triton`'s: the new
    residual goes into ``residual``'s storage where it has ``x``'s shape and dtype."""
    _check(x, weight, bias, residual)
    for t in (x, weight, bias):
        if t is not None and t.dtype not in _KERNEL_DTYPES:
            raise TypeError(f"layer_norm_triton takes fp32/bf16/fp16, got {t.dtype}")
    hidden = x.shape[-1]
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"layer_norm: out must be {tuple(x.shape)} {x.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    out3 = _rows_view(out)
    if out3 is None:
        raise ValueError("layer_norm: out must be viewable as [A, B, H] with a contiguous "
                         "last dim")
    x3, r3, ro3, res_out = _residual_rows(x, residual)
    if out.numel() == 0:
        return out if res_out is None else (out, res_out)
    num_rows = x3.shape[0] * x3.shape[1]
    w = x3 if weight is None else weight.contiguous()  # (unread placeholders when None)
    b = x3 if bias is None else bias.contiguous()
    block_h = next_power_of_2(hidden)
    br = default_block(x, cuda=max(1, min(16, 2048 // block_h)), cpu=max(1, 8192 // block_h),
                       block=block_r)
    _layer_norm_kernel[(cdiv(num_rows, br),)](
        x3, r3, w, b, out3, ro3, num_rows, x3.shape[1], hidden, float(eps),
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), out3.stride(0),
        out3.stride(1), ro3.stride(0), ro3.stride(1),
        HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None, BLOCK_R=br, BLOCK_H=block_h,
        num_warps=min(16, max(1, br * block_h // 256)) if x.is_cuda else 1, **pdl(x),
    )
    return out if res_out is None else (out, res_out)


@overload
def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float, residual: None = None, *, out: torch.Tensor | None = None
               ) -> torch.Tensor: ...


@overload
def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float, residual: torch.Tensor, *, out: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]: ...


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
    residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim of ``x`` ``[..., H]`` (the module's contract), optionally
    fused with ``x + residual``: then ``(normed, new_residual)``. ``weight`` / ``bias`` None:
    no scale / no shift (OLMo's norm has neither, Cohere's no bias). The result has ``x``'s
    dtype.

    Runs :func:`layer_norm_triton` when :func:`use_triton` says so (fp32/bf16/fp16), else
    :func:`layer_norm_ref`. **Aliasing** as :func:`mrv2_kernels.norm.rms_norm`'s: on the Triton
    path the returned residual is usually ``residual`` itself, overwritten; use the returned
    one."""
    if use_triton(x) and all(t is None or t.dtype in _KERNEL_DTYPES for t in (x, weight, bias)):
        return layer_norm_triton(x, weight, bias, eps, residual, out=out)
    return layer_norm_ref(x, weight, bias, eps, residual, out=out)
