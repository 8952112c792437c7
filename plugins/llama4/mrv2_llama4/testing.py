"""Tiny random Llama 4 checkpoints (text-only and multimodal) for the plugin's CPU tests and
the GPU tests, built and saved by HF transformers itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mrv2.testing import save_tiny_model

__all__ = ["IMAGE_PREPROCESSOR", "TEMPLATE", "TINY_LLAMA4", "TINY_VISION", "hf_image_inputs",
           "save_tiny_llama4", "save_tiny_llama4_images", "save_tiny_llama4_vl"]

#: A 4-layer Llama 4 text model where every option bites: layers 0 and 1 RoPE (llama3
#: scaling, q/k norm, chunked attention: chunks of 64, as long as the context), 2 and 3 NoPE
#: with the query temperature (``floor_scale`` 2: the scale grows every other position);
#: layers 1 and 3 MoE (4 experts, top-1 sigmoid, a shared expert), 0 and 2 dense (a wider
#: MLP). GQA (4 query heads, 2 KV heads) of head_dim 16.
TINY_LLAMA4: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "head_dim": 16, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_hidden_layers": 4, "intermediate_size": 32,
    "intermediate_size_mlp": 48, "num_local_experts": 4, "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 2, "no_rope_layers": [1, 1, 0, 0], "use_qk_norm": True,
    "attn_temperature_tuning": True, "floor_scale": 2, "attn_scale": 0.5,
    "attention_chunk_size": 64, "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 16},
    "tie_word_embeddings": False, "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
}

#: A two-layer vision tower over tiles of 56 x 56 pixels (4 x 4 patches of 14, the class
#: token after them; head_dim 16: 4 RoPE pairs turn with the column, 4 with the row), the
#: pixel shuffle folding each 2 x 2 block: 4 image tokens a tile.
TINY_VISION: dict[str, Any] = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "intermediate_size": 128, "vision_output_dim": 32, "image_size": 56, "patch_size": 14,
    "projector_input_dim": 32, "projector_output_dim": 32,
}

#: The ``preprocessor_config.json`` of :func:`save_tiny_llama4_images`: tiles of 56 pixels,
#: at most 4 of them (plus the global tile), CLIP's mean and std (not exact in bf16).
IMAGE_PREPROCESSOR: dict[str, Any] = {
    "image_processor_type": "Llama4ImageProcessorFast", "processor_class": "Llama4Processor",
    "size": {"height": 56, "width": 56}, "max_patches": 4, "resize_to_max_canvas": False,
    "resample": 2, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True,
}

#: A chat template that renders image parts as ``<|image|>``, as Llama 4's does.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|image|>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def save_tiny_llama4(path: str | Path, std: float = 0.15, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF ``Llama4ForCausalLM`` of :data:`TINY_LLAMA4` (``overrides``
    change fields; weights redrawn with ``std``: attention and routing decisive) to
    ``path``; returns HF's model."""
    import transformers

    config = transformers.Llama4TextConfig(**{**TINY_LLAMA4, **overrides})
    return save_tiny_model(path, "Llama4ForCausalLM", config, std=std)


def _save_vl(path: str | Path, std: float, text: dict[str, Any], ids: tuple[int, int, int]
             ) -> torch.nn.Module:
    """Save a random fp32 HF ``Llama4ForConditionalGeneration`` of ``text`` and
    :data:`TINY_VISION` with ``(image_token_index, boi, eoi) = ids``; returns HF's model."""
    import transformers

    config = transformers.Llama4Config(
        text_config=text, vision_config=dict(TINY_VISION), image_token_index=ids[0],
        boi_token_index=ids[1], eoi_token_index=ids[2], tie_word_embeddings=False)
    return save_tiny_model(path, "Llama4ForConditionalGeneration", config, std=std)


def save_tiny_llama4_vl(path: str | Path, std: float = 0.15, **overrides: Any
                        ) -> torch.nn.Module:
    """Save a random fp32 HF ``Llama4ForConditionalGeneration`` whose text model is
    :data:`TINY_LLAMA4` (``overrides`` change its fields) and whose vision tower is
    :data:`TINY_VISION`, image tokens at the top of the vocabulary (no tokenizer nor
    image processor: images are refused, text runs); returns HF's model."""
    return _save_vl(path, std, {**TINY_LLAMA4, **overrides}, (125, 126, 127))


def save_tiny_llama4_images(path: str | Path, std: float = 0.15,
                            preprocessor: dict[str, Any] | None = None, **overrides: Any
                            ) -> torch.nn.Module:
    """:func:`save_tiny_llama4_vl` with what images need: a tiny tokenizer whose special
    tokens include Llama 4's layout tokens (:data:`~mrv2_llama4.images.IMAGE_TOKENS`; the
    text vocabulary sized to hold them, ``<|patch|>`` / ``<|image_start|>`` /
    ``<|image_end|>`` the config's ids) with :data:`TEMPLATE`, room for 256 positions
    (chunks of 64 still), and
    ``preprocessor_config.json`` (:data:`IMAGE_PREPROCESSOR`, or ``preprocessor``); returns
    HF's model."""
    import transformers

    from mrv2.testing import make_tiny_tokenizer
    from mrv2_llama4.images import IMAGE_TOKENS

    make_tiny_tokenizer(path, vocab_size=300, special_tokens=IMAGE_TOKENS,
                        chat_template=TEMPLATE)
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(path))
    start, end, _, patch = (int(tokenizer.convert_tokens_to_ids(t)) for t in IMAGE_TOKENS[:4])
    text = {**TINY_LLAMA4, "vocab_size": len(tokenizer) + 2, "max_position_embeddings": 256,
            **overrides}
    hf = _save_vl(path, std, text, (patch, start, end))
    (Path(path) / "preprocessor_config.json").write_text(
        json.dumps(IMAGE_PREPROCESSOR if preprocessor is None else preprocessor))
    return hf


def hf_image_inputs(ids: list[int], items: list[Any], images: list[Any]) -> dict[str, Any]:
    """HF's image inputs of a prompt the engine expanded to ``ids``: the pixels its ``items``
    carry (every image's tiles in order, fp32; HF's processor needs torchvision), none for a
    text prompt. The ``hf_inputs`` of :func:`mrv2.testing_engine.check_images_against_hf`."""
    if not items:
        return {}
    return {"pixel_values": torch.cat([item.data["pixel_values"] for item in items]).float()}
