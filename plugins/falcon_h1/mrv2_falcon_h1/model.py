"""TII's Falcon-H1 (``FalconH1ForCausalLM``: 0.5B, 1.5B, 1.5B-Deep, 3B, 7B, 34B): a stack of
parallel hybrid layers, each running attention and a Mamba-2 mixer side by side on the same
normed input, then a gated MLP:

    x = input_layernorm(h)
    h = h + ssm_out * mamba(ssm_in * x) + attn_out * self_attn(attn_in * x)
    h = h + feed_forward(pre_ff_layernorm(h))

as transformers 5.17's ``FalconH1DecoderLayer`` (the multipliers are the config's
``ssm_in_multiplier``, ``ssm_out_multiplier``, ``attention_in_multiplier``,
``attention_out_multiplier``).

* ``mamba``: the core's Mamba-2 mixer (:class:`~mrv2.layers.Mamba2Mixer`) of ``mamba_n_heads``
  heads of ``mamba_d_head`` channels (``mamba_d_ssm`` of them in all, or ``mamba_expand *
  hidden_size``), ``mamba_n_groups`` B/C groups of ``mamba_d_state``, a convolution of width
  ``mamba_d_conv`` (bias: ``mamba_conv_bias``) and ``hidden_act`` after it, ``dt`` clamped to
  ``time_step_limit``; ``in_proj`` biased per ``mamba_proj_bias``, ``out_proj`` per
  ``projectors_bias``. ``in_proj``'s output ``[z | x | B | C | dt]`` is scaled part by part by
  ``ssm_multipliers`` (HF's ``mup_vector``). With ``mamba_rms_norm`` the scan's output goes
  through a gated RMSNorm per group (``mamba_norm_before_gate``: the norm, then times
  ``silu(z)``; else the gate first), without it (the published checkpoints) it is ``y *
  silu(z)`` alone.
* ``self_attn``: grouped-query attention with RoPE (``rope_parameters``) over the whole
  ``head_dim``, scaled ``head_dim ** -0.5``, keys times ``key_multiplier`` (before the
  rotation), biases per ``attention_bias``.
* ``feed_forward``: ``down_proj(up_proj(x) * act(gate_multiplier * gate_proj(x))) *
  down_multiplier`` (``mlp_multipliers``; biases per ``mlp_bias``).

The token embeddings are scaled by ``embedding_multiplier``, the logits by
``lm_head_multiplier``. Every multiplier is a constant before or after a linear map, so each
is folded into the weights as they load (:class:`FoldedRows`: the rows of ``qkv_proj``,
``o_proj``, ``gate_up_proj``, ``down_proj``, ``in_proj``, ``out_proj``, the embedding and the
LM head; biases take only the multipliers after the map): no multiply is left at run time, but
for a tied LM head (the logits are scaled; the embedding's lookup too). A LoRA adapter's
``B`` takes the same row factors (``LinearBase.row_order``), so adapters trained against HF's
module apply unchanged. Checkpoints whose scaled layers are quantized (no float ``weight`` to
fold into) are refused by name.

Where HF's cached decode step differs from its full forward, this follows the full forward
(the tests' reference): HF's one-token step (``mamba2_selective_state_update``) does not clamp
``dt`` to ``time_step_limit`` (the published checkpoints leave it ``(0, inf)``: no difference
there) and multiplies by ``silu(z)`` in the model dtype (a bf16 rounding).

``mamba_use_mlp`` false is refused: transformers builds and runs every layer's
``feed_forward`` whatever it says (no published checkpoint sets it).

Tensor parallelism: the mixers by heads (whole groups per rank where ``mamba_n_groups``
divides by the ranks, else the one group replicated, the gated norm's statistics all-reduced),
the attention by heads, the MLP by columns; each layer's attention and mixer outputs are
summed before one all-reduce.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from mrv2.distributed.parallel_state import all_reduce
from mrv2.layers import (
    CausalLM,
    DecoderModel,
    GatedMLP,
    Mamba2Mixer,
    RMSNorm,
    SelfAttention,
    get_rope,
    head_dim_of,
    norm_linear,
    norm_mlp,
)
from mrv2.layers.activation import ACTIVATIONS as MLP_ACTIVATIONS
from mrv2.layers.embedding import LMHead, ScaledEmbedding
from mrv2.layers.linear import resolve_tp
from mrv2.layers.mamba import MAMBA_ACTIVATIONS
from mrv2.layers.rotary import RotaryEmbedding
from mrv2.layers.weights import default_weight_loader

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FAMILY = "Falcon-H1"
#: ``ssm_multipliers``: one factor per part of ``in_proj``'s output.
SSM_PARTS = ("z", "x", "B", "C", "dt")
#: Per fused shard (None: the whole layer): ``(first row on this rank, rows, weight factor,
#: bias factor)``.
RowFactors = dict[object, tuple[int, int, float, float]]


def _scalar(config: Any, field: str) -> float:
    """A multiplier field (None or absent: 1); ValueError naming it unless finite."""
    value = getattr(config, field, None)
    value = 1.0 if value is None else float(value)
    if not math.isfinite(value):
        raise ValueError(f"{FAMILY}: {field} must be a finite number, got {value}")
    return value


def _vector(config: Any, field: str, names: tuple[str, ...]) -> tuple[float, ...]:
    """A list multiplier field of ``len(names)`` factors (None: all 1)."""
    value = getattr(config, field, None)
    if value is None:
        return (1.0,) * len(names)
    factors = tuple(float(v) for v in value)
    if len(factors) != len(names) or not all(math.isfinite(v) for v in factors):
        raise ValueError(f"{FAMILY}: {field} must be {len(names)} finite numbers "
                         f"({', '.join(names)}), got {list(value)}")
    return factors


def time_step_limit_of(config: Any) -> tuple[float, float]:
    """``time_step_limit`` as ``(dt_min, dt_max)`` (None: ``(0, inf)``)."""
    limit = getattr(config, "time_step_limit", None)
    if limit is None:
        return 0.0, math.inf
    lo, hi = (float(v) for v in limit)
    if not 0.0 <= lo < hi:
        raise ValueError(f"{FAMILY}: time_step_limit must be (min, max) with 0 <= min < max, "
                         f"got {tuple(limit)}")
    return lo, hi


def check_config(config: Any) -> None:
    """What the model cannot run, refused naming the field: ``mamba_use_mlp`` false, a
    ``hidden_act`` the mixers' convolution and the gated MLP do not both take, partial RoPE
    (HF's Falcon-H1 rotates whole heads), malformed multiplier lists."""
    if getattr(config, "mamba_use_mlp", True) is False:
        raise ValueError(f"{FAMILY}: mamba_use_mlp is false, but transformers builds and runs "
                         f"every layer's feed_forward whatever it says: such a checkpoint is "
                         f"not supported")
    act = str(config.hidden_act)
    if act not in MLP_ACTIVATIONS or act not in MAMBA_ACTIVATIONS:
        both = sorted(set(MLP_ACTIVATIONS) & set(MAMBA_ACTIVATIONS))
        raise ValueError(f"{FAMILY}: hidden_act (the gated MLP's and the Mamba-2 mixers') "
                         f"must be one of {both}, got {act!r}")
    params = getattr(config, "rope_parameters", None)
    partial = getattr(config, "partial_rotary_factor", None)
    if isinstance(params, Mapping):
        partial = params.get("partial_rotary_factor", partial)
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"{FAMILY}: partial_rotary_factor must be 1 (HF's Falcon-H1 rotates "
                         f"whole heads), got {partial}")
    _vector(config, "ssm_multipliers", SSM_PARTS)
    _vector(config, "mlp_multipliers", ("gate", "down"))


