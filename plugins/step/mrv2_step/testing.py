"""Tiny random Step-3.7 checkpoints for the plugin's CPU tests and the GPU tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mrv2.testing import save_tiny_model

#: A 4-layer Step-3.7 text decoder: sliding layers 0 and 2 (window 8, eight query heads, RoPE
#: over whole heads), full layers 1 and 3 (four query heads, RoPE over half of each head,
#: another base); a dense MLP on layer 0, the MoE (four experts, two a token, a shared
#: expert, scaled routing) on the others, layer 3's routed and shared experts clamped;
#: scores scaled by ``query_pre_attn_scalar`` 24, not ``head_dim``.
TINY_STEP3P7_TEXT: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_sliding_attention_heads": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "share_expert_dim": 48, "sliding_window": 8, "moe_router_scaling_factor": 2.0,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                    "full_attention"],
    "moe_layers_enum": "1,2,3", "rope_theta": [10000.0, 500000.0, 10000.0, 500000.0],
    "partial_rotary_factors": [1.0, 0.5, 1.0, 0.5],
    "swiglu_limits": [0, 0, 0, 0.5], "swiglu_limits_shared": [0, 0, 0, 0.5],
    "query_pre_attn_scalar": 24, "max_position_embeddings": 256, "pad_token_id": 0,
    "eos_token_id": 1, "bos_token_id": 0,
}
#: A 2-layer vision tower whose position table is 168 pixels a side (12 x 12 patches of 14):
#: :data:`TINY_STEP3P7_IMAGES`' global view uses it as is, the 112-pixel crops resized.
TINY_STEP3P7_VISION: dict[str, Any] = {
    "width": 32, "layers": 2, "heads": 2, "image_size": 168, "patch_size": 14,
    "mlp_ratio": 2.0, "rope_parameters": {"rope_type": "axial", "rope_theta": 100.0},
}
#: The image processor's settings of the tiny checkpoints: a 168-pixel global view (9 image
#: tokens), 112-pixel crops (4 tokens each), images over 400 pixels scaled down.
TINY_STEP3P7_IMAGES: dict[str, Any] = {
    "image_processor_type": "Step3p7ImageProcessor", "size": {"height": 168, "width": 168},
    "patch_size": 112, "max_image_size": 400,
}


def save_tiny_step3p7(path: str | Path, **text_overrides: Any) -> torch.nn.Module:
    """Save a random fp32 HF Step-3.7 of :data:`TINY_STEP3P7_TEXT` (``text_overrides`` change
    its fields) and :data:`TINY_STEP3P7_VISION` to ``path`` (transformers writes the published
    layout: stacked ``moe.*`` experts, ``share_expert``, ``vision_model``); returns HF's
    model."""
    import transformers

    config = transformers.Step3p7Config(
        text_config={**TINY_STEP3P7_TEXT, **text_overrides},
        vision_config=dict(TINY_STEP3P7_VISION), image_token_id=127)
    return save_tiny_model(path, "Step3p7ForConditionalGeneration", config)


def save_tiny_step3p7_vl(path: str | Path, **text_overrides: Any
                         ) -> tuple[torch.nn.Module, int]:
    """:func:`save_tiny_step3p7` (``text_overrides`` change the text config) with a tokenizer
    holding Step's image tokens (:data:`mrv2_step.vision_inputs.TOKENS`), ``image_token_id``
    its ``<im_patch>`` and the image processor's settings (:data:`TINY_STEP3P7_IMAGES`);
    returns HF's model and the ``<im_patch>`` id."""
    import json

    import transformers

    from mrv2.testing import make_tiny_tokenizer
    from mrv2_step.vision_inputs import TOKENS

    path = Path(path)
    make_tiny_tokenizer(path, vocab_size=300, special_tokens=tuple(TOKENS.values()))
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(path))
    patch = int(tokenizer.convert_tokens_to_ids(TOKENS["image"]))
    config = transformers.Step3p7Config(
        text_config={**TINY_STEP3P7_TEXT, **text_overrides, "vocab_size": len(tokenizer) + 8},
        vision_config=dict(TINY_STEP3P7_VISION), image_token_id=patch)
    hf = save_tiny_model(path, "Step3p7ForConditionalGeneration", config)
    (path / "preprocessor_config.json").write_text(json.dumps(TINY_STEP3P7_IMAGES))
    return hf, patch


def hf_greedy_step3p7(model_dir: str | Path, prompts: list[list[int]], max_new_tokens: int,
                      device: str = "cpu") -> list[list[int]]:
    """HF's greedy continuation of each prompt by the fp32 ``Step3p7ForConditionalGeneration``
    saved at ``model_dir`` (a full forward per token, no EOS stop; ``AutoModelForCausalLM``
    does not map the composite config)."""
    import transformers

    cls: Any = transformers.Step3p7ForConditionalGeneration
    model = cls.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([ids], device=device)).logits[0, -1]
                ids.append(int(logits.argmax()))
            out.append(ids[len(prompt):])
    return out
