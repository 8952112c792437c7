"""GLM-4.1V (``Glm4vForConditionalGeneration``: GLM-4.1V-9B-Thinking) and GLM-4.5V / GLM-4.6V
(``Glm4vMoeForConditionalGeneration``) in the mrv2 model contract: images (videos are
refused; the input processor says so).

- The text decoders are this plugin's: GLM-4.1V's is GLM-4-0414's (:mod:`mrv2_glm.dense`:
  q/k/v biased, the fused ``gate_up_proj``, a norm after the attention and one after the MLP,
  interleaved partial RoPE whose q/k rows load in the halves order), GLM-4.5V's is GLM-4.5's
  mixture of experts (:mod:`mrv2_glm.model`: neox-style partial RoPE). Both rotate by
  M-RoPE instead of 1-D RoPE (:mod:`mrv2_qwen_vl.mrope`, with ``partial_rotary_factor``'s
  ``rotary_dim``): ``mrope_section`` (``[8, 12, 12]`` in the released configs) picks, among
  the rotated frequencies, the first ``s_t`` by the temporal component, the next ``s_h`` by
  the height and the last ``s_w`` by the width (HF's split-and-recompose, chunked layout
  in both: GLM-4.1V's interleaved pairs are the halves after the q/k row order).
- An image's positions are Qwen2-VL's (HF 5.17's ``Glm4vModel.get_rope_index``): its merged
  ``h' x w'`` tokens take ``(s, s + row, s + col)`` from the position ``s`` its first token
  would have had, and the text after it resumes at ``s + max(h', w')``; the model state is
  Qwen-VL's (:class:`~mrv2_qwen_vl.model_state.QwenVLModelState`: the device M-RoPE table,
  the encoder cache), with images only.
- The vision tower is :class:`~mrv2_glm.vision_glm4v.Glm4vVisionTower`; its tokens replace
  the ``<|image|>`` placeholders' embeddings (:mod:`mrv2_glm.glm4v_inputs`).

Checkpoints load as published and as transformers 5.17 saves them (``model.language_model.*``,
``model.visual.*``, ``lm_head.weight``) and in the older layout (``model.*``, ``visual.*``).
GLM-4.5V's multi-token-prediction layers (``model.language_model.layers.{n}`` past
``num_hidden_layers``) are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from mrv2.layers import RotaryEmbedding, head_dim_of
from mrv2.layers.weights import load_text_and_encoder
from mrv2.model_loader.build import vl_text_config
from mrv2_glm.dense import Glm4ForCausalLM
from mrv2_glm.model import Glm4MoeForCausalLM, partial_rotary_factor_of
from mrv2_glm.vision_glm4v import Glm4vVisionTower
from mrv2_qwen_vl.model_state import QwenVLModelState
from mrv2_qwen_vl.mrope import get_mrope
from mrv2_qwen_vl.vision import CHECKPOINT_PREFIXES

__all__ = ["Glm4vForConditionalGeneration", "Glm4vModelState",
           "Glm4vMoeForConditionalGeneration", "glm4v_mrope"]

#: HF's ``mrope_section`` where the config names none.
DEFAULT_SECTION = (8, 12, 12)


def glm4v_mrope(text_config: Any, head_dim: int, rotary_dim: int) -> RotaryEmbedding:
    """The M-RoPE of a GLM-4.1V / 4.5V text config: ``rotary_dim`` of each head's dims, the
    chunked frequency layout (module doc)."""
    return get_mrope(text_config, head_dim, default_section=DEFAULT_SECTION,
                     rotary_dim=rotary_dim)


class _Glm4vParts:
    """What both GLM-V models add to their text decoder: the vision tower, the image
    embedding, the checkpoint's names (a mixin before the decoder's class)."""

    media_encoders: ClassVar[tuple[str, ...]] = ("visual",)
    visual: Glm4vVisionTower
    hf_config: Any

    def embed_images(self, pixel_values: torch.Tensor, grid_thw: list[tuple[int, int, int]]
                     ) -> torch.Tensor:
        """``[N, out_hidden]`` image tokens of the items whose patch rows ``pixel_values``
        holds (grids ``grid_thw``), in the model dtype."""
        dtype = self.model.embed_tokens.weight.dtype  # type: ignore[attr-defined]
        return self.visual(pixel_values, grid_thw).to(dtype)

    def rename(self, name: str) -> str | None:
        """transformers' ``model.language_model.*`` read as ``model.*`` (LoRA adapters use
        either), then the decoder's own rules."""
        return super().rename(  # type: ignore[misc]
            name.replace("model.language_model.", "model.", 1))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``model.visual.*`` / ``visual.*`` through the tower's loader, the rest through the
        decoder's (q/k row order, fused gate/up, MTP layers skipped)."""
        text_loader = super().load_weights  # type: ignore[misc]
        return load_text_and_encoder(text_loader, self.visual, CHECKPOINT_PREFIXES, weights,
                                     "visual")


class Glm4vForConditionalGeneration(_Glm4vParts, Glm4ForCausalLM):
    """GLM-4.1V: GLM-4-0414's decoder with M-RoPE, plus the vision tower (module doc)."""

    def __init__(self, config: Any) -> None:
        super().__init__(vl_text_config(config, "Glm4vForConditionalGeneration"))
        self.hf_config = config
        self.visual = Glm4vVisionTower(config.vision_config)

    @classmethod
    def make_rope(cls, config: Any, head_dim: int, rotary_dim: int) -> RotaryEmbedding:
        """M-RoPE over each head's ``rotary_dim`` first dims (:func:`glm4v_mrope`)."""
        return glm4v_mrope(config, head_dim, rotary_dim)


class Glm4vMoeForConditionalGeneration(_Glm4vParts, Glm4MoeForCausalLM):
    """GLM-4.5V / GLM-4.6V: GLM-4.5's mixture-of-experts decoder with M-RoPE, plus the vision
    tower (module doc)."""

    def __init__(self, config: Any) -> None:
        super().__init__(vl_text_config(config, "Glm4vMoeForConditionalGeneration"))
        self.hf_config = config
        self.visual = Glm4vVisionTower(config.vision_config)

    @classmethod
    def make_rope(cls, config: Any) -> RotaryEmbedding:
        """M-RoPE over ``partial_rotary_factor`` of each head (:func:`glm4v_mrope`)."""
        head_dim = head_dim_of(config)
        return glm4v_mrope(config, head_dim, int(head_dim * partial_rotary_factor_of(config)))

    def build_mtp(self, first_layer_idx: int | None = None) -> Any:
        """Refused: the MTP drafter rotates by 1-D positions, not this model's M-RoPE."""
        raise ValueError("Glm4vMoeForConditionalGeneration: the checkpoint's MTP layers are "
                         "not served (their drafter has no M-RoPE positions); run without "
                         "speculative_config method 'mtp'")


class Glm4vModelState(QwenVLModelState):
    """GLM-4.1V's and GLM-4.5V's model state: Qwen-VL's (the device M-RoPE table, image
    embeddings through the encoder cache; module doc), images only."""

    item_kinds = ("image",)
    video_is_one_item = False  # (no videos: the encoder profile runs the largest image)

    def image_max_pixels(self) -> int | None:
        """``size.longest_edge`` over ``temporal_patch_size``: GLM's image processor counts
        an image's pixels once per temporal frame (its ``smart_resize`` of two frames)."""
        most = super().image_max_pixels()
        frames = int(getattr(self.hf_config.vision_config, "temporal_patch_size", 2))
        return None if most is None else most // frames