def mamba_mixer(config: Any) -> Mamba2Mixer:
    """The core's Mamba-2 mixer from Falcon-H1's ``mamba_*`` fields (module docstring);
    ValueError naming the field for sizes it cannot run."""
    heads, groups = int(config.mamba_n_heads), int(config.mamba_n_groups)
    if groups < 1 or heads % groups:
        raise ValueError(f"{FAMILY}: mamba_n_heads ({heads}) must be a multiple of "
                         f"mamba_n_groups ({groups})")
    d_ssm = getattr(config, "mamba_d_ssm", None)
    inner = int(d_ssm) if d_ssm is not None else int(config.mamba_expand * config.hidden_size)
    head_dim = config.mamba_d_head
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    if head_dim * heads != inner:
        raise ValueError(f"{FAMILY}: mamba_d_head ({head_dim}) times mamba_n_heads ({heads}) "
                         f"must be the mixer's width, mamba_d_ssm (or mamba_expand * "
                         f"hidden_size): {inner}")
    _, size = resolve_tp(None)
    if groups % size and size % groups:
        raise ValueError(f"{FAMILY}: mamba_n_groups ({groups}) and tensor_parallel_size "
                         f"({size}) must divide one another (the Mamba-2 mixers split by "
                         f"whole groups, or replicate one group over several ranks)")
    gated_norm = bool(getattr(config, "mamba_rms_norm", False))
    if gated_norm and 1 < groups < size:
        raise ValueError(f"{FAMILY}: with mamba_rms_norm, the gated norm of mamba_n_groups "
                         f"({groups}) groups cannot span the {size} tensor-parallel ranks")
    dt_min, dt_max = time_step_limit_of(config)
    return Mamba2Mixer(
        int(config.hidden_size), heads, head_dim, groups, int(config.mamba_d_state),
        int(config.mamba_d_conv), str(config.hidden_act), dt_min=dt_min, dt_max=dt_max,
        proj_bias=bool(config.mamba_proj_bias), conv_bias=bool(config.mamba_conv_bias),
        norm_eps=float(config.rms_norm_eps), norm_per_group=True,
        out_proj_bias=bool(getattr(config, "projectors_bias", False)), gated_norm=gated_norm,
        norm_before_gate=bool(getattr(config, "mamba_norm_before_gate", True)))


