"""RMSNorm (optionally fused with the residual add before it), the SwiGLU ``silu(gate) * up``
and the gated RMSNorm of linear-attention and Mamba-2 mixers (:func:`gated_rms_norm`).

Both are memory-bound elementwise/row ops that torch runs as a chain of small kernels (pow,
mean, rsqrt, casts, multiplies); here each is one launch. The ``*_ref`` functions are the
plain-torch specification, written exactly as the model layers computed them before, so the
CPU results are unchanged; the Triton kernels do the same fp32 math and the same roundings to
the input dtype, and agree with the reference to fp32 rounding (up to 1 ulp in bf16/fp16 where
a reduction order or ``exp`` differs).

RMSNorm contract (``x`` ``[..., H]``, ``weight`` ``[H]``)::

    xf      = x.float()                       # with a residual: x.float() + residual.float()
    normed  = (xf * rsqrt(mean(xf ** 2, -1) + eps)).to(x.dtype)
    out     = weight * normed                 # dtype: promote_types(weight.dtype, x.dtype)
    new_res = xf.to(x.dtype)                  # returned only with a residual
"""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._backend import cdiv, default_block, next_power_of_2, pdl, pdl_prologue, use_triton

__all__ = [
    "gated_rms_norm",
    "gated_rms_norm_ref",
    "gated_rms_norm_triton",
    "rms_norm",
    "rms_norm_cpu",
    "rms_norm_ref",
    "rms_norm_triton",
    "silu_and_mul",
    "silu_and_mul_ref",
    "silu_and_mul_triton",
]

#: dtypes the Triton kernels take (loaded, converted to fp32 at once, stored back rounded).
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------- RMSNorm


