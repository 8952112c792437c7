"""Aya Vision (``AyaVisionForConditionalGeneration``) through the engine against HF
transformers, for a Command R7B decoder with the last SigLIP layer's features (Aya's) and a
Command R decoder with two layers' features: the prompt expanded as HF's ``AyaVisionProcessor``
expands it (``<image>`` text and ``<|IMG_PATCH|>`` placeholders, tiles plus thumbnail and a
single tile); greedy tokens, the encoder cache and every prompt position's log-probability
with two images in a prompt split across steps and a text prompt beside them; checkpoint
names; bad input refused naming the field."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

from mrv2 import LLM, SamplingParams
from mrv2.config import EngineConfig
from mrv2.engine.tokenizer import Tokenizer
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import make_tiny_tokenizer, random_image, redraw_weights
from mrv2.testing_engine import check_images_against_hf
from mrv2_cohere.aya_vision import AyaVisionForConditionalGeneration
from mrv2_cohere.aya_vision_inputs import AyaVisionInputProcessor, find_runs

SPECIAL = ("<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>",
           "<|IMG_LINE_BREAK|>", "TILE", "TILE_GLOBAL")
SEQ = 4  # image tokens a tile: 16-pixel tiles, patches of 4, downsample 2
LOGIT_SCALE = 0.5
#: kind -> (text config, vision_feature_layer)
KINDS: dict[str, tuple[dict[str, Any], Any]] = {
    "cohere2": ({"model_type": "cohere2", "layer_types": ["sliding_attention", "full_attention"],
                 "sliding_window": 4}, -1),
    "cohere": ({"model_type": "cohere", "use_qk_norm": True}, -2),
}


def _checkpoint(path: Path, kind: str) -> tuple[Any, Any, int]:
    """A tiny checkpoint (tokenizer with Aya's image tokens, GOT-OCR2 image processor, HF's
    processor config); HF's model (its logits times ``logit_scale``, see the model's doc), HF's
    processor and the ``<|IMG_PATCH|>`` id."""
    make_tiny_tokenizer(path, vocab_size=300, special_tokens=SPECIAL)
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(path))
    patch = int(tokenizer.convert_tokens_to_ids("<|IMG_PATCH|>"))
    text, layer = KINDS[kind]
    config = transformers.AyaVisionConfig(
        text_config={**text, "vocab_size": len(tokenizer) + 8, "hidden_size": 64,
                     "intermediate_size": 96, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2,
                     "max_position_embeddings": 1024, "logit_scale": LOGIT_SCALE,
                     "pad_token_id": None, "bos_token_id": 0, "eos_token_id": 1},
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32,
                       "intermediate_size": 48, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "patch_size": 4, "image_size": 16,
                       "vision_use_head": False},
        vision_feature_layer=layer, downsample_factor=2, image_token_index=patch,
        alignment_intermediate_size=48)  # type: ignore[call-arg]  # (read by getattr)
    config.architectures = ["AyaVisionForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.AyaVisionForConditionalGeneration(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(path)
    images = GotOcr2ImageProcessorPil(size={"height": 16, "width": 16}, crop_to_patches=True,
                                      min_patches=1, max_patches=4)
    processor = transformers.AyaVisionProcessor(image_processor=images, tokenizer=tokenizer,
                                                patch_size=4, img_size=16, downsample_factor=2)
    processor.save_pretrained(path)
    hf.lm_head.register_forward_hook(lambda module, args, out: out * LOGIT_SCALE)
    return hf, processor, patch


@pytest.fixture(scope="module", params=sorted(KINDS))
def setup(request: Any, tmp_path_factory: Any) -> Iterator[tuple[Path, Any, Any, int, LLM]]:
    """Per decoder kind: the checkpoint, HF's model and processor, the ``<|IMG_PATCH|>`` id,
    an engine whose steps (16 tokens) split images."""
    path = tmp_path_factory.mktemp(request.param)
    hf, processor, patch = _checkpoint(path, request.param)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=16)
    yield path, hf, processor, patch, llm
    llm.shutdown()


def test_prompt_expanded_as_hf_processor(setup: Any) -> None:
    """The ids and tiles equal HF's processor's for a text with two ``<image>`` (2 tiles and
    the thumbnail; one tile, no thumbnail); an ``<|IMG_PATCH|>`` placeholder expands alike (and
    an ``<image>`` the tokenizer splits is found as a run of its ids)."""
    path, _, processor, patch, _ = setup
    text = "Hello <image> world, and<image>!"
    images = [random_image(40, 20, seed=1), random_image(16, 16, seed=2)]
    want = processor(text=text, images=images, padding=False, return_tensors="pt")
    mine = AyaVisionInputProcessor(str(path), transformers.AutoConfig.from_pretrained(path),
                                   Tokenizer(path), EngineConfig())
    prompt = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    ids, items = mine.process(prompt, {"image": images})
    assert ids == [int(t) for t in want["input_ids"][0]]
    assert [item.data["pixel_values"].shape[0] for item in items] == [3, 1]
    torch.testing.assert_close(torch.cat([item.data["pixel_values"] for item in items]),
                               want["pixel_values"])
    image = int(processor.tokenizer.convert_tokens_to_ids("<image>"))
    by_patch = [patch if t == image else t for t in prompt]
    assert mine.process(by_patch, {"image": images})[0] == ids
    assert find_runs([1, 7, 8, 2, 7, 8, 9], [[9], [7, 8]]) == [(1, 2), (4, 2), (6, 1)]
    start = processor.tokenizer.convert_tokens_to_ids("<|START_OF_IMG|>")
    for item in items:
        span = ids[item.offset:item.offset + item.length]
        assert span == item.data["token_ids"] and span[0] == start
        assert span.count(patch) == SEQ * item.data["pixel_values"].shape[0]


def test_tokens_and_logprobs_match_hf(setup: Any) -> None:
    """Greedy tokens equal HF's ``generate``; image ``a`` runs the encoder once for both
    requests, across steps, and no more on a second round; the two-image prompt's
    log-probabilities (its image rows included) equal HF's forward's."""
    _, hf, processor, patch, llm = setup
    a, b = random_image(40, 20, seed=1), random_image(24, 30, seed=2)

    def hf_inputs(ids: list[int], items: list[Any], images: list[Any]) -> dict[str, Any]:
        if not images:
            return {}
        out = processor.image_processor(images=images, crop_to_patches=True,
                                        return_tensors="pt")
        return {"pixel_values": out["pixel_values"]}

    prompts: list[tuple[list[int], list[Any]]] = [
        ([5, 17, 42, patch, 100, 3], [a]), ([patch, 64, 8, patch, 50], [b, a]),
        ([3, 4, 5, 6], [])]
    expanded = check_images_against_hf(llm, hf, prompts, hf_inputs, max_tokens=6,
                                       encoder_runs=2, logprobs_of=1)
    tiles = [[i.data["pixel_values"].shape[0] for i in items] for _, items in expanded]
    assert tiles == [[3], [5, 3], []]
    for _, items in expanded[:2]:
        assert all(item.length > 16 for item in items)  # (each split across steps)


def test_checkpoint_names(setup: Any) -> None:
    """The saved names and HF's in-memory ones load every parameter."""
    path, hf, _, _, _ = setup
    config = transformers.AutoConfig.from_pretrained(path)
    for weights in (iter_safetensors(path), hf.state_dict().items()):
        model = AyaVisionForConditionalGeneration(config)
        loaded = load_model_weights(model, weights)
        assert loaded >= {name for name, _ in model.named_parameters()}


