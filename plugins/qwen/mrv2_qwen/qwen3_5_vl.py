"""Qwen3.5's vision-language checkpoints with images and videos
(``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``: every published
Qwen3.5 and Qwen3.5-MoE), where ``mrv2-plugin-qwen-vl`` is installed (the plugin registers
them so then; without it they serve text prompts, :mod:`mrv2_qwen.qwen3_5`).

As transformers 5.17 models them: the text model is Qwen3.5's hybrid
(:class:`~mrv2_qwen.qwen3_5.Qwen3_5ForCausalLM`, from ``text_config``), its full-attention
layers rotating the first ``partial_rotary_factor`` of each head by *interleaved* M-RoPE
(``mrope_section``, default ``[11, 11, 10]``) over the ``[3, T]`` positions the model state
computes; the Gated DeltaNet layers take no positions. The vision tower is Qwen3-VL's
(:class:`~mrv2_qwen_vl.vision_qwen3.Qwen3VisionTower`) without its deepstack mergers: HF's
``Qwen3_5VisionModel`` drops them, though the config keeps Qwen3-VL's default
``deepstack_visual_indexes``. So the model state is Qwen3-VL's
(:class:`~mrv2_qwen_vl.model_state.Qwen3VLModelState`: M-RoPE table, encoder cache, a video
item per frame group), whose cached rows here are ``[N, 1, hidden]`` and carry no deepstack
features; the input processor is Qwen-VL's. The linear-attention layers' per-request states
are the core's, as for the text model (so no prefix caching and no speculative decoding, as
there).

Checkpoints: ``model.language_model.*`` (the text model, Qwen3.5's loader: ``in_proj_qkv``
split, norms folded, ``mtp.*`` skipped), ``model.visual.*`` (or ``visual.*``) into the tower,
``lm_head.weight`` tied per the top-level ``tie_word_embeddings``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from mrv2.layers import head_dim_of
from mrv2.layers.rotary import RotaryEmbedding
from mrv2.layers.weights import load_text_and_encoder
from mrv2.model_loader.build import vl_text_config, vl_text_name
from mrv2_qwen.qwen3_5 import Qwen3_5ForCausalLM
from mrv2_qwen_vl.mrope import get_mrope
from mrv2_qwen_vl.vision_qwen3 import CHECKPOINT_PREFIXES, Qwen3VisionTower

__all__ = ["Qwen3_5VLForConditionalGeneration"]


class Qwen3_5VLForConditionalGeneration(Qwen3_5ForCausalLM):  # noqa: N801 (HF's names)
    """Qwen3.5 / Qwen3.5-MoE with its vision tower (``visual``; module docstring).
    ``self.hf_config`` is the composite config."""

    media_encoders: ClassVar[tuple[str, ...]] = ("visual",)

    def __init__(self, config: Any) -> None:
        super().__init__(vl_text_config(config, type(self).__name__))
        self.hf_config = config
        self.visual = Qwen3VisionTower(config.vision_config, deepstack=False)

    @staticmethod
    def rope_of(config: Any) -> RotaryEmbedding:
        """Interleaved M-RoPE over each head's first ``partial_rotary_factor`` dims."""
        head_dim = head_dim_of(config)
        params = dict(getattr(config, "rope_parameters", None) or {})
        factor = float(params.get("partial_rotary_factor",
                                  getattr(config, "partial_rotary_factor", 1.0)))
        return get_mrope(config, head_dim, interleaved=True, default_section=(11, 11, 10),
                         rotary_dim=int(head_dim * factor))

    def embed_images(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
                     ) -> torch.Tensor:
        """``[N, 1, hidden]`` rows of the images (or video frame groups) in ``pixel_values``
        with patch grids ``grid_thw``, in the model dtype: the placeholders' embeddings (the
        one column of Qwen3-VL's cache layout, no deepstack features)."""
        tokens, _ = self.visual(pixel_values, grid_thw)
        return tokens[:, None].to(self.model.embed_tokens.weight.dtype)

    def rename(self, name: str) -> str | None:
        """A text checkpoint name as the decoder's (``model.language_model.*`` as
        ``model.*``)."""
        return super().rename(vl_text_name(name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The tower's tensors through its loader, the rest through Qwen3.5's."""
        text = functools.partial(Qwen3_5ForCausalLM.load_weights, self)
        return load_text_and_encoder(text, self.visual, CHECKPOINT_PREFIXES, weights, "visual")
