"""Tiny random Qwen2.5-VL and Qwen3-VL checkpoints for tests (CPU and GPU): HF's model with its
weights redrawn, its image processor config (Qwen3-VL: a video processor config too) and a
byte-level tokenizer (Qwen's vision start / end, image and video pads as special tokens) whose
chat template renders image parts as Qwen's placeholders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mrv2.testing import make_tiny_tokenizer, random_image, redraw_weights

__all__ = ["END", "IMAGE", "QWEN3_VIDEO_PROCESSOR", "START", "VIDEO", "make_tiny_qwen2_vl",
           "make_tiny_qwen3_vl", "make_tiny_qwen_vl", "random_image", "random_patches",
           "save_qwen3_vl_processors"]

#: The ids make_tiny_tokenizer gives the four special tokens (checked when building).
START, END, IMAGE, VIDEO = 293, 294, 295, 296
SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}</s>{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% endif %}"
)
TEXT: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "bos_token_id": 0, "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "mrope_section": [2, 3, 3]},
}
VISION: dict[str, Any] = {
    "depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 48,
    "out_hidden_size": 64, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
    "window_size": 56, "fullatt_block_indexes": [1],
}


QWEN3_TEXT: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 512, "bos_token_id": 0, "eos_token_id": 1,
    # [24, 20, 20] of the released models, scaled to 8 frequencies: t h w t h w t t
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "mrope_section": [4, 2, 2], "mrope_interleaved": True},
}
#: Qwen3-VL-MoE's text fields on top of :data:`QWEN3_TEXT` (experts 24 wide: ``2I != H``).
QWEN3_MOE: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2,
                             "moe_intermediate_size": 24, "mlp_only_layers": [2]}
QWEN3_VISION: dict[str, Any] = {
    "depth": 3, "hidden_size": 32, "num_heads": 2, "intermediate_size": 48,
    "out_hidden_size": 64, "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2,
    "num_position_embeddings": 16, "deepstack_visual_indexes": [0, 1],
}
#: The tiny Qwen3-VL's ``video_preprocessor_config.json`` (the released file's fields; a clip
#: of 4 .. 512 merged tokens in all, at most 16 frames).
QWEN3_VIDEO_PROCESSOR: dict[str, Any] = {
    "size": {"shortest_edge": 4 * 32 * 32, "longest_edge": 512 * 32 * 32}, "patch_size": 16,
    "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
    "max_frames": 16, "fps": 2, "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor",
}


def make_tiny_qwen_vl(path: str | Path, text: dict[str, Any] | None = None,
                      vision: dict[str, Any] | None = None) -> Path:
    """Save the tiny model (``text`` / ``vision`` override config fields), its image
    processor (images of 4 to 64 merged tokens) and tokenizer in ``path``."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    path = Path(path)
    config = transformers.Qwen2_5_VLConfig(
        text_config={**TEXT, **(text or {})}, vision_config={**VISION, **(vision or {})},
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
        vision_end_token_id=END, tie_word_embeddings=False)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    redraw_weights(model, std=0.1)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28, patch_size=14,
                             merge_size=2, temporal_patch_size=2).save_pretrained(path)
    _save_tokenizer(path)
    return path


#: Qwen2-VL's tower (its own field names: ``embed_dim`` the width, ``hidden_size`` the text's).
QWEN2_VISION: dict[str, Any] = {
    "depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2,
    "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
}


def make_tiny_qwen2_vl(path: str | Path, text: dict[str, Any] | None = None,
                       vision: dict[str, Any] | None = None) -> Path:
    """The tiny Qwen2-VL (the first generation: Qwen2 decoder with M-RoPE, a tower of
    LayerNorm blocks with full attention), its image processor and tokenizer in ``path``."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    path = Path(path)
    config = transformers.Qwen2VLConfig(
        text_config={**TEXT, **(text or {})},
        vision_config={**QWEN2_VISION, **(vision or {})}, image_token_id=IMAGE,
        video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        tie_word_embeddings=False)
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    redraw_weights(model, std=0.1)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28, patch_size=14,
                             merge_size=2, temporal_patch_size=2).save_pretrained(path)
    _save_tokenizer(path)
    return path


def make_tiny_qwen3_vl(path: str | Path, text: dict[str, Any] | None = None,
                       vision: dict[str, Any] | None = None, moe: bool = False) -> Path:
    """The tiny Qwen3-VL (3 text layers, 3 vision blocks, deepstack after blocks 0 and 1 into
    text layers 0 and 1, tied embeddings as the small released models), its image processor
    (16-pixel patches, images of 4 to 64 merged tokens; the released config's image processor
    type), video processor (:data:`QWEN3_VIDEO_PROCESSOR`) and tokenizer in ``path``.
    ``moe``: Qwen3-VL-MoE (:data:`QWEN3_MOE`: routed experts in layers 0 and 1, a dense MLP in
    layer 2)."""
    import transformers

    path = Path(path)
    arch = "Qwen3VLMoe" if moe else "Qwen3VL"
    config = getattr(transformers, f"{arch}Config")(
        text_config={**QWEN3_TEXT, **(QWEN3_MOE if moe else {}), **(text or {})},
        vision_config={**QWEN3_VISION, **(vision or {})}, image_token_id=IMAGE,
        video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
        tie_word_embeddings=True)
    config.architectures = [f"{arch}ForConditionalGeneration"]
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForConditionalGeneration")(config).eval()
    redraw_weights(model, std=0.1)
    model.save_pretrained(path)
    save_qwen3_vl_processors(path)
    return path


def save_qwen3_vl_processors(path: str | Path) -> None:
    """Qwen3-VL's processors for a tiny checkpoint in ``path`` (Qwen3.5's too): the image
    processor (16-pixel patches, images of 4 to 64 merged tokens; the released config's
    image processor type), the video processor (:data:`QWEN3_VIDEO_PROCESSOR`) and the
    tokenizer."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    path = Path(path)
    Qwen2VLImageProcessorPil(
        size={"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32}, patch_size=16,
        merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    ).save_pretrained(path)
    processor_file = path / "preprocessor_config.json"
    fields = json.loads(processor_file.read_text())
    fields["image_processor_type"] = "Qwen2VLImageProcessorFast"  # as the released file
    processor_file.write_text(json.dumps(fields, indent=2))
    (path / "video_preprocessor_config.json").write_text(
        json.dumps(QWEN3_VIDEO_PROCESSOR, indent=2))
    _save_tokenizer(path)


def _save_tokenizer(path: Path) -> None:
    import transformers

    make_tiny_tokenizer(path, 300, SPECIAL, CHAT_TEMPLATE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if tokenizer.convert_tokens_to_ids(SPECIAL) != [START, END, IMAGE, VIDEO]:
        raise RuntimeError("the tiny tokenizer's special token ids changed; update START/END/"
                           "IMAGE/VIDEO in mrv2_qwen_vl.testing")


def random_patches(grids: list[tuple[int, int, int]], patch: int, seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """A vision tower's input for patch grids ``grids`` (``(t, h, w)`` each): random rows of
    ``3 * 2 * patch * patch`` values (RGB, two frames), one per patch, and the grids as a
    ``[num_images, 3]`` long tensor."""
    n = sum(t * h * w for t, h, w in grids)
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(n, 3 * 2 * patch * patch, generator=gen)
    return pixels, torch.tensor(grids, dtype=torch.long)
