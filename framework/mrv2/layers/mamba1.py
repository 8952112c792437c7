"""The Mamba-1 mixer (the selective state-space token mixer of state-spaces Mamba, FalconMamba
and Jamba), built from explicit sizes (a family's adapter reads its own config fields).

Per token, ``in_proj`` gives ``x`` and the gate ``z`` (``intermediate`` channels each). ``x``
goes through a causal depthwise convolution of width ``conv_kernel`` and the activation;
``x_proj`` gives a low-rank time step (``dt_rank``) and one ``B`` and one ``C`` vector of
``state_size``, optionally RMS-normed (FalconMamba: without weights; Jamba: ``dt_layernorm``,
``b_layernorm``, ``c_layernorm`` with weights); ``dt = softplus(dt_proj(dt) + dt_bias)``;
per channel ``d`` the SSM ``h[d] = exp(dt[d] A[d]) h[d] + dt[d] x[d] B``, ``y[d] = h[d] . C + D[d]
x[d]`` with ``A = -exp(A_log)`` ``[intermediate, state_size]``
(:func:`mrv2_kernels.selective_scan.selective_scan`); then ``y * silu(z)`` and ``out_proj``.
Per request the mixer keeps the convolution's last inputs and the fp32 SSM state
(:mod:`mrv2.contract.request_state`), with prefix caching's snapshots and speculative
decoding's row slots as the Mamba-2 mixer.

Checkpoint names are HF's: ``in_proj``, ``conv1d`` (a family's ``rename`` sends
``conv1d.weight`` / ``conv1d.bias`` to :attr:`Mamba1Mixer.conv_weight` / ``conv_bias``),
``x_proj``, ``dt_proj``, ``A_log``, ``D``, ``out_proj`` and Jamba's norms. Tensor parallelism
splits the mixer by channels (as vLLM's ``MambaMixer``): ``in_proj`` and ``dt_proj`` by output
rows, the convolution, ``A_log`` and ``D`` by channels, ``x_proj`` and ``out_proj`` by input
columns (each all-reduced: every rank needs the whole ``dt`` / ``B`` / ``C``).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.contract.request_state import RequestStateLayer, StateShapes
from mrv2.layers.linear import ColumnLinear, RowLinear, resolve_tp, split_evenly
from mrv2.layers.mamba import MAMBA_ACTIVATIONS, InProj
from mrv2_kernels.linear_attention import causal_conv1d
from mrv2_kernels.selective_scan import selective_scan

__all__ = ["BCDT_NORMS", "Mamba1Mixer"]

#: ``bcdt_norm`` values: no norm on ``dt`` / ``B`` / ``C``, RMSNorms without weights
#: (FalconMamba), RMSNorms with weights (Jamba's ``dt_layernorm`` / ``b_layernorm`` /
#: ``c_layernorm``).
BCDT_NORMS = (None, "weightless", "weighted")


def _rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """HF's RMSNorm of ``x`` (in fp32, rounded back to ``x``'s dtype, then the weight)."""
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return h if weight is None else weight * h


class Mamba1Mixer(RequestStateLayer):
    """A Mamba-1 mixer (module docstring) of ``intermediate`` channels with a ``state_size``
    SSM state per channel; ``conv_kernel``: the convolution's width; ``dt_rank``: the time
    step's rank; ``activation``: a :data:`~mrv2.layers.mamba.MAMBA_ACTIVATIONS` name, applied
    after the convolution; ``proj_bias``: biases on ``in_proj`` and ``out_proj``;
    ``conv_bias``: on the convolution; ``bcdt_norm``: one of :data:`BCDT_NORMS`, of epsilon
    ``norm_eps``. Keeps per request ``conv`` ``[conv_kernel - 1, intermediate]`` (model
    dtype) and ``ssm`` ``[intermediate, state_size]`` (fp32), this rank's channels."""

    def __init__(
        self, hidden_size: int, intermediate: int, state_size: int, conv_kernel: int,
        dt_rank: int, activation: str = "silu", *, proj_bias: bool = False,
        conv_bias: bool = True, bcdt_norm: str | None = None, norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if activation not in MAMBA_ACTIVATIONS:
            raise ValueError(f"Mamba1Mixer: activation must be one of "
                             f"{sorted(MAMBA_ACTIVATIONS)}, got {activation!r}")
        if bcdt_norm not in BCDT_NORMS:
            raise ValueError(f"Mamba1Mixer: bcdt_norm must be one of {BCDT_NORMS}, got "
                             f"{bcdt_norm!r}")
        if min(intermediate, state_size, dt_rank) < 1 or conv_kernel < 2:
            raise ValueError(f"Mamba1Mixer: intermediate ({intermediate}), state_size "
                             f"({state_size}) and dt_rank ({dt_rank}) must be positive, "
                             f"conv_kernel ({conv_kernel}) at least 2")
        self.tp_rank, self.tp_size = rank, size = resolve_tp(None)
        #: This rank's channels.
        self.intermediate = split_evenly(intermediate, size, "the Mamba intermediate_size")
        self.state_size, self.dt_rank = int(state_size), int(dt_rank)
        self.kernel_size = int(conv_kernel)
        self.act_name = activation
        self.act = MAMBA_ACTIVATIONS[activation]
        self.bcdt_norm, self.norm_eps = bcdt_norm, float(norm_eps)
        self.in_proj = InProj(hidden_size, [intermediate, intermediate], bias=proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(self.intermediate, self.kernel_size))
        self.conv_weight.weight_loader = self._load_channels  # type: ignore[attr-defined]
        self.conv_bias: nn.Parameter | None = None
        if conv_bias:
            self.conv_bias = nn.Parameter(torch.zeros(self.intermediate))
            self.conv_bias.weight_loader = self._load_channels  # type: ignore[attr-defined]
        self.x_proj = RowLinear(intermediate, self.dt_rank + 2 * self.state_size)
        self.dt_proj = ColumnLinear(self.dt_rank, intermediate, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.intermediate, self.state_size))
        self.D = nn.Parameter(torch.ones(self.intermediate))
        for param in (self.A_log, self.D):
            param.weight_loader = self._load_channels  # type: ignore[attr-defined]
        self.dt_layernorm: _NormWeight | None = None
        self.b_layernorm: _NormWeight | None = None
        self.c_layernorm: _NormWeight | None = None
        if bcdt_norm == "weighted":  # (checkpoint names: ``dt_layernorm.weight`` ...)
            self.dt_layernorm = _NormWeight(self.dt_rank)
            self.b_layernorm = _NormWeight(self.state_size)
            self.c_layernorm = _NormWeight(self.state_size)
        self.out_proj = RowLinear(intermediate, hidden_size, bias=proj_bias)
        self.first = rank * self.intermediate

    def _load_channels(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A per-channel tensor (the depthwise Conv1d weight ``[D, 1, W]`` or ``[D, W]``, its
        bias, ``A_log``, ``D``): this rank's channels."""
        src = loaded.reshape(loaded.shape[0], -1) if loaded.dim() == 3 else loaded
        if self.tp_size > 1 and src.shape[0] == self.intermediate * self.tp_size:
            src = src.narrow(0, self.first, self.intermediate)
        if tuple(src.shape) != tuple(param.shape):
            raise ValueError(f"Mamba-1 mixer: this rank's part has shape {tuple(src.shape)}, "
                             f"the parameter {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(src)

    def request_state_shapes(self) -> StateShapes:
        """``conv`` (the convolution's last inputs) and ``ssm`` (the fp32 SSM state)."""
        return {"conv": ((self.kernel_size - 1, self.intermediate), None),
                "ssm": ((self.intermediate, self.state_size), torch.float32)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` (normed) -> ``[T, hidden]``; the step's requests' states advance."""
        return self.mix(cast(torch.Tensor, self.in_proj(x)))

    def _norm(self, x: torch.Tensor, weight: _NormWeight | None) -> torch.Tensor:
        if self.bcdt_norm is None:
            return x
        return _rms(x, None if weight is None else weight.weight, self.norm_eps)

    def mix(self, proj: torch.Tensor) -> torch.Tensor:
        """After ``in_proj`` (``[T, x | z]``, e.g. fused with the norm before it): convolve,
        project ``dt`` / ``B`` / ``C``, scan, gate, project."""
        st = self.step_states()
        qsl, seq_lens, rows = st.query_start_loc, st.seq_lens, st.rows
        xs, z = proj.split([self.intermediate, self.intermediate], dim=-1)
        states = self.request_states
        silu = self.act_name in ("silu", "swish")
        xs = causal_conv1d(xs, self.conv_weight, self.conv_bias, states["conv"], qsl,
                           seq_lens, rows, "silu" if silu else None,
                           state_table=st.state_table, row_slots=st.row_slots)
        if not silu:
            xs = self.act(xs)
        params = cast(torch.Tensor, self.x_proj(xs))
        dt, b, c = params.split([self.dt_rank, self.state_size, self.state_size], dim=-1)
        dt = self._norm(dt, self.dt_layernorm)
        b = self._norm(b, self.b_layernorm)
        c = self._norm(c, self.c_layernorm)
        # (dt_proj's bias joins in fp32 inside the scan, as HF's ``delta_bias``)
        dt = F.linear(dt, self.dt_proj.weight)
        y = selective_scan(xs, dt, self.A_log, b, c, self.D, z, self.dt_proj.bias,
                           states["ssm"], qsl, seq_lens, rows, state_table=st.state_table,
                           out_dtype=proj.dtype, row_slots=st.row_slots)
        return cast(torch.Tensor, self.out_proj(y))

    def extra_repr(self) -> str:
        return (f"channels={self.intermediate}, state={self.state_size}, "
                f"dt_rank={self.dt_rank}, conv={self.kernel_size}, act={self.act_name}, "
                f"bcdt_norm={self.bcdt_norm}")


class _NormWeight(nn.Module):
    """The weight of one of Jamba's ``dt`` / ``B`` / ``C`` RMSNorms (replicated: it norms the
    all-reduced ``x_proj`` output)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
