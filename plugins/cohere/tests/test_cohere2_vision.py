"""Command A Vision (``Cohere2VisionForConditionalGeneration``) through the engine against HF
transformers: the prompt expanded as HF's ``Cohere2VisionProcessor`` expands it (tiles and the
thumbnail, a single tile; the tiling grid HF's ``get_optimal_tiled_canvas`` picks); greedy
tokens, the encoder cache and every prompt position's log-probability (image rows included)
with two images in a prompt split across steps beside a tiled-image prompt and a text prompt;
the whole tower with ``post_layernorm`` (the pooling head's tensors skipped), checkpoint names,
dummy weights; bad input refused naming the field."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.config import EngineConfig
from mrv2.engine.tokenizer import Tokenizer
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import make_tiny_tokenizer, random_image, redraw_weights
from mrv2.testing_engine import check_images_against_hf
from mrv2_cohere.cohere2_vision import (
    TOKENS,
    Cohere2VisionForConditionalGeneration,
    Cohere2VisionImageProcessorPil,
    Cohere2VisionInputProcessor,
    tile_grid,
)

SEQ = 4  # image tokens a tile: 16-pixel tiles, patches of 4, downsample 2
LOGIT_SCALE = 0.5


def _checkpoint(path: Path) -> tuple[Any, Any, int]:
    """A tiny checkpoint (a tokenizer with Command A Vision's image tokens as its
    ``boi_token`` / ``image_token`` / ... attributes, HF's processor config); HF's model (its
    logits times ``logit_scale``, see the model's doc), HF's processor (its image processor
    the PIL backend: this machine has no torchvision) and the ``<|IMG_PATCH|>`` id."""
    make_tiny_tokenizer(path, vocab_size=300, special_tokens=tuple(TOKENS.values()))
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(path),
                                                               extra_special_tokens=TOKENS)
    tokenizer.save_pretrained(path)
    patch = int(tokenizer.image_token_id)
    config = transformers.Cohere2VisionConfig(
        text_config={"model_type": "cohere2", "vocab_size": len(tokenizer) + 8,
                     "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2,
                     "layer_types": ["sliding_attention", "full_attention"],
                     "sliding_window": 4, "max_position_embeddings": 1024,
                     "logit_scale": LOGIT_SCALE, "pad_token_id": None, "bos_token_id": 0,
                     "eos_token_id": 1},
        vision_config={"model_type": "siglip_vision_model", "hidden_size": 32,
                       "intermediate_size": 48, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "patch_size": 4, "image_size": 16,
                       "vision_use_head": True},
        downsample_factor=2, image_token_id=patch, alignment_intermediate_size=48)
    config.architectures = ["Cohere2VisionForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.Cohere2VisionForConditionalGeneration(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(path)
    images = Cohere2VisionImageProcessorPil(size={"height": 16, "width": 16}, max_patches=4)
    images.patch_size = 2
    processor = transformers.Cohere2VisionProcessor(image_processor=images, tokenizer=tokenizer)
    processor.save_pretrained(path)
    settings = json.loads((path / "processor_config.json").read_text())
    settings["image_processor"]["image_processor_type"] = "Cohere2VisionImageProcessor"
    (path / "processor_config.json").write_text(json.dumps(settings))
    hf.lm_head.register_forward_hook(lambda module, args, out: out * LOGIT_SCALE)
    return hf, processor, patch


@pytest.fixture(scope="module")
def setup(tmp_path_factory: Any) -> Iterator[tuple[Path, Any, Any, int, LLM]]:
    """The checkpoint, HF's model and processor, the ``<|IMG_PATCH|>`` id, an engine whose
    steps (16 tokens) split images."""
    path = tmp_path_factory.mktemp("cohere2_vision")
    hf, processor, patch = _checkpoint(path)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=16)
    yield path, hf, processor, patch, llm
    llm.shutdown()


def test_prompt_expanded_as_hf_processor(setup: Any) -> None:
    """The ids and tiles equal HF's processor's for a text with two ``<|IMG_PATCH|>`` (a
    2 x 1 grid and the thumbnail; one tile, no thumbnail); HF's grid choice (least upscaling,
    else least downscaling; not GOT-OCR2's aspect-ratio rule)."""
    path, _, processor, patch, _ = setup
    text = "Hello <|IMG_PATCH|> world, and<|IMG_PATCH|>!"
    images = [random_image(40, 20, seed=1), random_image(16, 16, seed=2)]
    want = processor(text=text, images=images, padding=False, return_tensors="pt")
    mine = Cohere2VisionInputProcessor(str(path), transformers.AutoConfig.from_pretrained(path),
                                       Tokenizer(path), EngineConfig())
    prompt = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    ids, items = mine.process(prompt, {"image": images})
    assert ids == [int(t) for t in want["input_ids"][0]]
    assert [item.data["pixel_values"].shape[0] for item in items] == [3, 1]
    torch.testing.assert_close(torch.cat([item.data["pixel_values"] for item in items]),
                               want["pixel_values"])
    start, end, brk = processor.tokenizer.convert_tokens_to_ids(
        [TOKENS["boi_token"], TOKENS["eoi_token"], TOKENS["img_line_break_token"]])
    for item in items:
        span = ids[item.offset:item.offset + item.length]
        tiles = item.data["pixel_values"].shape[0]
        assert span == item.data["token_ids"] and span[0] == start and span[-1] == end
        assert span.count(patch) == SEQ * tiles and span.count(brk) == tiles
    # (columns, rows): 2 x 2 needs the least upscaling of a 24 x 30 image (GOT-OCR2: 2 x 1);
    # every grid downscales a 100 x 100 one: 3 x 3 the least; a wide one: 3 x 1
    assert [tile_grid(24, 30, 16, 4), tile_grid(100, 100, 16, 12), tile_grid(10, 40, 16, 4),
            tile_grid(16, 16, 16, 4), tile_grid(40, 20, 16, 4)] == [
                (2, 2), (3, 3), (3, 1), (1, 1), (1, 2)]


def test_tokens_and_logprobs_match_hf(setup: Any) -> None:
    """Greedy tokens equal HF's ``generate``; image ``a`` runs the encoder once for both
    requests, across steps, and no more on a second round; the two-image prompt's
    log-probabilities (its image rows included) equal HF's forward's; a text prompt beside
    them."""
    _, hf, _, patch, llm = setup
    a, b = random_image(40, 20, seed=1), random_image(24, 30, seed=2)

    def hf_inputs(ids: list[int], items: list[Any], images: list[Any]) -> dict[str, Any]:
        if not items:
            return {}
        return {"pixel_values": torch.cat([item.data["pixel_values"] for item in items])}

    prompts: list[tuple[list[int], list[Any]]] = [
        ([5, 17, 42, patch, 100, 3], [a]), ([patch, 64, 8, patch, 50], [b, a]),
        ([3, 4, 5, 6], [])]
    expanded = check_images_against_hf(llm, hf, prompts, hf_inputs, max_tokens=6,
                                       encoder_runs=2, logprobs_of=1)
    tiles = [[i.data["pixel_values"].shape[0] for i in items] for _, items in expanded]
    assert tiles == [[3], [5, 3], []]
    for _, items in expanded[:2]:
        assert all(item.length > 16 for item in items)  # (each split across steps)


def test_checkpoint_names_and_dummy_weights(setup: Any) -> None:
    """The saved names and HF's in-memory ones load every parameter (``post_layernorm`` run,
    the pooling head skipped); ``load_format="dummy"`` runs an image prompt."""
    path, hf, _, patch, _ = setup
    config = transformers.AutoConfig.from_pretrained(path)
    for weights in (iter_safetensors(path), hf.state_dict().items()):
        model = Cohere2VisionForConditionalGeneration(config)
        loaded = load_model_weights(model, weights)
        assert loaded >= {name for name, _ in model.named_parameters()}
    tower = model.vision.vision_tower
    assert len(tower.encoder.layers) == 2 and tower.post_layernorm is not None
    assert model.vision.multi_modal_projector.layernorm is None
    assert model.logit_scale == LOGIT_SCALE
    assert not any(".head." in name for name, _ in model.named_parameters())
    with LLM(str(path), device="cpu", dtype="float32", block_size=4,
             load_format="dummy") as llm:
        out = llm.generate([{"prompt_token_ids": [5, patch, 6],
                             "multi_modal_data": {"image": random_image(20, 30, seed=3)}}],
                           SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_bad_input_refused(setup: Any, tmp_path: Path) -> None:
    """Image counts that do not fit, other media, a non-image refused naming the field,
    nothing queued; a tower not built here refused naming the config field; an image
    processor whose ``patch_size`` gives another token count refuses images by name."""
    path, _, _, patch, llm = setup
    picture = random_image(16, 16, seed=0)
    for prompt, mm_data, match in (
            ([5, patch], {"image": [picture, picture]}, "2 images but the prompt has 1 image "
                                                        r"placeholders \(<\|IMG_PATCH\|>"),
            ([5, patch, patch], {"image": [picture]}, "1 images but the prompt has 2"),
            ([5, patch], {"video": [picture]}, r"unsupported keys \['video'\]"),
            ([5, patch], {"image": ["cat.png"]}, r"multi_modal_data\.image: could not")):
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt_token_ids": [5, 6]},
                          {"prompt_token_ids": prompt, "multi_modal_data": mm_data}],
                         SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished()
    config = transformers.AutoConfig.from_pretrained(path)
    object.__setattr__(config.vision_config, "model_type", "clip_vision_model")
    with pytest.raises(ValueError, match="vision_config.model_type = 'clip_vision_model' is "
                                         "not supported for Cohere2VisionForConditional"):
        Cohere2VisionForConditionalGeneration(config)
    bad = Path(shutil.copytree(path, tmp_path / "bad"))
    settings = json.loads((bad / "processor_config.json").read_text())
    settings["image_processor"]["patch_size"] = 4
    (bad / "processor_config.json").write_text(json.dumps(settings))
    mine = Cohere2VisionInputProcessor(str(bad), transformers.AutoConfig.from_pretrained(bad),
                                       Tokenizer(bad), EngineConfig())
    assert mine.process([5, 6], {}) == ([5, 6], [])
    with pytest.raises(ValueError, match=r"image: preprocessor_config.json patch_size=4 gives "
                                         r"16 image tokens a tile, but the model's tiles give 4"):
        mine.process([5, patch], {"image": [picture]})
