"""Qwen3.5 (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM`` and, for text prompts, their
``*ForConditionalGeneration`` checkpoints): Qwen3-Next's hybrid text model
(:mod:`mrv2_qwen.qwen3_next`: Gated DeltaNet and gated full-attention layers per
``layer_types``, zero-centered RMSNorms, the gated per-value-head norm, the attention's output
gate, RoPE over the first ``partial_rotary_factor`` of each head), with three differences:

* the Gated DeltaNet's checkpoint projections are ``in_proj_qkv`` (``[q | k | v]``, each over
  all heads), ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``, already laid out by kind: they
  load as shards of the same fused ``in_proj_qkvz`` / ``in_proj_ba`` (each shard split across
  the tensor-parallel ranks by heads), and nothing is regrouped after loading; the one
  ``in_proj_qkv`` tensor is split into q, k and v as it loads, a quantized checkpoint's
  tensors of it too (Qwen3.5-FP8's block scales, GPTQ / AWQ / compressed-tensors' packed
  weights, scales and zero points: :func:`split_rows`);
* Qwen3.5's MLP is a dense SwiGLU on every layer; Qwen3.5-MoE's the routed experts (softmax
  top-k, always renormalized) plus the gated shared expert on every layer;
* the RoPE is M-RoPE (``mrope_section``): for text, whose three position ids are equal, it is
  the ordinary rotation of the rotary dimensions, which is what runs here.

The ``*ForConditionalGeneration`` checkpoints hold the text model under
``model.language_model.`` (the config's ``text_config``) beside the vision tower
(``model.visual.``), whose tensors are skipped here: a prompt with ``multi_modal_data`` is
refused when it arrives (:class:`Qwen3_5TextOnlyInputs`). That is how they serve where
``mrv2-plugin-qwen-vl`` is not installed; where it is, the plugin registers them with the
vision tower (:mod:`mrv2_qwen.qwen3_5_vl`). The MTP head (``mtp.*``) is not loaded.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from mrv2.config import EngineConfig
from mrv2.contract.input_processor import InputProcessor
from mrv2.contract.requests import MultiModalItem
from mrv2.layers import STACKED_PARAMS
from mrv2.layers.linear import MergedColumnLinear
from mrv2.layers.weights import StackedMapping
from mrv2.model_loader.build import vl_text_config, vl_text_name
from mrv2_qwen.qwen3_next import GatedDeltaNet, Qwen3NextForCausalLM

#: The vision tower's checkpoint prefixes (skipped).
VISION_PREFIXES = ("model.visual.", "visual.")
_QKV = ".linear_attn.in_proj_qkv."
#: The tensors of a (quantized) layer indexed by its output rows on dimension 0 (float and FP8
#: weights and biases, block scales; compressed-tensors' packed weights, scales, zero points)
_ROWS_FIRST = ("weight", "bias", "weight_scale_inv", "weight_packed", "weight_scale",
               "weight_zero_point")
#: ... on dimension 1 (GPTQ's and AWQ's packed weights, zero points and scales)...
_ROWS_SECOND = ("qweight", "qzeros", "scales")
#: ... and by none (each shard takes the whole: the input columns' groups).
_SHARED = ("g_idx", "weight_g_idx")


def split_rows(name: str, tensor: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Checkpoint tensor ``name`` (``<layer>.<role>``) of a layer of ``sum(sizes)`` output
    rows as the tensors of its parts of ``sizes`` rows, whatever the layer's format: a float
    or block-FP8 weight and its ``weight_scale_inv``, GPTQ / AWQ / compressed-tensors tensors
    (packed or grouped along the rows: each part's share of them, which must be whole).
    ValueError naming the tensor where a part's rows do not fall on a whole packed word or
    scale block, or for an unknown role."""
    role = name.rsplit(".", 1)[-1]
    total = sum(sizes)
    if role in _SHARED:
        return [tensor] * len(sizes)
    if role == "weight_shape":  # compressed-tensors' [N, K]
        return [torch.tensor([n, int(tensor[1])], dtype=tensor.dtype) for n in sizes]
    if role not in _ROWS_FIRST + _ROWS_SECOND:
        raise ValueError(f"{name}: cannot split a {role!r} tensor by output rows")
    dim = 0 if role in _ROWS_FIRST else 1
    if tensor.dim() <= dim:  # (a per-tensor scale: no rows to split)
        raise ValueError(f"{name}: cannot split a {tuple(tensor.shape)} tensor by output rows")
    rows = tensor.shape[dim]  # (the rows, or their packed words or blocks)
    if any(n * rows % total for n in sizes):
        raise ValueError(f"{name}: {tuple(tensor.shape)} does not split into parts of "
                         f"{sizes} output rows (each part must fill whole packed words or "
                         f"scale blocks: {rows} of them for {total} rows)")
    return list(tensor.split([n * rows // total for n in sizes], dim))


class Qwen3_5GatedDeltaNet(GatedDeltaNet):  # noqa: N801 (HF's class names)
    """Qwen3.5's Gated DeltaNet: Qwen3-Next's (:class:`~mrv2_qwen.qwen3_next.GatedDeltaNet`)
    with projections laid out by kind in the checkpoint: ``in_proj_qkvz`` takes shards
    ``q, k, v, z`` (0-3), ``in_proj_ba`` shards ``b, a`` (0, 1), each split across the ranks
    by heads, so this rank's rows are ``[q_r | k_r | v_r | z_r]`` and ``[b_r | a_r]`` as
    loaded."""

    def build_in_projections(self, hidden: int) -> None:
        size = self.tp_size
        key, value = self.key_dim * size, self.value_dim * size
        self.in_proj_qkvz = MergedColumnLinear(hidden, [key, key, value, value])
        self.in_proj_ba = MergedColumnLinear(hidden, [self.num_v_heads * size] * 2)

    def in_projections_by_kind(self) -> bool:
        return True

    def process_weights_after_loading(self) -> None:
        """Nothing to regroup (the projections' own hooks run after this one)."""


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):  # noqa: N801 (HF's class names)
    """Qwen3.5 / Qwen3.5-MoE in the mrv2 model contract (module docstring): the dense MLP
    where the config has no ``num_experts``, the experts with the gated shared expert where
    it has."""

    delta_net = Qwen3_5GatedDeltaNet
    stacked_params: ClassVar[StackedMapping] = (
        *STACKED_PARAMS,
        ("in_proj_qkvz", "in_proj_q", 0), ("in_proj_qkvz", "in_proj_k", 1),
        ("in_proj_qkvz", "in_proj_v", 2), ("in_proj_qkvz", "in_proj_z", 3),
        ("in_proj_ba", "in_proj_b", 0), ("in_proj_ba", "in_proj_a", 1),
        # (split into q, k, v before loading: :meth:`_split_qkv`; this entry names its layer
        # for the quantized layers' discovery and for LoRA adapters of ``in_proj_qkv``)
        ("in_proj_qkvz", "in_proj_qkv", (0, 1, 2)),
    )

    def _split_qkv(self, weights: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each ``in_proj_qkv.*`` tensor as its ``in_proj_q`` / ``in_proj_k`` /
        ``in_proj_v`` parts (``linear_num_key_heads * linear_key_head_dim`` rows for q and k):
        the weight, or a quantized checkpoint's tensors (FP8's block scales, GPTQ / AWQ /
        compressed-tensors' packed weights, scales and zero points: :func:`split_rows`)."""
        cfg = self.config
        key = int(cfg.linear_num_key_heads) * int(cfg.linear_key_head_dim)
        sizes = [key, key, int(cfg.linear_num_value_heads) * int(cfg.linear_value_head_dim)]
        for name, tensor in weights:
            if _QKV not in name:
                yield name, tensor
                continue
            stem, _, role = name.partition(_QKV)
            parts = split_rows(name, tensor, sizes)
            for kind, part in zip("qkv", parts, strict=True):
                yield f"{stem}.linear_attn.in_proj_{kind}.{role}", part

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF checkpoint tensors (Qwen3-Next's loader: norms as ``1 + w``, ``mtp.*``
        skipped), ``in_proj_qkv`` split into its three shards."""
        return super().load_weights(self._split_qkv(weights))


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):  # noqa: N801 (HF's class names)
    """A Qwen3.5 / Qwen3.5-MoE vision-language checkpoint served for text prompts: the text
    model from ``text_config`` (the LM head tied by the top-level ``tie_word_embeddings``),
    its tensors from ``model.language_model.*``; the vision tower's skipped
    (:class:`Qwen3_5TextOnlyInputs` refuses media: ``mrv2-plugin-qwen-vl`` is not
    installed). ``self.hf_config`` is the composite config."""

    def __init__(self, config: Any) -> None:
        super().__init__(vl_text_config(config, type(self).__name__))
        self.hf_config = config

    def rename(self, name: str) -> str | None:
        """``model.language_model.*`` as ``model.*``; the vision tower's tensors None."""
        if name.startswith(VISION_PREFIXES):
            return None
        return super().rename(vl_text_name(name))


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):  # noqa: N801 (HF's class names)
    """Qwen3.5-MoE (e.g. Qwen3.5-35B-A3B): :class:`Qwen3_5ForCausalLM` with its experts."""


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):  # noqa: N801
    """Qwen3.5-MoE's vision-language checkpoints, for text prompts
    (:class:`Qwen3_5ForConditionalGeneration`)."""


class Qwen3_5TextOnlyInputs(InputProcessor):  # noqa: N801 (HF's class names)
    """The input processor of the ``*ForConditionalGeneration`` checkpoints: text prompts
    only. Any ``multi_modal_data`` (images, videos) is refused as the request arrives, before
    anything of it runs, naming the plugin that serves them (``mrv2-plugin-qwen-vl``)."""

    text_only = True

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: EngineConfig
                 ) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        arch = (list(getattr(hf_config, "architectures", None) or []) or ["Qwen3.5"])[0]
        self.images_refused = (f"{arch} takes images and videos where "
                               f"mrv2-plugin-qwen-vl is installed (pip install "
                               f"mrv2-plugin-qwen-vl); without it, send text prompts only")

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Always a ValueError naming ``multi_modal_data`` and its keys."""
        keys = ", ".join(sorted(map(str, mm_data))) or "empty"
        raise ValueError(f"multi_modal_data ({keys}): {self.images_refused}")
