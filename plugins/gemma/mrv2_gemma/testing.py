"""Test helpers of the Gemma plugin: a tiny ``Gemma3ForConditionalGeneration`` checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["IMAGE_TOKENS", "TEMPLATE", "TEXT", "VISION", "VOCAB", "save_tiny_gemma3_vl"]

VOCAB = 320
TEXT: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 128, "sliding_window": 4, "query_pre_attn_scalar": 24,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                        "full_attention": {"rope_type": "linear", "factor": 4.0,
                                           "rope_theta": 1e6}}}
VISION: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "image_size": 32, "patch_size": 8}
#: A Gemma-like chat template that renders image parts as ``<start_of_image>`` (saved as
#: chat_template.json only, as the VL checkpoints ship it).
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<start_of_image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
#: The image tokens, special in the tiny tokenizer.
IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


def save_tiny_gemma3_vl(path: Path, tied: bool = True, tokenizer: bool = False,
                        image_processor: bool = False) -> torch.nn.Module:
    """A tiny Gemma3ForConditionalGeneration (a local and a global layer, a one-block SigLIP
    tower over 32 x 32 images, 4 soft tokens an image), its weights redrawn, saved as
    transformers writes it; returns HF's model. Its ``<start_of_image>`` /
    ``<end_of_image>`` / soft token ids are 317 / 318 / 319, or with ``tokenizer`` those of a
    tiny tokenizer's special tokens (:data:`IMAGE_TOKENS`), whose chat template
    (:data:`TEMPLATE`) is in ``chat_template.json`` alone, as the VL checkpoints ship it;
    ``image_processor``: with the checkpoint's ``preprocessor_config.json`` (Gemma 3's, at
    32 x 32)."""
    import transformers

    from mrv2.testing import make_tiny_tokenizer, redraw_weights

    ids = [317, 318, 319]
    if tokenizer:
        make_tiny_tokenizer(path, vocab_size=300, special_tokens=IMAGE_TOKENS)
        tok: Any = transformers.AutoTokenizer.from_pretrained(str(path))
        ids = [int(tok.convert_tokens_to_ids(token)) for token in IMAGE_TOKENS]
        assert max(ids) < VOCAB and len(set(ids)) == 3, ids
        (path / "chat_template.jinja").unlink(missing_ok=True)
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
        tok_config.pop("chat_template", None)
        (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
        (path / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    config = transformers.Gemma3Config(
        text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4, boi_token_index=ids[0],
        eoi_token_index=ids[1], image_token_index=ids[2], tie_word_embeddings=tied)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.Gemma3ForConditionalGeneration(config).eval()
    redraw_weights(hf)  # (norm offsets far from 0 too)
    hf.save_pretrained(path)
    if image_processor:
        side = int(VISION["image_size"])
        transformers.Gemma3ImageProcessorPil(size={"height": side, "width": side}
                                             ).save_pretrained(path)
    return hf
