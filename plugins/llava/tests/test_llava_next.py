"""LLaVA-NeXT (``LlavaNextForConditionalGeneration``: anyres tiles, unpadding,
``image_newline``) against HF transformers: the layout arithmetic against HF's helpers over
many sizes; one image's packed tokens against HF's ``get_image_features`` for images of
several aspect ratios (both unpadding directions); the prompt expanded as HF's
``LlavaNextProcessor`` expands it; greedy tokens and prompt log-probabilities through the
engine with two images in a prompt, a shared image, a text prompt and images split across
steps; checkpoint names; unsupported settings refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.image_processing_utils import select_best_resolution
from transformers.models.llava_next import modeling_llava_next as hf_next

from mrv2 import LLM, SamplingParams
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import make_tiny_tokenizer, random_image, redraw_weights
from mrv2_llava.llava_next import (
    LlavaNextForConditionalGeneration,
    LlavaNextVisionEncoder,
    best_resolution,
    image_token_count,
    unpadded_grid,
)

PINPOINTS = [[16, 32], [32, 16], [32, 32], [48, 16], [16, 48]]
VISION: dict[str, Any] = {"model_type": "clip_vision_model", "hidden_size": 32,
                          "intermediate_size": 48, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "image_size": 16, "patch_size": 4}
SIZES = [(40, 20), (16, 16), (21, 70), (33, 31), (90, 17), (50, 60)]


def _config(image: int = 300, **top: Any) -> Any:
    text = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 1024}
    config = transformers.LlavaNextConfig(text_config=text, vision_config=dict(VISION),
                                          image_token_index=image, image_grid_pinpoints=PINPOINTS,
                                          tie_word_embeddings=False, **top)
    config.architectures = ["LlavaNextForConditionalGeneration"]
    return config


def _model(config: Any) -> Any:
    torch.manual_seed(0)
    model = transformers.LlavaNextForConditionalGeneration(config).eval()
    redraw_weights(model)
    return model


def _processor() -> Any:
    return transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
        image_grid_pinpoints=PINPOINTS)


def test_layout_matches_hf_helpers() -> None:
    """Best resolution and the unpadded grid equal HF's helpers for many sizes and grids."""
    for h in range(5, 120, 7):
        for w in range(3, 130, 11):
            assert best_resolution((h, w), PINPOINTS) == select_best_resolution((h, w),
                                                                                 PINPOINTS)
            for grid in ((8, 4), (4, 8), (12, 4), (8, 8)):
                top, height, left, width = unpadded_grid((h, w), grid)
                values = torch.arange(grid[0] * grid[1]).view(1, *grid)
                ref = hf_next.unpad_image(values, [h, w])[0]
                assert torch.equal(values[0, top:top + height, left:left + width], ref), (
                    h, w, grid)


@pytest.fixture(scope="module")
def hf() -> Any:
    return _model(_config())


def test_packed_features_match_hf(hf: Any) -> None:
    """Every parameter loads (``image_newline`` too) and each image's tokens equal HF's."""
    out = _processor()([random_image(h, w, seed=n) for n, (h, w) in enumerate(SIZES)],
                       return_tensors="pt")
    encoder = LlavaNextVisionEncoder(hf.config).eval()
    loaded = encoder.load_weights(hf.state_dict().items())
    assert loaded == {name for name, _ in encoder.named_parameters()}
    with torch.no_grad():
        ref = hf.model.get_image_features(
            pixel_values=out["pixel_values"], image_sizes=out["image_sizes"],
            vision_feature_layer=-2, vision_feature_select_strategy="default",
            return_dict=True).pooler_output
    counts = set()
    for n, size in enumerate(SIZES):
        tiles = hf_next.image_size_to_num_patches(size, PINPOINTS, 16)
        with torch.no_grad():
            ours = encoder.embed(out["pixel_values"][n, :tiles], size)
        assert ours.shape == ref[n].shape == (image_token_count(hf.config, size), 64)
        counts.add(ours.shape[0])
        torch.testing.assert_close(ours, ref[n], rtol=1e-5, atol=1e-5 * ref[n].abs().max())
    assert len(counts) >= 4


def _checkpoint(path: Path) -> tuple[Any, int]:
    make_tiny_tokenizer(path, vocab_size=300, special_tokens=("<image>",))
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(path))
    image = int(tokenizer.convert_tokens_to_ids("<image>"))
    hf = _model(_config(image))
    hf.save_pretrained(path)
    _processor().save_pretrained(path)
    return hf, image


def _hf_inputs(images: list[Any]) -> dict[str, Any]:
    if not images:
        return {}
    out = _processor()(images=images, return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"]}


def test_engine_matches_hf(tmp_path: Path) -> None:
    hf, image = _checkpoint(tmp_path)
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=24)
    processor = llm.engine.input_processor
    a, b = random_image(21, 70, seed=1), random_image(40, 20, seed=2)
    hf_processor = transformers.LlavaNextProcessor(
        image_processor=_processor(), tokenizer=tokenizer, patch_size=4,
        vision_feature_select_strategy="default", num_additional_image_tokens=1)
    text = "Hello <image> world, and<image>!"
    want_ids = hf_processor(text=text, images=[a, b], return_tensors="pt")["input_ids"][0]
    ids, items = processor.process(tokenizer(text, add_special_tokens=False)["input_ids"],
                                   {"image": [a, b]})
    assert ids == [int(t) for t in want_ids] and len(items) == 2
    assert items[0].length != items[1].length

    prompts: list[tuple[list[int], list[Any]]] = [
        ([5, 17, image, 100, 3], [a]), ([image, 64, 8, image, 50], [b, a]), ([3, 4, 5, 6], [])]
    hf.generation_config.eos_token_id = None
    want = []
    for prompt, images in prompts:
        ids, _ = processor.process(prompt, {"image": images})
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                              max_new_tokens=5, do_sample=False, **_hf_inputs(images))
        want.append([int(t) for t in out[0, len(ids):]])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    requests = [{"prompt_token_ids": p, "multi_modal_data": {"image": i}} for p, i in prompts]
    outs = llm.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.engine.runner.model_state.encoder_runs == 2

    ids, _ = processor.process(prompts[1][0], {"image": prompts[1][1]})
    with torch.no_grad():
        logits = hf(torch.tensor([ids]), **_hf_inputs(prompts[1][1])).logits[0]
    want_lp = torch.log_softmax(logits.double(), dim=-1)
    got = llm.generate([requests[1]], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0].prompt_logprobs
    assert got is not None and len(got) == len(ids)
    for pos in range(1, len(ids)):
        mine = got[pos]
        assert mine is not None
        assert mine[ids[pos]].logprob == pytest.approx(float(want_lp[pos - 1, ids[pos]]),
                                                       abs=1e-4), pos

    config = transformers.AutoConfig.from_pretrained(tmp_path)
    for weights in (iter_safetensors(tmp_path), hf.state_dict().items()):
        model = LlavaNextForConditionalGeneration(config)
        assert load_model_weights(model, weights) >= {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize(("field", "top"), [
    ("vision_feature_select_strategy", {"vision_feature_select_strategy": "full"}),
    ("image_grid_pinpoints", {"image_grid_pinpoints": [[16, 30]]}),
])
def test_unsupported_config_refused(field: str, top: dict[str, Any]) -> None:
    config = _config()
    for key, value in top.items():
        object.__setattr__(config, key, value)
    with pytest.raises(ValueError, match=field):
        LlavaNextForConditionalGeneration(config)