def _scale_rows(rows: RowFactors, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` ``[this rank's rows, ...]`` with each shard's rows times its weight factor,
    in place (what a LoRA adapter's ``B`` takes: ``LinearBase.row_order``)."""
    for first, count, factor, _ in rows.values():
        if factor != 1.0:
            tensor.narrow(0, first, count).mul_(factor)
    return tensor


class FoldedRows:
    """A parameter's ``weight_loader`` that loads as the one it wraps, then multiplies the
    rows just loaded (the shard's, or every shard's for a whole tensor) by their factors
    (``bias``: the bias factors). Reinstalling it over itself wraps the original loader again,
    so loading twice (``update_weights``) never scales twice."""

    def __init__(self, base: Callable[..., None], rows: RowFactors, bias: bool) -> None:
        self.base, self.rows, self.bias = base, rows, bias

    @classmethod
    def install(cls, param: nn.Parameter, rows: RowFactors, bias: bool) -> None:
        """Wrap ``param``'s loader (the default copy where it has none)."""
        current = getattr(param, "weight_loader", default_weight_loader)
        base = current.base if isinstance(current, FoldedRows) else current
        param.weight_loader = cls(base, rows, bias)  # type: ignore[attr-defined]

    def __call__(self, param: nn.Parameter, loaded: torch.Tensor, *shard: object) -> None:
        self.base(param, loaded, *shard)
        keys = [k for k in self.rows if k == shard[0]] if shard else list(self.rows)
        with torch.no_grad():
            for key in keys:
                first, count, weight, bias = self.rows[key]
                factor = bias if self.bias else weight
                if factor != 1.0:
                    param.data.narrow(0, first, count).mul_(factor)


class FalconH1Layer(nn.Module):
    """One parallel hybrid layer (module docstring): ``input_layernorm``, then ``mamba`` and
    ``self_attn`` on the normed input (their outputs summed), ``pre_ff_layernorm``, then
    ``feed_forward``. The multipliers live in the weights (:class:`FalconH1ForCausalLM`)."""

    def __init__(self, config: Any, layer_idx: int, rope: RotaryEmbedding) -> None:
        super().__init__()
        eps = float(config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps=eps)
        self.mamba = mamba_mixer(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = SelfAttention(config, layer_idx, rope, qkv_bias=bias, o_bias=bias)
        self.feed_forward = GatedMLP(config.hidden_size, int(config.intermediate_size),
                                     str(config.hidden_act),
                                     bias=bool(getattr(config, "mlp_bias", False)))
        self.tp_size = self.mamba.tp_size
        # both outputs' partial sums reduced at once (forward)
        self.mamba.out_proj.reduce_output = False
        self.self_attn.o_proj.reduce_output = False

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden_states, residual)`` in and out, as the core's decoder layers (the residual
        add fused into the next norm). The input norm runs fused with each projection after
        it (a decode step's norm + GEMV kernel), the second time over the new residual."""
        proj, residual = norm_linear(self.input_layernorm, self.mamba.in_proj, hidden_states,
                                     residual)
        qkv, _ = norm_linear(self.input_layernorm, self.self_attn.qkv_proj, residual, None)
        out = self.mamba.mix(proj) + self.self_attn.attend(positions, qkv)
        if self.tp_size > 1:
            out = all_reduce(out)
        return norm_mlp(self.pre_ff_layernorm, self.feed_forward, out, residual)

    def row_factors(self, config: Any) -> dict[str, RowFactors]:
        """Each scaled projection's :data:`RowFactors` on this rank, by its name in the layer
        (module docstring); projections whose factors are all 1 are left out."""
        a_in = _scalar(config, "attention_in_multiplier")
        a_out = _scalar(config, "attention_out_multiplier")
        key = _scalar(config, "key_multiplier")
        ssm_in = _scalar(config, "ssm_in_multiplier")
        ssm_out = _scalar(config, "ssm_out_multiplier")
        gate, down = _vector(config, "mlp_multipliers", ("gate", "down"))
        ssm = _vector(config, "ssm_multipliers", SSM_PARTS)
        qkv, gate_up = self.self_attn.qkv_proj, self.feed_forward.gate_up_proj
        hidden = self.self_attn.o_proj.output_size
        in_proj = self.mamba.in_proj
        out: dict[str, RowFactors] = {
            "self_attn.qkv_proj": {"q": (*qkv.shard_rows("q"), a_in, 1.0),
                                   "k": (*qkv.shard_rows("k"), a_in * key, key),
                                   "v": (*qkv.shard_rows("v"), a_in, 1.0)},
            "self_attn.o_proj": {None: (0, hidden, a_out, a_out)},
            "feed_forward.gate_up_proj": {0: (*gate_up.shard_rows(0), gate, gate),
                                          1: (*gate_up.shard_rows(1), 1.0, 1.0)},
            "feed_forward.down_proj": {None: (0, hidden, down, down)},
            "mamba.in_proj": {i: (*in_proj.shard_rows(i), ssm_in * m, m)
                              for i, m in enumerate(ssm)},
            "mamba.out_proj": {None: (0, hidden, ssm_out, ssm_out)},
        }
        return {name: rows for name, rows in out.items()
                if any(f != 1.0 for _, _, w, b in rows.values() for f in (w, b))}


class FalconH1ForCausalLM(CausalLM):
    """Falcon-H1 in the mrv2 model contract (module docstring)."""

    #: LoRA adapters' row factors go to the projections they may target.
    lora_rows: ClassVar[tuple[str, ...]] = ("self_attn.qkv_proj", "self_attn.o_proj",
                                           "feed_forward.gate_up_proj",
                                           "feed_forward.down_proj")

    def __init__(self, config: PretrainedConfig) -> None:
        check_config(config)
        rope = get_rope(config, head_dim_of(config))
        model = DecoderModel(config, lambda i: FalconH1Layer(config, i, rope))
        tied = bool(getattr(config, "tie_word_embeddings", False))
        embedding = _scalar(config, "embedding_multiplier")
        head = _scalar(config, "lm_head_multiplier")
        if tied and embedding != 1.0:  # (the tied head reads the unscaled table)
            model.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size,
                                                 embedding)
        super().__init__(config, model)
        #: The logits' factor left to apply (a tied head; an untied one holds it).
        self.logits_multiplier = head if tied else 1.0
        #: Module name -> the :data:`RowFactors` its weights take as they load.
        self.folds: dict[str, RowFactors] = {}
        for i, layer in enumerate(cast(Iterable[FalconH1Layer], model.layers)):
            for name, rows in layer.row_factors(config).items():
                self.folds[f"model.layers.{i}.{name}"] = rows
                if name in self.lora_rows:
                    module = cast(Any, layer.get_submodule(name))
                    module.row_order = functools.partial(_scale_rows, rows)
        if not tied:
            for name, factor in (("model.embed_tokens", embedding), ("lm_head", head)):
                if factor != 1.0:
                    rows = cast(Any, self.get_submodule(name)).weight.shape[0]
                    self.folds[name] = {None: (0, rows, factor, factor)}

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The LM head's logits (a tied head's times ``lm_head_multiplier``)."""
        logits = super().compute_logits(hidden_states)
        m = self.logits_multiplier
        return logits * m if m != 1.0 else logits

    def rename(self, name: str) -> str | None:
        """HF's names onto this model's: ``final_layernorm`` -> the core's ``norm``,
        ``mamba.conv1d.*`` -> ``conv_weight`` / ``conv_bias``; a saved ``mup_vector`` (HF
        keeps it as a non-persistent buffer, computed from the config) is skipped."""
        if name.endswith(".mamba.mup_vector"):
            return None
        name = name.replace("model.final_layernorm.", "model.norm.")
        name = name.replace(".mamba.conv1d.weight", ".mamba.conv_weight")
        name = name.replace(".mamba.conv1d.bias", ".mamba.conv_bias")
        return super().rename(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF checkpoint tensors, the multipliers folded into the rows as they load
        (:class:`FoldedRows`); returns the parameter names loaded. ValueError naming the
        layer where a scaled projection has no float weight (a quantized checkpoint)."""
        for name, rows in self.folds.items():
            module = self.get_submodule(name)
            if name == "lm_head" and not isinstance(module, LMHead):
                continue  # (a pooling engine's head: the checkpoint's is not read)
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or not weight.dtype.is_floating_point \
                    or weight.element_size() < 2:
                raise ValueError(f"{FAMILY}: {name} ({type(module).__name__}) has no float "
                                 f"weight to fold its muP multipliers into: quantized "
                                 f"Falcon-H1 checkpoints are not supported")
            FoldedRows.install(cast(nn.Parameter, weight), rows, bias=False)
            bias = getattr(module, "bias", None)
            if isinstance(bias, nn.Parameter):
                FoldedRows.install(bias, rows, bias=True)
        return super().load_weights(weights)
