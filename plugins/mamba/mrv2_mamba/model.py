"""Mamba-2 (``Mamba2ForCausalLM``: Mamba-Codestral-7B, state-spaces mamba2-130m .. 2.7b in
transformers format): token embeddings, a stack of pre-norm blocks

    h = h + mixer(norm(h))

and a final RMSNorm ``norm_f`` before the LM head (tied to the embeddings or not). No
attention anywhere: the model declares no KV cache layer, only per-request state (the engine's
blocks are then bookkeeping: scheduling and prefix caching's hashes, no memory).

* ``norm``: RMSNorm of ``layer_norm_epsilon``.
* ``mixer``: the core's Mamba-2 mixer (:class:`~mrv2.layers.Mamba2Mixer`) of ``num_heads``
  heads of ``head_dim`` channels (``num_heads * head_dim = expand * hidden_size``), ``n_groups``
  B/C groups of ``state_size``, a causal depthwise convolution of width ``conv_kernel`` (bias:
  ``use_conv_bias``) followed by ``hidden_act``, ``dt = softplus(dt + dt_bias)`` clamped to
  ``time_step_limit`` (as HF's full forward does), biases on ``in_proj`` / ``out_proj`` per
  ``use_bias``, and the gated RMSNorm ``rmsnorm(y * silu(z))`` (gate before norm) per group of
  ``num_heads * head_dim / n_groups`` channels, as the original ``mamba_ssm`` Mamba-2 (and
  vLLM) do. HF's eager ``MambaRMSNormGated`` normalises over all channels at once: the same
  for ``n_groups`` 1 (mamba2-130m .. 2.7b), not for Mamba-Codestral's 8 groups. Config fields
  HF ignores (``norm_before_gate``, ``rms_norm``) are ignored here too.
* ``residual_in_fp32`` (default True, as every published config): the residual stream is
  fp32; each block norms it rounded to the model dtype and adds its mixer's output to it in
  fp32; ``norm_f`` norms the fp32 stream and rounds once, after its weight (HF's
  ``Mamba2Block`` / ``Mamba2RMSNorm`` math). With an fp32 model it changes nothing, and the
  block takes the fused add-and-norm path.

Checkpoint names: transformers' ``backbone.embeddings`` (the original ``backbone.embedding``
too), ``backbone.layers.{i}.norm``, ``backbone.layers.{i}.mixer.*`` (``conv1d.weight`` /
``conv1d.bias`` onto the mixer's ``conv_weight`` / ``conv_bias``), ``backbone.norm_f``,
``lm_head`` (a tied checkpoint's fills the embeddings). Tensor parallelism splits each mixer
by heads: whole groups per rank where ``n_groups`` divides by the ranks, else (one group) the
group's ``B`` / ``C`` replicated and the gated norm's statistics all-reduced; the embeddings
and the LM head by vocabulary rows.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch

from mrv2.layers import CausalLM, DecoderModel, Mamba1Mixer, Mamba2Mixer, RMSNorm, norm_linear
from mrv2.layers.linear import resolve_tp
from mrv2.layers.mamba import MAMBA_ACTIVATIONS
from mrv2.layers.weights import StackedMapping
from mrv2_kernels.norm import rms_norm

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FAMILY = "Mamba-2"
#: Checkpoint name prefixes -> this model's (transformers' and the original names).
PREFIXES: tuple[tuple[str, str], ...] = (
    ("backbone.embeddings.", "model.embed_tokens."),
    ("backbone.embedding.", "model.embed_tokens."),
    ("backbone.norm_f.", "model.norm."),
    ("backbone.layers.", "model.layers."),
)


def time_step_limit_of(config: Any) -> tuple[float, float]:
    """``time_step_limit`` as ``(dt_min, dt_max)`` (None: ``(0, inf)``); ValueError naming the
    field unless ``0 <= min < max``."""
    limit = getattr(config, "time_step_limit", None)
    if limit is None:
        return 0.0, math.inf
    try:
        lo, hi = (float(v) for v in limit)
    except (TypeError, ValueError):
        raise ValueError(f"{FAMILY}: time_step_limit must be (min, max), got {limit!r}") from None
    if not 0.0 <= lo < hi:
        raise ValueError(f"{FAMILY}: time_step_limit must be (min, max) with 0 <= min < max, "
                         f"got {tuple(limit)}")
    return lo, hi


def mamba2_mixer(config: Any) -> Mamba2Mixer:
    """The core's :class:`~mrv2.layers.Mamba2Mixer` from Mamba-2's fields (module docstring);
    ValueError naming the field for sizes it cannot run."""
    hidden = int(config.hidden_size)
    heads, head_dim = int(config.num_heads), int(config.head_dim)
    groups = int(config.n_groups)
    intermediate = int(float(getattr(config, "expand", 2)) * hidden)
    if heads * head_dim != intermediate:
        raise ValueError(f"{FAMILY}: num_heads * head_dim ({heads} * {head_dim}) must equal "
                         f"expand * hidden_size ({intermediate})")
    if groups < 1 or heads % groups:
        raise ValueError(f"{FAMILY}: num_heads ({heads}) must be a multiple of n_groups "
                         f"({groups})")
    _, size = resolve_tp(None)
    if heads % size:
        raise ValueError(f"{FAMILY}: num_heads ({heads}) must be divisible by "
                         f"tensor_parallel_size ({size})")
    if (groups % size and size % groups) or 1 < groups < size:
        raise ValueError(f"{FAMILY}: n_groups ({groups}) must be divisible by "
                         f"tensor_parallel_size ({size}), or 1 (the mixers split by whole "
                         f"groups, whose gated norms stay on one rank; one group is "
                         f"replicated)")
    act = str(config.hidden_act)
    if act not in MAMBA_ACTIVATIONS:
        raise ValueError(f"{FAMILY}: hidden_act (the mixers' convolution activation) must be "
                         f"one of {sorted(MAMBA_ACTIVATIONS)}, got {act!r}")
    dt_min, dt_max = time_step_limit_of(config)
    return Mamba2Mixer(
        hidden, heads, head_dim, groups, int(config.state_size), int(config.conv_kernel), act,
        dt_min=dt_min, dt_max=dt_max, proj_bias=bool(config.use_bias),
        conv_bias=bool(getattr(config, "use_conv_bias", True)),
        norm_eps=float(config.layer_norm_epsilon), norm_per_group=True)


class Mamba2Block(torch.nn.Module):
    """One pre-norm block (Mamba-2's, and Mamba-1's with its mixer passed in): ``norm``, then
    ``mixer``, added to the residual stream (the add
    fused into the next block's norm, as the core's decoder layers do; with an fp32 residual
    stream in a lower-precision model, HF's separate fp32 add and rounded norm input)."""

    def __init__(self, config: Any, residual_in_fp32: bool,
                 mixer: Mamba2Mixer | Mamba1Mixer | None = None) -> None:
        super().__init__()
        self.residual_in_fp32 = residual_in_fp32
        self.norm = RMSNorm(int(config.hidden_size), eps=float(config.layer_norm_epsilon))
        #: The mixer (default: Mamba-2's from the config; Mamba-1 families pass theirs).
        self.mixer = mixer if mixer is not None else mamba2_mixer(config)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden_states, residual)`` in and out, as the core's decoder layers
        (``positions`` unused: position comes from the recurrence)."""
        mixer = self.mixer
        if self.residual_in_fp32 and hidden_states.dtype != torch.float32:
            # HF: residual = h.float(); h = residual + mixer(norm(h.to(dtype)))
            stream = hidden_states.float() if residual is None else residual + hidden_states
            proj, _ = norm_linear(self.norm, mixer.in_proj, stream.to(hidden_states.dtype),
                                  None)
            return mixer.mix(proj), stream
        proj, residual = norm_linear(self.norm, mixer.in_proj, hidden_states, residual)
        return mixer.mix(proj), residual


class FinalNorm(RMSNorm):
    """``norm_f``: the core's fused add-and-norm, or, with an fp32 residual stream under a
    lower-precision output, HF's ``Mamba2RMSNorm`` of the fp32 sum (the weight times the fp32
    normed value, rounded once to the output's dtype)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None or residual.dtype == x.dtype:
            return super().forward(x, residual)
        stream = residual + x
        return rms_norm(stream, self.weight, self.eps).to(x.dtype), stream


