"""Mamba-1 (``MambaForCausalLM``: state-spaces mamba-130m .. 2.8b in transformers format,
``-hf``) and FalconMamba (``FalconMambaForCausalLM``: Falcon-Mamba-7B): Mamba-2's block
structure (:mod:`mrv2_mamba.model`: token embeddings, pre-norm blocks ``h = h +
mixer(norm(h))``, ``norm_f``, the LM head tied or not, the fp32 residual stream of
``residual_in_fp32``) around the core's Mamba-1 mixer (:class:`~mrv2.layers.Mamba1Mixer`):

* ``intermediate_size`` channels (``expand * hidden_size``), a ``state_size`` SSM state per
  channel, a causal depthwise convolution of width ``conv_kernel`` (bias: ``use_conv_bias``)
  followed by ``hidden_act``, the low-rank time step of ``time_step_rank`` (HF resolves
  ``"auto"`` to ``ceil(hidden_size / 16)``), biases on ``in_proj`` / ``out_proj`` per
  ``use_bias``; no ``dt`` clamp (HF's Mamba-1 has none).
* FalconMamba: the same, with weightless RMSNorms of ``mixer_rms_eps`` on ``dt`` (before
  ``dt_proj``), ``B`` and ``C`` (HF's ``FalconMambaWeightlessRMSNorm``: its dummy
  ``*_layernorm.weight`` buffers, never saved, are ignored if a checkpoint has them).

Checkpoint names: as Mamba-2's (``backbone.embeddings`` or ``backbone.embedding``,
``backbone.layers.{i}.norm`` / ``mixer.*``, ``backbone.norm_f``, ``lm_head``). Tensor
parallelism splits each mixer by channels (``intermediate_size`` divisible by the ranks).
"""

from __future__ import annotations

from typing import Any, ClassVar

from mrv2.layers import Mamba1Mixer
from mrv2.layers.linear import resolve_tp
from mrv2.layers.mamba import MAMBA_ACTIVATIONS
from mrv2_mamba.model import Mamba2ForCausalLM


def mamba1_mixer(config: Any, family: str, bcdt_norm: str | None, norm_eps: float
                 ) -> Mamba1Mixer:
    """The core's Mamba-1 mixer from Mamba's config fields (``intermediate_size``,
    ``state_size``, ``conv_kernel``, ``time_step_rank``, ``hidden_act``, ``use_bias``,
    ``use_conv_bias``); ValueError naming the field for sizes it cannot run."""
    hidden = int(config.hidden_size)
    intermediate = getattr(config, "intermediate_size", None)
    intermediate = int(intermediate if intermediate is not None
                       else float(getattr(config, "expand", 2)) * hidden)
    rank = getattr(config, "time_step_rank", "auto")
    rank = -(-hidden // 16) if rank == "auto" else int(rank)
    _, size = resolve_tp(None)
    if intermediate % size:
        raise ValueError(f"{family}: intermediate_size ({intermediate}) must be divisible by "
                         f"tensor_parallel_size ({size})")
    act = str(config.hidden_act)
    if act not in MAMBA_ACTIVATIONS:
        raise ValueError(f"{family}: hidden_act (the mixers' convolution activation) must be "
                         f"one of {sorted(MAMBA_ACTIVATIONS)}, got {act!r}")
    return Mamba1Mixer(
        hidden, intermediate, int(config.state_size), int(config.conv_kernel), rank, act,
        proj_bias=bool(getattr(config, "use_bias", False)),
        conv_bias=bool(getattr(config, "use_conv_bias", True)), bcdt_norm=bcdt_norm,
        norm_eps=norm_eps)


class MambaForCausalLM(Mamba2ForCausalLM):
    """Mamba-1 in the mrv2 model contract (module docstring): Mamba-2's model with
    :class:`~mrv2.layers.Mamba1Mixer` mixers."""

    family: ClassVar[str] = "Mamba"

    @staticmethod
    def make_mixer(config: Any) -> Mamba1Mixer:
        """One layer's Mamba-1 mixer."""
        return mamba1_mixer(config, MambaForCausalLM.family, None, 1e-6)


class FalconMambaForCausalLM(MambaForCausalLM):
    """FalconMamba in the mrv2 model contract: Mamba-1 with weightless RMSNorms (epsilon
    ``mixer_rms_eps``) on each mixer's ``dt``, ``B`` and ``C``."""

    family: ClassVar[str] = "FalconMamba"

    @staticmethod
    def make_mixer(config: Any) -> Mamba1Mixer:
        """One layer's Mamba-1 mixer with FalconMamba's weightless norms."""
        return mamba1_mixer(config, FalconMambaForCausalLM.family, "weightless",
                            float(getattr(config, "mixer_rms_eps", 1e-6)))

    def rename(self, name: str) -> str | None:
        """Mamba's names; HF's dummy ``dt`` / ``B`` / ``C`` norm weights dropped."""
        if name.endswith(("dt_layernorm.weight", "b_layernorm.weight", "c_layernorm.weight")):
            return None
        return super().rename(name)
