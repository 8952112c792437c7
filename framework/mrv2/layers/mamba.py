"""The Mamba-2 mixer (selective state-space token mixer) shared by every hybrid family that
uses one, built from explicit sizes (a family's adapter reads its own config fields).

Per token, ``in_proj`` gives the gate ``z`` (``num_heads * head_dim``), ``xBC`` (``x``, then
``n_groups`` ``B`` and ``C`` vectors of ``state_size``) and one ``dt`` per head. ``xBC`` goes
through a causal depthwise convolution of width ``conv_kernel`` and the activation; ``dt =
clamp(softplus(dt + dt_bias), dt_min, dt_max)``, ``A = -exp(A_log)``; per head the SSM ``S =
exp(dt A) S + outer(B, dt x)``, ``y = S^T C + D x`` (head ``h`` reads group ``h / (num_heads /
n_groups)``; :func:`mrv2_kernels.linear_attention.gated_delta_rule` with ``delta=False``);
then ``y * silu(z)`` RMS-normed (gate before norm; per group of channels, or over all of
them; or the norm first, then the gate; or no norm at all: ``y * silu(z)``) and
``out_proj``. Per request the mixer keeps the convolution's last inputs and the fp32 SSM state
(:mod:`mrv2.contract.request_state`), so the engine runs such a model without the prefix cache
and without speculative decoding.

Checkpoint names are HF's: ``in_proj``, ``conv1d`` (a family's ``rename`` sends
``conv1d.weight`` / ``conv1d.bias`` to :attr:`Mamba2Mixer.conv_weight` / ``conv_bias``),
``dt_bias``, ``A_log``, ``D``, ``norm.weight``, ``out_proj``. Tensor parallelism splits the
mixer by heads: with ``n_groups`` divisible by the ranks, each rank holds whole groups; with
fewer groups (the ranks a multiple of them), the one group its heads read, replicated. Each
rank projects, convolves and scans its heads, norms its channels (a norm group spanning ranks:
its statistics all-reduced) and all-reduces after ``out_proj``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.contract.request_state import RequestStateLayer, StateShapes
from mrv2.distributed.parallel_state import all_reduce
from mrv2.layers.activation import relu2
from mrv2.layers.linear import MergedColumnLinear, RowLinear, resolve_tp, split_evenly
from mrv2_kernels.chunk_delta_rule import gated_delta_rule_auto
from mrv2_kernels.linear_attention import causal_conv1d
from mrv2_kernels.norm import gated_rms_norm

__all__ = ["MAMBA_ACTIVATIONS", "GroupGatedRMSNorm", "InProj", "Mamba2Mixer", "relu2"]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


#: The activations, by HF's ``ACT2FN`` names, that hybrid families apply in their mixers and
#: non-gated MLPs.
MAMBA_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu2": relu2, "relu": F.relu, "silu": F.silu, "swish": F.silu, "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
}


def _copy(param: nn.Parameter, src: torch.Tensor, what: str) -> None:
    if tuple(src.shape) != tuple(param.shape):
        raise ValueError(f"{what}: this rank's part has shape {tuple(src.shape)}, the parameter "
                         f"{tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(src)


class InProj(MergedColumnLinear):
    """The mixer's ``in_proj``: shards ``[z | x | B | C | dt]``, loaded from the one checkpoint
    tensor (or per shard, ``shard_id`` 0..4). ``rows``: per shard, ``(checkpoint rows, first
    of this rank's)``; this rank holds ``output_sizes[i] / tp_size`` of them (``B`` and ``C``
    of a group replicated over several ranks: that group's rows on each). None: each shard
    split evenly across the ranks."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 rows: list[tuple[int, int]] | None = None) -> None:
        super().__init__(input_size, output_sizes, bias)
        self.rows = rows if rows is not None else [
            (n * self.tp_size, self.tp_rank * n) for n in self.output_sizes]

    def shard_part(self, loaded: torch.Tensor, shard_id: object) -> torch.Tensor:
        """This rank's rows of shard ``shard_id``'s whole checkpoint tensor."""
        _, size = self.shard_rows(shard_id)
        whole, first = self.rows[cast(int, shard_id)]
        if loaded.shape[0] != whole:
            raise ValueError(f"in_proj shard {shard_id} has {whole} rows, the checkpoint "
                             f"tensor {loaded.shape[0]}")
        return loaded.narrow(0, first, size)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        """The whole checkpoint ``in_proj`` weight or bias: this rank's rows of each shard."""
        if shard_id is not None:
            super().weight_loader(param, loaded, shard_id)
            return
        whole = [n for n, _ in self.rows]
        if loaded.shape[0] != sum(whole):
            raise ValueError(f"in_proj has {sum(whole)} output rows, the checkpoint tensor "
                             f"{loaded.shape[0]}")
        for i, part in enumerate(loaded.split(whole)):
            super().weight_loader(param, part, i)


class GroupGatedRMSNorm(nn.Module):
    """``weight * rmsnorm(y * silu(z))`` in fp32 (the gate applied before the norm, as HF's
    ``MambaRMSNormGated`` variants with ``norm_before_gate=False``), over groups of
    ``group_size`` channels; ``norm_before_gate``: ``weight * rmsnorm(y) * silu(z)`` instead
    (Falcon-H1's ``mamba_norm_before_gate``). The weight holds this rank's ``size`` channels,
    which start at ``first`` of the checkpoint's. ``tp_size > 1`` with ``group_size`` larger
    than ``size`` (one group over every rank's channels): the sum of squares is all-reduced."""

    def __init__(self, size: int, group_size: int, eps: float, first: int = 0,
                 tp_size: int = 1, norm_before_gate: bool = False) -> None:
        super().__init__()
        self.group_size, self.eps, self.first = group_size, eps, first
        self.norm_before_gate = norm_before_gate
        #: Whether a group spans the ranks (then its statistics are all-reduced).
        self.across_ranks = group_size > size
        if self.across_ranks and group_size != size * tp_size:
            raise ValueError(f"a norm group of {group_size} channels must lie in one rank's "
                             f"{size} or span all {tp_size} ranks")
        if not self.across_ranks and size % group_size:
            raise ValueError(f"the norm's {size} channels must be whole groups of {group_size}")
        self.weight = nn.Parameter(torch.ones(size))
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        src = loaded if loaded.shape[0] == size else loaded.narrow(0, self.first, size)
        _copy(param, src, "mixer.norm.weight")

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``y``, ``z`` ``[T, C]`` -> fp32 ``[T, C]``."""
        gate = F.silu(z.float())
        h = y.float() if self.norm_before_gate else y.float() * gate
        if self.across_ranks:
            sq = all_reduce(h.pow(2).sum(-1, keepdim=True))
            out = self.weight.float() * (h * torch.rsqrt(sq / self.group_size + self.eps))
        else:
            g = h.view(h.shape[0], -1, self.group_size)
            g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
            out = self.weight.float() * g.view(h.shape)
        return out * gate if self.norm_before_gate else out


class Mamba2Mixer(RequestStateLayer):
    """A Mamba-2 mixer (module docstring) of ``num_heads`` heads of ``head_dim`` channels in
    ``n_groups`` B/C groups of ``state_size``; ``conv_kernel``: the convolution's width;
    ``activation``: a :data:`MAMBA_ACTIVATIONS` name, applied after the convolution;
    ``dt_min`` / ``dt_max``: the time step's clamp; ``proj_bias``: biases on ``in_proj`` and
    ``out_proj`` (``out_proj_bias``, when given, decides ``out_proj``'s alone);
    ``conv_bias``: on the convolution; ``norm_eps``: the gated norm's epsilon, normalising
    per group (``norm_per_group``, ``num_heads * head_dim / n_groups`` channels) or over all
    channels; ``norm_before_gate``: the norm, then the gate (default: the gate first);
    ``gated_norm`` False: no norm (no ``norm.weight``), the output ``y * silu(z)`` (Falcon-H1
    without ``mamba_rms_norm``). Keeps per request ``conv`` ``[conv_kernel - 1, conv_dim]``
    (model dtype) and ``ssm`` ``[heads, state_size, head_dim]`` (fp32), this rank's heads.

    Tensor parallelism: ``num_heads`` divisible by the ranks, and ``n_groups`` and the ranks
    dividing one another (fewer groups than ranks: each rank holds the one group its heads
    read; a per-group norm then needs ``n_groups`` 1)."""

    def __init__(
        self, hidden_size: int, num_heads: int, head_dim: int, n_groups: int, state_size: int,
        conv_kernel: int, activation: str = "silu", *, dt_min: float = 0.0,
        dt_max: float = math.inf, proj_bias: bool = False, conv_bias: bool = True,
        norm_eps: float = 1e-5, norm_per_group: bool = True,
        out_proj_bias: bool | None = None, gated_norm: bool = True,
        norm_before_gate: bool = False,
    ) -> None:
        super().__init__()
        if n_groups < 1 or num_heads % n_groups:
            raise ValueError(f"Mamba2Mixer: num_heads ({num_heads}) must be a multiple of "
                             f"n_groups ({n_groups})")
        if activation not in MAMBA_ACTIVATIONS:
            raise ValueError(f"Mamba2Mixer: activation must be one of "
                             f"{sorted(MAMBA_ACTIVATIONS)}, got {activation!r}")
        if min(head_dim, state_size) < 1 or conv_kernel < 2:
            raise ValueError(f"Mamba2Mixer: head_dim ({head_dim}) and state_size "
                             f"({state_size}) must be positive, conv_kernel ({conv_kernel}) "
                             f"at least 2")
        self.tp_rank, self.tp_size = rank, size = resolve_tp(None)
        if n_groups % size and size % n_groups:
            raise ValueError(f"Mamba2Mixer: n_groups ({n_groups}) and tensor_parallel_size "
                             f"({size}) must divide one another")
        #: This rank's heads, and its groups: whole groups, or (fewer groups than ranks) the
        #: one group its heads read, replicated over ``size / n_groups`` ranks.
        self.num_heads = split_evenly(num_heads, size, "the Mamba-2 num_heads")
        self.num_groups = max(1, n_groups // size)
        self.first_group = rank * n_groups // size
        if gated_norm and norm_per_group and 1 < n_groups < size:
            raise ValueError(f"Mamba2Mixer: a per-group norm of {n_groups} groups cannot span "
                             f"the {size} tensor-parallel ranks")
        self.head_dim, self.state_size = int(head_dim), int(state_size)
        self.intermediate = self.num_heads * self.head_dim
        self.bc_dim = self.num_groups * self.state_size
        self.conv_dim = self.intermediate + 2 * self.bc_dim
        self.kernel_size = int(conv_kernel)
        self.act_name = activation
        self.act = MAMBA_ACTIVATIONS[activation]
        self.dt_min, self.dt_max = float(dt_min), float(dt_max)
        whole_bc, first_bc = n_groups * self.state_size, self.first_group * self.state_size
        #: Per part of ``xBC``: ``(checkpoint rows, first of this rank's)``.
        self.xbc_rows = [(self.intermediate * size, rank * self.intermediate),
                         (whole_bc, first_bc), (whole_bc, first_bc)]
        self.in_proj = InProj(
            hidden_size, [self.intermediate * size, self.intermediate * size,
                          self.bc_dim * size, self.bc_dim * size, self.num_heads * size],
            bias=proj_bias, rows=[self.xbc_rows[0], *self.xbc_rows,
                                  (num_heads, rank * self.num_heads)])
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel_size))
        self.conv_weight.weight_loader = self._load_conv  # type: ignore[attr-defined]
        self.conv_bias: nn.Parameter | None = None
        if conv_bias:
            self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim))
            self.conv_bias.weight_loader = self._load_conv  # type: ignore[attr-defined]
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        for param in (self.dt_bias, self.A_log, self.D):
            param.weight_loader = self._load_heads  # type: ignore[attr-defined]
        group = self.intermediate * size // n_groups if norm_per_group \
            else self.intermediate * size
        #: The gated norm; None: the gate alone (``gated_norm`` False).
        self.norm: GroupGatedRMSNorm | None = None
        if gated_norm:
            self.norm = GroupGatedRMSNorm(self.intermediate, group, float(norm_eps),
                                          first=self.tp_rank * self.intermediate, tp_size=size,
                                          norm_before_gate=norm_before_gate)
        self.out_proj = RowLinear(self.intermediate * size, hidden_size,
                                  bias=proj_bias if out_proj_bias is None else out_proj_bias)

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """The depthwise Conv1d weight ``[D, 1, W]`` (or ``[D, W]``) or its bias ``[D]`` over
        the ``x``, ``B`` and ``C`` channels: this rank's slice of each."""
        src = loaded.reshape(loaded.shape[0], -1) if loaded.dim() == 3 else loaded
        whole = [n for n, _ in self.xbc_rows]
        if self.tp_size > 1 and src.shape[0] == sum(whole):
            mine = [self.intermediate, self.bc_dim, self.bc_dim]
            src = torch.cat([p.narrow(0, first, n) for p, (_, first), n
                             in zip(src.split(whole), self.xbc_rows, mine, strict=True)])
        _copy(param, src, "mixer.conv1d")

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A per-head vector (``dt_bias``, ``A_log``, ``D``): this rank's heads."""
        n = self.num_heads
        src = loaded.narrow(0, self.tp_rank * n, n) if self.tp_size > 1 \
            and loaded.shape[0] == n * self.tp_size else loaded
        _copy(param, src, "mixer.dt_bias / A_log / D")

    def request_state_shapes(self) -> StateShapes:
        """``conv`` (the convolution's last inputs) and ``ssm`` (the fp32 SSM state)."""
        return {"conv": ((self.kernel_size - 1, self.conv_dim), None),
                "ssm": ((self.num_heads, self.state_size, self.head_dim), torch.float32)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` (normed) -> ``[T, hidden]``; the step's requests' states advance."""
        return self.mix(cast(torch.Tensor, self.in_proj(x)))

    def mix(self, proj: torch.Tensor) -> torch.Tensor:
        """After ``in_proj`` (``[T, z | xBC | dt]``, e.g. fused with the norm before it):
        convolve, scan, gate-norm, project."""
        st = self.step_states()
        qsl, seq_lens, rows = st.query_start_loc, st.seq_lens, st.rows
        t = proj.shape[0]
        h, p, g, s = self.num_heads, self.head_dim, self.num_groups, self.state_size
        z, xbc, dt = proj.split([self.intermediate, self.conv_dim, h], dim=-1)
        states = self.request_states
        silu = self.act_name in ("silu", "swish")
        xbc = causal_conv1d(xbc, self.conv_weight, self.conv_bias, states["conv"], qsl,
                            seq_lens, rows, "silu" if silu else None,
                            state_table=st.state_table, row_slots=st.row_slots)
        if not silu:
            xbc = self.act(xbc)
        xs, b, c = xbc.split([self.intermediate, self.bc_dim, self.bc_dim], dim=-1)
        # the gates from the raw dt, and y + D x, inside the op (fp32 out)
        y = gated_delta_rule_auto(
            c.view(t, g, s), b.view(t, g, s), xs.view(t, h, p), dt, dt, states["ssm"], qsl,
            seq_lens, rows, 1.0, False, delta=False, state_table=st.state_table,
            gate_params=(self.A_log, self.dt_bias), dt_limits=(self.dt_min, self.dt_max),
            skip=self.D, out_dtype=torch.float32, max_query_len=st.max_query_len,
            row_slots=st.row_slots,
        ).view(t, h * p)
        if self.norm is None:  # (HF: the fp32 output times silu of the gate in its dtype)
            out = (y * F.silu(z)).to(proj.dtype)
        elif self.norm.across_ranks:
            out = self.norm(y, z).to(proj.dtype)
        else:
            out = gated_rms_norm(y, z, self.norm.weight, self.norm.eps, self.norm.group_size,
                                 self.norm.norm_before_gate, proj.dtype)
        return cast(torch.Tensor, self.out_proj(out))

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, groups={self.num_groups}, "
                f"state={self.state_size}, conv={self.kernel_size}, act={self.act_name}")