class Mamba2ForCausalLM(CausalLM):
    """Mamba-2 in the mrv2 model contract (module docstring): the core's
    :class:`~mrv2.layers.DecoderModel` of :class:`Mamba2Block` layers (its layer protocol
    names no attention) under :class:`~mrv2.layers.CausalLM`'s LM head and loader."""

    #: Nothing fused across checkpoint tensors (``in_proj`` is one tensor already).
    stacked_params: ClassVar[StackedMapping] = ()

    def __init__(self, config: PretrainedConfig) -> None:
        layers = int(config.num_hidden_layers)
        if layers < 1:
            raise ValueError(f"{FAMILY}: num_hidden_layers must be at least 1, got {layers}")
        fp32 = bool(getattr(config, "residual_in_fp32", True))
        shape = SimpleNamespace(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                                num_hidden_layers=layers,
                                rms_norm_eps=float(config.layer_norm_epsilon))
        model = DecoderModel(shape, lambda i: Mamba2Block(config, fp32,
                                                          self.make_mixer(config)))
        model.norm = FinalNorm(int(config.hidden_size), eps=float(config.layer_norm_epsilon))
        super().__init__(config, model)
        self.residual_in_fp32 = fp32

    @staticmethod
    def make_mixer(config: Any) -> Mamba2Mixer | Mamba1Mixer:
        """One layer's mixer from the config (Mamba-2's here)."""
        return mamba2_mixer(config)

    def rename(self, name: str) -> str | None:
        """``backbone.*`` onto the core's ``model.*`` names (``embeddings`` / ``embedding``
        -> ``embed_tokens``, ``norm_f`` -> ``norm``); ``mixer.conv1d.*`` -> ``conv_weight``
        / ``conv_bias``."""
        for old, new in PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        name = name.replace(".mixer.conv1d.weight", ".mixer.conv_weight")
        name = name.replace(".mixer.conv1d.bias", ".mixer.conv_bias")
        return super().rename(name)

    @property
    def mixers(self) -> list[Mamba2Mixer | Mamba1Mixer]:
        """Every layer's mixer, in order."""
        return [cast(Mamba2Block, layer).mixer for layer in self.model.layers]
