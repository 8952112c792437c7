"""InternVL (``InternVLForConditionalGeneration``: a Qwen2 / Qwen3 / Llama text decoder (the
Llama one with biased attention and MLP), InternViT over an image's tiles, pixel shuffle and
the projector) through the engine against HF transformers: greedy tokens and every prompt
position's log-probability with images of two aspect ratios (so different tile counts), two in
a prompt, an image shared between requests and a text prompt beside them, chunked prefill
splitting images across steps; the encoder cache on a second round; checkpoint names; bad
input and an unsupported text decoder refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import make_tiny_tokenizer, random_image, redraw_weights
from mrv2.testing_engine import HfInputs, check_images_against_hf
from mrv2_internvl.model import InternVLForConditionalGeneration

TOKENS = ("<img>", "</img>", "<IMG_CONTEXT>")
TEXTS: dict[str, dict[str, Any]] = {
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 16},
    "llama": {"model_type": "llama", "attention_bias": True, "mlp_bias": True},
}
VISION: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
    "image_size": [16, 16], "patch_size": [4, 4]}


def _checkpoint(path: Path, kind: str) -> tuple[Any, list[int]]:
    """A tiny checkpoint with its tokenizer (the image tokens special) and image processor;
    HF's model and the ids of ``<img>``, ``</img>``, ``<IMG_CONTEXT>``."""
    make_tiny_tokenizer(path, vocab_size=300, special_tokens=TOKENS)
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(path))
    ids = [int(tokenizer.convert_tokens_to_ids(t)) for t in TOKENS]
    text = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, **TEXTS[kind]}
    config = transformers.InternVLConfig(text_config=text, vision_config=VISION,
                                         image_token_id=ids[2], downsample_ratio=0.5,
                                         tie_word_embeddings=False)
    config.architectures = ["InternVLForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.InternVLForConditionalGeneration(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(path)
    transformers.GotOcr2ImageProcessorPil(size={"height": 16, "width": 16}, max_patches=4,
                                          crop_to_patches=True).save_pretrained(path)
    return hf, ids


def _hf_inputs(path: Path) -> HfInputs:
    processor: Any = transformers.GotOcr2ImageProcessorPil.from_pretrained(str(path))

    def inputs(ids: list[int], items: list[Any], images: list[Any]) -> dict[str, Any]:
        if not images:
            return {}
        return {"pixel_values": processor(images=images, crop_to_patches=True,
                                          return_tensors="pt")["pixel_values"]}
    return inputs


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_tokens_and_logprobs_match_hf_with_images(tmp_path: Path, kind: str) -> None:
    hf, (start, end, context) = _checkpoint(tmp_path, kind)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=8)  # (images of 12-20 tokens: split across steps)
    a, b = random_image(40, 20, seed=1), random_image(16, 16, seed=2)
    prompts: list[tuple[list[int], list[Any]]] = [
        ([5, 17, 42, context, 100, 3], [a]), ([context, 64, 8, context, 50], [b, a]),
        ([3, 4, 5, 6], [])]
    # (encoder_runs 2: image a once for both requests, across chunks)
    expanded = check_images_against_hf(llm, hf, prompts, _hf_inputs(tmp_path), encoder_runs=2)
    lengths = set()
    for ids, items in expanded:
        for item in items:
            assert ids[item.offset - 1] == start and ids[item.offset + item.length] == end
            lengths.add(item.length)
    assert len(lengths) == 2  # (two tile counts)


def test_checkpoint_names_and_bad_input(tmp_path: Path) -> None:
    """The saved names and HF's in-memory ones load every parameter; a placeholder count or a
    kind that does not fit is refused by name, nothing queued; a text decoder not built here
    is refused naming the field."""
    hf, (_, _, context) = _checkpoint(tmp_path, "qwen2")
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    for weights in (iter_safetensors(tmp_path), hf.state_dict().items()):
        model = InternVLForConditionalGeneration(config)
        loaded = load_model_weights(model, weights)
        assert loaded >= {name for name, _ in model.named_parameters()}
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4)
    image = random_image(16, 16, seed=0)
    params = SamplingParams(max_tokens=2)
    for mm_data, match in (({"image": [image, image]}, "2 images but the prompt has 1"),
                           ({"video": [image]}, r"unsupported keys \['video'\]")):
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt_token_ids": [5, context], "multi_modal_data": mm_data}],
                         params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    config.text_config.model_type = "mixtral"
    with pytest.raises(ValueError, match="text_config.model_type = 'mixtral' is not supported"):
        InternVLForConditionalGeneration(config)