def test_bad_input_refused(setup: Any, tmp_path: Path) -> None:
    """Image counts that do not fit, other media, a non-image refused naming the field,
    nothing queued; a decoder or tower not built here refused naming the config field; a
    ``processor_config.json`` whose tiles give another token count refuses images by name."""
    path, _, _, patch, llm = setup
    picture = random_image(16, 16, seed=0)
    for prompt, mm_data, match in (
            ([5, patch], {"image": [picture, picture]}, "2 images but the prompt has 1"),
            ([5, patch, patch], {"image": [picture]}, "1 images but the prompt has 2"),
            ([5, patch], {"video": [picture]}, r"unsupported keys \['video'\]"),
            ([5, patch], {"image": ["cat.png"]}, r"multi_modal_data\.image: could not"),
            ([patch] * 5, {"image": [picture] * 5}, "5 images; at most 4")):
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt_token_ids": [5, 6]},
                          {"prompt_token_ids": prompt, "multi_modal_data": mm_data}],
                         SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    for sub, field in (("text_config", "text_config.model_type = 'llama'"),
                       ("vision_config", "vision_config.model_type = 'clip_vision_model'")):
        config = transformers.AutoConfig.from_pretrained(path)
        object.__setattr__(getattr(config, sub), "model_type", field.split("'")[1])
        with pytest.raises(ValueError, match=field):
            AyaVisionForConditionalGeneration(config)
    bad = Path(shutil.copytree(path, tmp_path / "bad"))
    settings = json.loads((bad / "processor_config.json").read_text())
    (bad / "processor_config.json").write_text(json.dumps({**settings, "img_size": 32}))
    mine = AyaVisionInputProcessor(str(bad), transformers.AutoConfig.from_pretrained(bad),
                                   Tokenizer(bad), EngineConfig())
    assert mine.process([5, 6], {}) == ([5, 6], [])
    with pytest.raises(ValueError, match=r"image: processor_config.json img_size=32, .* 16 "
                                         r"image tokens a tile, but the model's tiles give 4"):
        mine.process([5, patch], {"image": [random_image(16, 16, seed=0)]})