@triton.jit(do_not_specialize=["num_rows", "inner"])
def _rms_norm_kernel(
    x_ptr: tl.tensor,
    res_ptr: tl.tensor,
    w_ptr: tl.tensor,
    out_ptr: tl.tensor,
    res_out_ptr: tl.tensor,
    num_rows: int,
    inner: int,
    hidden: int,
    eps: float,
    x_s0: int,
    x_s1: int,
    res_s0: int,
    res_s1: int,
    out_s0: int,
    out_s1: int,
    res_out_s0: int,
    res_out_s1: int,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    pdl_prologue(PDL)
    # Rows are the [A, B] leading dims of [A, B, H] views: row r is (r // inner, r % inner),
    # so per-head rows of a strided [T, heads, D] slice need no copy. One tile covers a row.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < hidden
    mask = (rows < num_rows)[:, None] & cmask[None, :]
    a = rows // inner
    b = rows % inner
    x_src = x_ptr + (a * x_s0 + b * x_s1)[:, None] + cols[None, :]
    x = tl.load(x_src, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res_src = res_ptr + (a * res_s0 + b * res_s1)[:, None] + cols[None, :]
        x = x + tl.load(res_src, mask=mask, other=0.0).to(tl.float32)
        res_dst = res_out_ptr + (a * res_out_s0 + b * res_out_s1)[:, None] + cols[None, :]
        tl.store(res_dst, x.to(res_out_ptr.dtype.element_ty), mask=mask)
    variance = tl.sum(x * x, axis=1) / hidden
    normed = x * tl.rsqrt(variance + eps)[:, None]
    # Round to the input dtype before the weight multiply, as the torch formula does.
    normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    y = w[None, :] * normed
    out_dst = out_ptr + (a * out_s0 + b * out_s1)[:, None] + cols[None, :]
    tl.store(out_dst, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` ``[..., H]`` as an ``[A, B, H]`` view with a unit last stride, or None if impossible.

    ``[A, B]`` depends on the shape only: ``[1, 1]`` for 1-D, ``[N, 1]`` for 2-D, the leading
    dims for 3-D, and ``[prod(shape[:-2]), shape[-2]]`` beyond; so tensors of one shape share it.
    """
    if t.dim() == 0:
        return None
    try:
        if t.dim() == 1:
            v = t.view(1, 1, t.shape[0])
        elif t.dim() == 2:
            v = t.unsqueeze(1)
        elif t.dim() == 3:
            v = t
        else:
            v = t.view(-1, t.shape[-2], t.shape[-1])
    except RuntimeError:
        return None
    if v.shape[-1] > 1 and v.stride(-1) != 1:
        return None
    return v


def _rows_input(t: torch.Tensor) -> torch.Tensor:
    """:func:`_rows_view` of ``t``, or of a contiguous copy when ``t`` has no such view."""
    v = _rows_view(t)
    if v is None:
        v = _rows_view(t.contiguous())
    assert v is not None
    return v


def _writable_like(t: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``t`` can take ``x``-shaped values in place: same dtype, no broadcast dims."""
    strides = zip(t.stride(), t.shape, strict=True)
    return t.dtype == x.dtype and all(s != 0 or n <= 1 for s, n in strides)


def _residual_rows(x: torch.Tensor, residual: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A fused add-and-norm's row views: ``(x3, residual3, new_residual3, new_residual)``.
    The new residual is ``residual`` itself, written in place, where it has ``x``'s shape and
    dtype and a row view; else a fresh tensor. Without a residual: ``x3`` three times (unread
    placeholders) and None."""
    x3 = _rows_input(x)
    if residual is None:
        return x3, x3, x3, None
    r3 = _rows_input(residual)
    in_place = _rows_view(residual) if _writable_like(residual, x) else None
    if in_place is not None:
        return x3, r3, in_place, residual
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return x3, r3, _rows_input(res_out), res_out


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch specification of :func:`rms_norm` (never modifies its inputs)."""
    dtype = x.dtype
    xf = x.float() if residual is None else x.float() + residual.float()
    variance = xf.pow(2).mean(dim=-1, keepdim=True)
    normed = weight * (xf * torch.rsqrt(variance + eps)).to(dtype)
    if out is not None:
        normed = out.copy_(normed)
    if residual is None:
        return normed
    return normed, xf.to(dtype)


def rms_norm_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The torch path of :func:`rms_norm` (CPU): :func:`rms_norm_ref`'s math, bit for bit, in
    fewer ops for fp32 (no dtype round trips, in-place steps on fresh tensors); the reference
    itself for other dtypes or with ``out``. Never modifies its inputs."""
    f32 = torch.float32
    if (out is not None or x.dtype != f32 or weight.dtype != f32
            or (residual is not None and residual.dtype != f32)):
        return rms_norm_ref(x, weight, eps, residual, out=out)
    xf = x if residual is None else x + residual
    # xf.pow(2).mean(-1) is this sum divided by the count (what aten's mean runs), fewer calls
    scale = torch.sum(xf * xf, dim=-1, keepdim=True).div_(xf.shape[-1])
    normed = torch.mul(xf, scale.add_(eps).rsqrt_()).mul_(weight)
    return normed if residual is None else (normed, xf)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    block_r: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton implementation of :func:`rms_norm`: one launch, ``block_r`` rows per program.

    Every row is one tile of ``next_power_of_2(H)`` columns (meant for ``H <= 8192``); the sum,
    the norm and both outputs come out of a single read of ``x`` (and ``residual``). ``x`` may
    be a strided view whose last dim is contiguous, e.g. ``[T, heads, D]`` slices of a fused
    QKV output; it is copied only when it cannot be viewed as ``[A, B, H]``.

    Aliasing: the new residual is written **in place into** ``residual`` and ``residual`` itself
    is returned when it has ``x``'s shape and dtype and a contiguous last dim; otherwise into a
    fresh tensor. The normed output goes into ``out`` when given (shape ``x.shape``, dtype
    ``promote_types(weight.dtype, x.dtype)``, contiguous last dim), else a fresh tensor.
    ``x``, ``residual`` and ``out`` may coincide exactly (same storage, same layout) but must
    not otherwise overlap.
    """
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    if x.dtype not in _KERNEL_DTYPES or weight.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"rms_norm_triton takes fp32/bf16/fp16, got {x.dtype}, {weight.dtype}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(
            f"residual shape {tuple(residual.shape)} must equal x shape {tuple(x.shape)}"
        )
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != out_dtype:
        raise ValueError(
            f"out must be {tuple(x.shape)} {out_dtype}, got {tuple(out.shape)} {out.dtype}"
        )
    out3 = _rows_view(out)
    if out3 is None:
        raise ValueError("out must be viewable as [A, B, H] with a contiguous last dim")
    x3, r3, ro3, res_out = _residual_rows(x, residual)
    if out.numel() == 0:
        return out if res_out is None else (out, res_out)
    num_rows = x3.shape[0] * x3.shape[1]
    weight = weight.contiguous()
    block_h = next_power_of_2(hidden)
    br = default_block(
        x, cuda=max(1, min(16, 2048 // block_h)), cpu=max(1, 8192 // block_h), block=block_r
    )
    warps = min(16, max(1, br * block_h // 256)) if x.is_cuda else 1
    _rms_norm_kernel[(cdiv(num_rows, br),)](
        x3,
        r3,
        weight,
        out3,
        ro3,
        num_rows,
        x3.shape[1],
        hidden,
        float(eps),
        x3.stride(0),
        x3.stride(1),
        r3.stride(0),
        r3.stride(1),
        out3.stride(0),
        out3.stride(1),
        ro3.stride(0),
        ro3.stride(1),
        HAS_RESIDUAL=residual is not None,
        BLOCK_R=br,
        BLOCK_H=block_h,
        num_warps=warps,
        **pdl(x),
    )
    if res_out is None:
        return out
    return out, res_out


@overload
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor: ...


@overload
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of ``x`` ``[..., H]``, optionally fused with ``x + residual``.

    Returns ``weight * (xf * rsqrt(mean(xf ** 2) + eps)).to(x.dtype)`` with ``xf = x.float()``;
    with ``residual`` (same shape as ``x``), ``xf = x.float() + residual.float()`` and the
    result is ``(normed, xf.to(x.dtype))``. The normed dtype is
    ``promote_types(weight.dtype, x.dtype)``; ``out``, if given, receives it.

    Runs :func:`rms_norm_triton` when :func:`use_triton` says so (for fp32/bf16/fp16), else
    :func:`rms_norm_cpu` (the reference's results). **Aliasing**: on the Triton path the
    returned new residual is usually ``residual`` itself, overwritten in place; the torch paths
    leave ``residual`` untouched.
    Callers must use the returned residual and treat the one passed in as consumed.
    """
    if use_triton(x) and x.dtype in _KERNEL_DTYPES and weight.dtype in _KERNEL_DTYPES:
        return rms_norm_triton(x, weight, eps, residual, out=out)
    return rms_norm_cpu(x, weight, eps, residual, out=out)


# --------------------------------------------------------------------------- SiLU and mul


@triton.jit
def _silu_and_mul_kernel(
    x_ptr: tl.tensor,
    out_ptr: tl.tensor,
    x_stride: int,
    out_stride: int,
    d: int,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
) -> None:
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    src = x_ptr + row * x_stride + cols
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
    # torch: silu in fp32 rounded to the dtype, then the product rounded again.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain-torch specification of :func:`silu_and_mul`."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul_triton(x: torch.Tensor, *, block: int | None = None) -> torch.Tensor:
    """Triton implementation of :func:`silu_and_mul`: a program per (row, ``block`` columns).

    ``x`` rows may be strided (last dim contiguous); the result is a fresh contiguous tensor.
    """
    if x.dtype not in _KERNEL_DTYPES:
        raise TypeError(f"silu_and_mul_triton takes fp32/bf16/fp16, got {x.dtype}")
    width = x.shape[-1]
    if width % 2:
        raise ValueError(f"the last dim must be even ([gate | up]), got {width}")
    d = width // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, width)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    pow2 = next_power_of_2(d)
    bl = default_block(x, cuda=min(1024, pow2), cpu=min(4096, pow2), block=block)
    grid = (x2.shape[0], cdiv(d, bl))
    out2 = out.view(-1, d)
    _silu_and_mul_kernel[grid](
        x2,
        out2,
        x2.stride(0),
        out2.stride(0),
        d,
        BLOCK=bl,
        num_warps=min(8, max(1, bl // 256)) if x.is_cuda else 1,
        **pdl(x),
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x`` ``[..., 2 * d]`` laid out ``[gate | up]``; ``[..., d]`` out.

    Computed as torch does for the dtype: silu in fp32 rounded to ``x.dtype``, then the product
    rounded. Runs :func:`silu_and_mul_triton` when :func:`use_triton` says so (for
    fp32/bf16/fp16), else :func:`silu_and_mul_ref`. Returns a new tensor either way.
    """
    if use_triton(x) and x.dtype in _KERNEL_DTYPES:
        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


# ----------------------------------------------------------------------- gated RMSNorm


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The gated norm's output buffer (tests poison it)."""
    return torch.empty(shape, dtype=dtype, device=device)


@triton.jit(do_not_specialize=["num_rows"])
def _gated_rms_norm_kernel(
    x_ptr: tl.tensor, z_ptr: tl.tensor, w_ptr: tl.tensor, out_ptr: tl.tensor,
    num_rows: int, group_size: int, x_stride: int, z_stride: int, out_stride: int,
    w_group_stride: int, eps: float,
    NORM_BEFORE_GATE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
) -> None:
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < group_size
    first = group * group_size
    x = tl.load(x_ptr + row * x_stride + first + cols, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * z_stride + first + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + group * w_group_stride + cols, mask=mask, other=0.0).to(tl.float32)
    gate = z / (1.0 + tl.exp(-z))
    h = x if NORM_BEFORE_GATE else x * gate
    out = w * h * tl.rsqrt(tl.sum(h * h, axis=0) / group_size + eps)
    if NORM_BEFORE_GATE:
        out = out * gate
    tl.store(out_ptr + row * out_stride + first + cols, out.to(out_ptr.dtype.element_ty),
             mask=mask)


def _check_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                 group_size: int) -> None:
    if x.dim() != 2 or z.shape != x.shape:
        raise ValueError(f"x and z must be [T, C] alike, got {tuple(x.shape)}, "
                         f"{tuple(z.shape)}")
    channels = x.shape[1]
    if group_size < 1 or channels % group_size:
        raise ValueError(f"the {channels} channels must be whole groups of {group_size}")
    if weight.shape not in ((channels,), (group_size,)):
        raise ValueError(f"weight must have shape ({channels},) or ({group_size},) (one per "
                         f"group's channel, shared), got {tuple(weight.shape)}")


def gated_rms_norm_ref(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
    norm_before_gate: bool = False, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain-torch specification of :func:`gated_rms_norm`."""
    _check_gated(x, z, weight, group_size)
    t, channels = x.shape
    gate = F.silu(z.float())
    h = x.float() if norm_before_gate else x.float() * gate
    g = h.view(t, channels // group_size, group_size)
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float().view(-1, group_size)  # [groups or 1, group_size]
    out = (w * g).view(t, channels)
    if norm_before_gate:
        out = out * gate
    return out.to(out_dtype or x.dtype)


def gated_rms_norm_triton(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
    norm_before_gate: bool = False, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Triton implementation of :func:`gated_rms_norm`: a program per (row, group), the group's
    channels in one tile. ``x`` and ``z`` may have row strides (last dim contiguous)."""
    _check_gated(x, z, weight, group_size)
    for t in (x, z, weight):
        if t.dtype not in _KERNEL_DTYPES:
            raise TypeError(f"gated_rms_norm_triton takes fp32/bf16/fp16, got {t.dtype}")
    x, z = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, z))
    weight = weight.contiguous()
    rows, channels = x.shape
    out = _empty((rows, channels), out_dtype or x.dtype, x.device)
    if out.numel() == 0:
        return out
    block = next_power_of_2(group_size)
    _gated_rms_norm_kernel[(rows, channels // group_size)](
        x, z, weight, out, rows, group_size, x.stride(0), z.stride(0), out.stride(0),
        group_size if weight.shape[0] == channels else 0, float(eps),
        NORM_BEFORE_GATE=norm_before_gate, BLOCK=block,
        num_warps=min(8, max(1, block // 256)) if x.is_cuda else 1,
        **pdl(x),
    )
    return out


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
    norm_before_gate: bool = False, out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """RMSNorm gated by ``silu(z)`` over groups of ``group_size`` channels, in fp32, one
    rounding at the end (to ``out_dtype``, default ``x``'s).

    ``x``, ``z`` ``[T, C]``; ``weight`` ``[C]``, or ``[group_size]`` shared by every group (a
    norm per head). ``norm_before_gate``: ``weight * rmsnorm(x) * silu(z)`` (Qwen3-Next's gated
    norm, Falcon-H1's); else ``weight * rmsnorm(x * silu(z))`` (the Mamba-2 mixers'). Runs
    :func:`gated_rms_norm_triton` when :func:`use_triton` says so, else
    :func:`gated_rms_norm_ref`."""
    if use_triton(x) and all(t.dtype in _KERNEL_DTYPES for t in (x, z, weight)):
        return gated_rms_norm_triton(x, z, weight, eps, group_size, norm_before_gate,
                                     out_dtype)
    return gated_rms_norm_ref(x, z, weight, eps, group_size, norm_before_gate, out_dtype)
