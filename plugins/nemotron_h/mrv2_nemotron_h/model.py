"""Nemotron-H (``NemotronHForCausalLM``: Nemotron-H 8B/47B, Nemotron Nano 2 9B/12B): a stack of
pre-norm blocks, each ``x + mixer(RMSNorm(x))`` with one mixer per ``config.layers_block_type``:

* ``"linear_attention"`` (``M``): a Mamba-2 mixer (:class:`Mamba2Mixer`). ``in_proj`` gives
  the gate ``z`` (``mamba_num_heads * mamba_head_dim``), ``xBC`` (``x``, then ``n_groups``
  ``B`` and ``C`` vectors of ``ssm_state_size``) and ``dt`` per head; ``xBC`` goes through a
  causal depthwise convolution of width ``conv_kernel`` (bias: ``use_conv_bias``) and
  ``mamba_hidden_act``; ``dt = softplus(dt + dt_bias)`` clamped below at ``time_step_min`` (as
  transformers 5.17 does; no upper limit), ``A = -exp(A_log)``; per head the SSM ``S =
  exp(dt A) S + outer(B, dt x)``, ``y = S^T C + D x`` (head ``h`` reads group ``h / (heads /
  groups)``; :func:`mrv2_kernels.linear_attention.gated_delta_rule` with ``delta=False``);
  then ``y * silu(z)`` RMS-normed per group of ``heads * head_dim / n_groups`` channels
  (Zamba2's gated norm, gate before norm) and ``out_proj``. Per request the mixer keeps the
  convolution's last inputs and the fp32 SSM state (:mod:`mrv2.contract.request_state`), so
  the engine runs such a model without the prefix cache and without speculative decoding.
* ``"full_attention"`` (``*``): multi-head attention with grouped key/value heads, no
  positional encoding (no RoPE: position comes from the Mamba layers), no biases.
* ``"mlp"`` (``-``): ``down_proj(act(up_proj(x)))``, ``act``: ``mlp_hidden_act`` (``relu2``,
  squared ReLU, in the published checkpoints).
* ``"moe"`` (``E``, Nemotron 3's sparse layers) is refused: its routed experts are non-gated
  MLPs, which the core's :class:`~mrv2.layers.FusedMoE` (gated experts) does not run.

Checkpoint names: transformers 5's ``model.*`` and the published ``backbone.*``
(``embeddings``, ``layers.{i}.norm``, ``layers.{i}.mixer.*``, ``norm_f``); ``mtp.*`` (the
multi-token-prediction head) is not loaded. Tensor parallelism splits each Mamba-2 mixer by
whole groups (``n_groups`` and ``mamba_num_heads`` divisible by the ranks: each rank projects,
convolves and scans its heads and groups, norms its groups, all-reduces after ``out_proj``),
the attention by heads and the MLPs by columns, as the core's layers do.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn

from mrv2.contract.forward_context import get_forward_context
from mrv2.contract.request_state import RequestStateLayer, StateShapes
from mrv2.layers import (
    Attention,
    CausalLM,
    ColumnLinear,
    DecoderModel,
    MergedColumnLinear,
    QKVLinear,
    RMSNorm,
    RowLinear,
    head_dim_of,
)
from mrv2.layers.linear import norm_linear, resolve_tp, split_evenly
from mrv2.layers.weights import StackedMapping
from mrv2_kernels.linear_attention import causal_conv1d, gated_delta_rule

if TYPE_CHECKING:
    from transformers import PretrainedConfig

BLOCK_TYPES = ("linear_attention", "full_attention", "mlp")
#: The published checkpoints' one-letter layer pattern (``hybrid_override_pattern``).
PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
#: The names older configs (the published remote code) give the layer types.
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


#: The activations HF's ``ACT2FN`` names that these layers take (``mlp_hidden_act``,
#: ``mamba_hidden_act``).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu2": _relu2, "relu": F.relu, "silu": F.silu, "swish": F.silu, "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation_of(config: Any, field: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function ``config.<field>`` names; ValueError naming the field otherwise."""
    name = getattr(config, field)
    if name not in ACTIVATIONS:
        raise ValueError(f"Nemotron-H: {field} must be one of {sorted(ACTIVATIONS)}, "
                         f"got {name!r}")
    return ACTIVATIONS[name]


