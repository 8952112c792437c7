"""Tiny random GLM-4.1V and GLM-4.5V checkpoints for tests (CPU and GPU): HF's model with its
weights redrawn, its image processor config (the PIL backend of ``Glm4vImageProcessor``,
images of 4 to 64 merged tokens) and a byte-level tokenizer (GLM's image marks and the
``<|image|>`` placeholder as special tokens) whose chat template renders image parts as
GLM's chat template does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mrv2.testing import make_tiny_tokenizer, redraw_weights

__all__ = ["BEGIN_IMAGE", "END_IMAGE", "IMAGE", "make_tiny_glm4v"]

#: The ids make_tiny_tokenizer gives the special tokens (checked when building).
BEGIN_IMAGE, END_IMAGE, IMAGE = 293, 294, 295
SPECIAL = ["<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>",
           "<|end_of_video|>", "<|video|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|begin_of_image|><|image|><|end_of_image|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% endif %}"
)
#: GLM-4.1V's text decoder, tiny: head_dim 24, half of it rotated (12 dims, 6 frequencies:
#: an uneven ``mrope_section`` so a swapped component shows).
TEXT: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 96, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "bos_token_id": 0, "eos_token_id": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "mrope_section": [2, 1, 3], "partial_rotary_factor": 0.5},
}
#: GLM-4.5V's on top of :data:`TEXT`: a dense first layer, then 4 experts (2 a token) and a
#: shared expert, grouped routing with a correction bias.
MOE_TEXT: dict[str, Any] = {
    "head_dim": 24, "attention_bias": True, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
    "n_group": 2, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.5,
}
#: The tower: a 4 x 4 position table (56 / 14) resampled to every image's grid.
VISION: dict[str, Any] = {
    "depth": 2, "hidden_size": 32, "num_heads": 2, "intermediate_size": 48,
    "out_hidden_size": 96, "patch_size": 14, "image_size": 56, "spatial_merge_size": 2,
    "temporal_patch_size": 2, "hidden_act": "silu", "rms_norm_eps": 1e-5,
}


def make_tiny_glm4v(path: str | Path, moe: bool = False, text: dict[str, Any] | None = None,
                    vision: dict[str, Any] | None = None) -> Path:
    """Save the tiny GLM-4.1V (``moe``: GLM-4.5V; ``text`` / ``vision`` override config
    fields; GLM-4.5V's tower has q/k/v biases), its image processor and tokenizer in
    ``path``."""
    import transformers
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    path = Path(path)
    arch = "Glm4vMoe" if moe else "Glm4v"
    text_fields = {**TEXT, **(MOE_TEXT if moe else {}), **(text or {})}
    vision_fields = {**VISION, "attention_bias": moe, **(vision or {})}
    config = getattr(transformers, f"{arch}Config")(
        text_config=text_fields, vision_config=vision_fields, image_token_id=IMAGE,
        image_start_token_id=BEGIN_IMAGE, image_end_token_id=END_IMAGE,
        tie_word_embeddings=False)
    config.architectures = [f"{arch}ForConditionalGeneration"]
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForConditionalGeneration")(config).eval()
    redraw_weights(model, std=0.1)
    model.save_pretrained(path)
    Glm4vImageProcessorPil(size={"shortest_edge": 2 * 4 * 28 * 28,
                                 "longest_edge": 2 * 64 * 28 * 28},
                           patch_size=14, merge_size=2, temporal_patch_size=2
                           ).save_pretrained(path)
    processor_file = path / "preprocessor_config.json"
    fields = json.loads(processor_file.read_text())
    fields["image_processor_type"] = "Glm4vImageProcessor"  # as the released files
    processor_file.write_text(json.dumps(fields, indent=2))
    make_tiny_tokenizer(path, 300, SPECIAL, CHAT_TEMPLATE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if tokenizer.convert_tokens_to_ids(SPECIAL[:3]) != [BEGIN_IMAGE, END_IMAGE, IMAGE]:
        raise RuntimeError("the tiny tokenizer's special token ids changed; update "
                           "BEGIN_IMAGE / END_IMAGE / IMAGE in mrv2_glm.testing_glm4v")
    return path
