"""Tiny random LFM2 and LFM2-MoE checkpoints for the plugin's CPU tests and the GPU tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mrv2.testing import redraw_weights, save_tiny_model

#: A 4-layer LFM2: convolution layers (width 4: a prompt of more than 3 tokens fills the
#: state) around two attention layers (4 heads of 16, 2 key/value heads), biases on the
#: convolutions, an untied LM head; ``intermediate_size`` 144 -> 96 -> times 1.3 = 124 ->
#: rounded up to 128 (``block_multiple_of`` 32).
TINY_LFM2: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 144, "num_hidden_layers": 4,
    "layer_types": ["conv", "full_attention", "conv", "full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "conv_L_cache": 4, "conv_bias": True,
    "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.3,
    "block_multiple_of": 32, "norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 256, "tie_word_embeddings": False,
    "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
}


def save_tiny_lfm2(path: str | Path, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF LFM2 of :data:`TINY_LFM2` (``overrides`` change fields) to
    ``path``, weights redrawn far from their init; returns HF's model."""
    import transformers

    config = transformers.Lfm2Config(**{**TINY_LFM2, **overrides})
    return save_tiny_model(path, "Lfm2ForCausalLM", config)


#: A 5-layer LFM2-MoE: a convolution and an attention layer with dense SwiGLUs of 96
#: (``num_dense_layers`` 2), then convolution, attention, convolution layers each with a
#: sparse MoE block of 8 experts of 32, two a token, sigmoid scores with an expert bias,
#: renormalized and scaled by 1.5 (LFM2-8B-A1B: 1.0; here not 1, so the factor counts);
#: width-4 convolutions with biases, an untied LM head.
TINY_LFM2_MOE: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 5,
    "moe_intermediate_size": 32, "num_dense_layers": 2, "num_experts": 8,
    "num_experts_per_tok": 2, "use_expert_bias": True, "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "layer_types": ["conv", "full_attention", "conv", "full_attention", "conv"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "conv_L_cache": 4, "conv_bias": True,
    "norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 256, "tie_word_embeddings": False,
    "eos_token_id": 1, "bos_token_id": 0, "pad_token_id": 0,
}


def save_tiny_lfm2_moe(path: str | Path, **overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF LFM2-MoE of :data:`TINY_LFM2_MOE` (``overrides`` change fields)
    to ``path``, weights redrawn far from their init and each MoE block's ``expert_bias``
    (a buffer HF inits to zeros) uniform in [-0.3, 0.3) so it changes picks; returns HF's
    model."""
    import transformers

    config = transformers.Lfm2MoeConfig(**{**TINY_LFM2_MOE, **overrides})
    return save_tiny_model(path, "Lfm2MoeForCausalLM", config,
                           uniform={".feed_forward.expert_bias": (-0.3, 0.3)})


#: The tiny LFM2-VL's tokenizer specials: the image token, HF's layout tags (tiles up to 4 x 4).
VL_SPECIAL: tuple[str, ...] = (
    "<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>",
    *(f"<|img_row_{r + 1}_col_{c + 1}|>" for r in range(4) for c in range(4)))
#: Its image processor settings: 4-pixel patches, unshuffled by 2; 16-pixel tiles (4 image
#: tokens each), 2 to 4 of them for an image over ``8 * 64 * 2`` pixels, else the image alone
#: at 2 to 8 tokens (a thumbnail too).
TINY_VL_IMAGES: dict[str, Any] = {
    "image_processor_type": "Lfm2VlImageProcessor", "encoder_patch_size": 4,
    "downsample_factor": 2, "tile_size": 16, "min_tiles": 2, "max_tiles": 4,
    "min_image_tokens": 2, "max_image_tokens": 8, "do_image_splitting": True,
    "use_thumbnail": True, "max_pixels_tolerance": 2.0, "resample": 2,
    "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.3, 0.25], "rescale_factor": 1 / 255,
    "do_rescale": True, "do_normalize": True}


def save_tiny_lfm2_vl(path: str | Path, dtype: torch.dtype = torch.float32,
                      images: dict[str, Any] | None = None, **overrides: Any
                      ) -> tuple[torch.nn.Module, int]:
    """Save a random HF LFM2-VL (the SigLIP2 tower of 2 layers over a 4 x 4 position table,
    a layer-normed projector, :data:`TINY_LFM2`'s decoder; ``overrides`` change top-level
    fields) in ``dtype`` with its tokenizer (:data:`VL_SPECIAL`) and image processor settings
    (:data:`TINY_VL_IMAGES`, ``images`` changing some) to ``path``; returns HF's model and the
    ``<image>`` id."""
    import json

    import transformers

    from mrv2.testing import make_tiny_tokenizer

    make_tiny_tokenizer(path, vocab_size=300, special_tokens=VL_SPECIAL)
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(path))
    image = int(tokenizer.convert_tokens_to_ids("<image>"))
    text = {**TINY_LFM2, "model_type": "lfm2", "vocab_size": len(tokenizer) + 4}
    text.pop("tie_word_embeddings")
    fields = {"projector_hidden_size": 48, "downsample_factor": 2, "image_token_id": image,
              "tie_word_embeddings": False, **overrides}
    config = transformers.Lfm2VlConfig(
        text_config=text,
        vision_config={"model_type": "siglip2_vision_model", "hidden_size": 32,
                       "intermediate_size": 48, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "patch_size": 4, "num_patches": 16,
                       "vision_use_head": False},
        **fields)
    config.architectures = ["Lfm2VlForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.Lfm2VlForConditionalGeneration(config).float().eval()
    redraw_weights(hf, std=0.15)
    hf = hf.to(dtype)
    hf.save_pretrained(path)
    settings = {**TINY_VL_IMAGES, **(images or {})}
    (Path(path) / "preprocessor_config.json").write_text(json.dumps(settings))
    return hf, image


def hf_vl_inputs(items: list[Any], device: Any = "cpu") -> dict[str, Any]:
    """HF's ``pixel_values`` / ``pixel_attention_mask`` / ``spatial_shapes`` for the engine's
    items (each frame padded to the most patches, as HF's processor pads them)."""
    if not items:
        return {}
    frames: list[torch.Tensor] = []
    shapes: list[tuple[int, int]] = []
    for item in items:
        start = 0
        for h, w in item.data["shapes"]:
            frames.append(item.data["patches"][start:start + h * w])
            shapes.append((h, w))
            start += h * w
    most = max(int(f.shape[0]) for f in frames)
    pixels = torch.zeros(len(frames), most, int(frames[0].shape[1]))
    mask = torch.zeros(len(frames), most, dtype=torch.int32)
    for n, frame in enumerate(frames):
        pixels[n, :frame.shape[0]] = frame
        mask[n, :frame.shape[0]] = 1
    return {"pixel_values": pixels.to(device), "pixel_attention_mask": mask.to(device),
            "spatial_shapes": torch.tensor(shapes, device=device)}