def block_types_of(config: Any) -> list[str]:
    """Each layer's mixer (``layers_block_type``, else ``hybrid_override_pattern``; the older
    names ``mamba`` / ``attention`` read as the new ones); ValueError naming ``"moe"`` layers
    (not supported) or an unknown type."""
    types = getattr(config, "layers_block_type", None)
    if types is None and getattr(config, "hybrid_override_pattern", None) is not None:
        types = [PATTERN.get(c, c) for c in config.hybrid_override_pattern]
    if not types:
        raise ValueError("Nemotron-H: the config names no layers (layers_block_type)")
    types = [LEGACY.get(t, t) for t in types]
    moe = [i for i, t in enumerate(types) if t == "moe"]
    if moe:
        raise ValueError(
            f"Nemotron-H: layers {moe} are 'moe' layers; their routed experts are non-gated "
            f"{getattr(config, 'mlp_hidden_act', '?')} MLPs, which the core's FusedMoE (gated "
            f"experts only) does not run: Nemotron-H MoE checkpoints are not supported")
    bad = sorted({t for t in types if t not in BLOCK_TYPES})
    if bad:
        raise ValueError(f"Nemotron-H: layers_block_type must list one of {list(BLOCK_TYPES)} "
                         f"per layer; got {bad}")
    return types


def _copy(param: nn.Parameter, src: torch.Tensor, what: str) -> None:
    if tuple(src.shape) != tuple(param.shape):
        raise ValueError(f"{what}: this rank's part has shape {tuple(src.shape)}, the parameter "
                         f"{tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(src)


class InProj(MergedColumnLinear):
    """The mixer's ``in_proj``: shards ``[z | x | B | C | dt]`` each split across the ranks,
    loaded from the one checkpoint tensor (or per shard, ``shard_id`` 0..4)."""

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None
    ) -> None:
        """The whole checkpoint ``in_proj`` weight or bias: this rank's rows of each shard."""
        if shard_id is not None:
            super().weight_loader(param, loaded, shard_id)
            return
        whole = [n * self.tp_size for n in self.output_sizes]
        if loaded.shape[0] != sum(whole):
            raise ValueError(f"in_proj has {sum(whole)} output rows, the checkpoint tensor "
                             f"{loaded.shape[0]}")
        for i, part in enumerate(loaded.split(whole)):
            super().weight_loader(param, part, i)


class GroupGatedRMSNorm(nn.Module):
    """``weight * rmsnorm_per_group(y * silu(z))`` in fp32 (HF's ``Zamba2RMSNormGated`` with the
    gate applied before the norm), groups of ``group_size`` channels; the weight holds this
    rank's channels (whole groups)."""

    def __init__(self, size: int, group_size: int, eps: float, first: int = 0) -> None:
        super().__init__()
        self.group_size, self.eps, self.first = group_size, eps, first
        self.weight = nn.Parameter(torch.ones(size))
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        src = loaded if loaded.shape[0] == size else loaded.narrow(0, self.first, size)
        _copy(param, src, "mixer.norm.weight")

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``y``, ``z`` ``[T, C]`` -> fp32 ``[T, C]``."""
        h = y.float() * F.silu(z.float())
        g = h.view(h.shape[0], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.float() * g.view(h.shape)


class Mamba2Mixer(RequestStateLayer):
    """Nemotron-H's Mamba-2 mixer (module docstring); HF's ``mixer.*`` names (``conv1d.*``
    loaded into ``conv_weight`` / ``conv_bias``). Keeps per request ``conv`` ``[W - 1,
    conv_dim]`` (model dtype) and ``ssm`` ``[heads, ssm_state_size, mamba_head_dim]`` (fp32)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        total_h, total_g = int(config.mamba_num_heads), int(config.n_groups)
        if total_g < 1 or total_h % total_g:
            raise ValueError(f"Nemotron-H: mamba_num_heads ({total_h}) must be a multiple of "
                             f"n_groups ({total_g})")
        self.tp_rank, self.tp_size = resolve_tp(None)
        #: This rank's heads and groups (whole groups).
        self.num_groups = split_evenly(total_g, self.tp_size, "n_groups")
        self.num_heads = total_h // total_g * self.num_groups
        self.head_dim = int(config.mamba_head_dim)
        self.state_size = int(config.ssm_state_size)
        self.intermediate = self.num_heads * self.head_dim
        self.bc_dim = self.num_groups * self.state_size
        self.conv_dim = self.intermediate + 2 * self.bc_dim
        self.kernel_size = int(config.conv_kernel)
        self.act_name = str(config.mamba_hidden_act)
        self.act = activation_of(config, "mamba_hidden_act")
        self.dt_min = float(config.time_step_min)
        hidden, size, bias = int(config.hidden_size), self.tp_size, bool(config.use_bias)
        self.in_proj = InProj(hidden, [self.intermediate * size, self.intermediate * size,
                                       self.bc_dim * size, self.bc_dim * size,
                                       self.num_heads * size], bias=bias)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, self.kernel_size))
        self.conv_weight.weight_loader = self._load_conv  # type: ignore[attr-defined]
        self.conv_bias: nn.Parameter | None = None
        if config.use_conv_bias:
            self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim))
            self.conv_bias.weight_loader = self._load_conv  # type: ignore[attr-defined]
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        for param in (self.dt_bias, self.A_log, self.D):
            param.weight_loader = self._load_heads  # type: ignore[attr-defined]
        group_size = self.intermediate // self.num_groups
        self.norm = GroupGatedRMSNorm(self.intermediate, group_size,
                                      float(config.layer_norm_epsilon),
                                      first=self.tp_rank * self.intermediate)
        self.out_proj = RowLinear(self.intermediate * size, hidden, bias=bias)

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """The depthwise Conv1d weight ``[D, 1, W]`` (or ``[D, W]``) or its bias ``[D]`` over
        the ``x``, ``B`` and ``C`` channels: this rank's slice of each."""
        src = loaded.reshape(loaded.shape[0], -1) if loaded.dim() == 3 else loaded
        size, rank = self.tp_size, self.tp_rank
        if size > 1 and src.shape[0] == self.conv_dim * size:
            parts = src.split([self.intermediate * size, self.bc_dim * size, self.bc_dim * size])
            src = torch.cat([p.narrow(0, rank * (p.shape[0] // size), p.shape[0] // size)
                             for p in parts])
        _copy(param, src, "mixer.conv1d")

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A per-head vector (``dt_bias``, ``A_log``, ``D``): this rank's heads."""
        n = self.num_heads
        src = loaded.narrow(0, self.tp_rank * n, n) if self.tp_size > 1 \
            and loaded.shape[0] == n * self.tp_size else loaded
        _copy(param, src, "mixer.dt_bias / A_log / D")

    def request_state_shapes(self) -> StateShapes:
        return {"conv": ((self.kernel_size - 1, self.conv_dim), None),
                "ssm": ((self.num_heads, self.state_size, self.head_dim), torch.float32)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` (normed) -> ``[T, hidden]``; the step's requests' states advance."""
        return self.mix(cast(torch.Tensor, self.in_proj(x)))

    def mix(self, proj: torch.Tensor) -> torch.Tensor:
        """After ``in_proj`` (``[T, z | xBC | dt]``): convolve, scan, gate-norm, project."""
        ctx = get_forward_context()
        if ctx.state_rows is None:
            raise RuntimeError("Mamba2Mixer needs the forward context's state_rows (set by "
                               "the runner for a model with per-request state)")
        md = ctx.metadata
        n = md.num_reqs
        qsl, seq_lens, rows = md.query_start_loc[: n + 1], md.seq_lens[:n], ctx.state_rows[:n]
        t = proj.shape[0]
        h, p, g, s = self.num_heads, self.head_dim, self.num_groups, self.state_size
        z, xbc, dt = proj.split([self.intermediate, self.conv_dim, h], dim=-1)
        states = self.request_states
        silu = self.act_name in ("silu", "swish")
        xbc = causal_conv1d(xbc, self.conv_weight, self.conv_bias, states["conv"], qsl,
                            seq_lens, rows, "silu" if silu else None)
        if not silu:
            xbc = self.act(xbc)
        xs, b, c = xbc.split([self.intermediate, self.bc_dim, self.bc_dim], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(min=self.dt_min)
        a = -torch.exp(self.A_log.float())
        xs = xs.float().reshape(t, h, p)
        y = gated_delta_rule(c.reshape(t, g, s), b.reshape(t, g, s), xs, dt * a, dt,
                             states["ssm"], qsl, seq_lens, rows, 1.0, False, delta=False)
        y = y + self.D.float()[:, None] * xs
        out = self.norm(y.reshape(t, h * p), z).to(proj.dtype)
        return cast(torch.Tensor, self.out_proj(out))


class NemotronHAttention(nn.Module):
    """Nemotron-H's attention: q/k/v fused into ``qkv_proj``, no RoPE, no biases (HF builds
    none whatever ``attention_bias`` says), scale ``head_dim ** -0.5``."""

    def __init__(self, config: Any, cache_idx: int) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, heads, kv_heads)
        self.o_proj = RowLinear(heads * self.head_dim, config.hidden_size)
        self.attn = Attention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads,
                              self.head_dim, self.head_dim ** -0.5, cache_idx)

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """After the projection: attend (no rotation), project."""
        q, k, v = self.qkv_proj.split(qkv)
        return cast(torch.Tensor, self.o_proj(self.attn(q, k, v)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` (normed) -> ``[T, hidden]``."""
        return self.attend(cast(torch.Tensor, self.qkv_proj(x)))


class NemotronHMLP(nn.Module):
    """``down_proj(act(up_proj(x)))`` (no gate), ``act``: ``mlp_hidden_act``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        self.act = activation_of(config, "mlp_hidden_act")
        self.up_proj = ColumnLinear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = RowLinear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden]`` (normed) -> ``[T, hidden]``."""
        return cast(torch.Tensor, self.down_proj(self.act(self.up_proj(x))))


class NemotronHBlock(nn.Module):
    """One pre-norm block: ``norm``, then ``mixer`` (its type's), added to the residual stream
    (the add fused into the next block's norm, as the core's decoder layers do; HF keeps the
    residual in the model dtype too)."""

    def __init__(self, config: Any, kind: str, cache_idx: int) -> None:
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mixer: Mamba2Mixer | NemotronHAttention | NemotronHMLP
        if kind == "linear_attention":
            self.mixer = Mamba2Mixer(config)
        elif kind == "full_attention":
            self.mixer = NemotronHAttention(config, cache_idx)
        else:
            self.mixer = NemotronHMLP(config)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        mixer = self.mixer
        if isinstance(mixer, Mamba2Mixer):
            proj, residual = norm_linear(self.norm, mixer.in_proj, hidden_states, residual)
            return mixer.mix(proj), residual
        if isinstance(mixer, NemotronHAttention):
            qkv, residual = norm_linear(self.norm, mixer.qkv_proj, hidden_states, residual)
            return mixer.attend(qkv), residual
        up, residual = norm_linear(self.norm, mixer.up_proj, hidden_states, residual)
        return cast(torch.Tensor, mixer.down_proj(mixer.act(up))), residual


class NemotronHForCausalLM(CausalLM):
    """Nemotron-H in the mrv2 model contract (module docstring)."""

    #: Only the attention's q/k/v are fused (the MLPs' ``up_proj`` stands alone).
    stacked_params: ClassVar[StackedMapping] = (
        ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
    )

    def __init__(self, config: PretrainedConfig) -> None:
        types = block_types_of(config)
        cache_idx = [types[:i].count("full_attention") for i in range(len(types))]
        shape = SimpleNamespace(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                                num_hidden_layers=len(types),
                                rms_norm_eps=config.layer_norm_epsilon)
        super().__init__(config, DecoderModel(shape, lambda i: NemotronHBlock(
            config, types[i], cache_idx[i])))
        self.block_types = types

    def rename(self, name: str) -> str | None:
        """``backbone.*`` -> ``model.*``; ``embeddings`` / ``norm_f`` -> the core's
        ``embed_tokens`` / ``norm``; ``mixer.conv1d.*`` -> ``conv_weight`` / ``conv_bias``;
        ``mtp.*`` skipped."""
        if name.startswith(("mtp.", "model.mtp.", "backbone.mtp.")):
            return None
        if name.startswith("backbone."):
            name = "model." + name[len("backbone."):]
        for old, new in (("model.embeddings.", "model.embed_tokens."),
                         ("model.norm_f.", "model.norm.")):
            if name.startswith(old):
                name = new + name[len(old):]
        name = name.replace(".mixer.conv1d.weight", ".mixer.conv_weight")
        name = name.replace(".mixer.conv1d.bias", ".mixer.conv_bias")
        return super().rename(name)
