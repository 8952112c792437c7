"""Step-3.7's images against HF transformers: the crops HF's ``Step3p7ImageProcessor`` plans
(its torchvision backend is not installed here: the plan compared with HF's own
``_plan_patches``, the pixels with values worked out by hand), the prompt expanded as HF's
``Step3p7Processor.replace_image_token`` does, the vision tower against HF's
``Step3p7VisionModel`` module, and the whole model through the engine against HF's
``Step3p7ForConditionalGeneration`` forward with the same pixels (greedy tokens, the encoder
cache, every prompt position's log-probability, image rows included); checkpoint names, dummy
weights, bad input refused naming the field."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from mrv2 import LLM, SamplingParams
from mrv2.config import EngineConfig
from mrv2.engine.tokenizer import Tokenizer
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.plugins import get_plugin_manager
from mrv2.testing import random_image
from mrv2.testing_engine import check_images_against_hf
from mrv2_step.model import Step3p7ForConditionalGeneration
from mrv2_step.testing import save_tiny_step3p7_vl
from mrv2_step.vision_inputs import (
    CLIP_MEAN,
    CLIP_STD,
    TOKENS,
    Step3p7InputProcessor,
    plan_views,
)

GLOBAL, CROP = 9, 4  # image tokens of the 168-pixel global view and of a 112-pixel crop


@pytest.fixture(scope="module")
def setup(tmp_path_factory: Any) -> Iterator[tuple[Path, Any, int]]:
    """The tiny checkpoint (tokenizer, image settings), HF's model, the ``<im_patch>`` id."""
    manager = get_plugin_manager()
    if not manager.pm.has_plugin("step"):
        import mrv2_step.plugin

        manager.register(mrv2_step.plugin, name="step")
    path = tmp_path_factory.mktemp("step3p7_vl")
    hf, patch = save_tiny_step3p7_vl(path)
    yield path, hf.eval(), patch


def _processor(path: Path) -> Step3p7InputProcessor:
    return Step3p7InputProcessor(str(path), transformers.AutoConfig.from_pretrained(path),
                                 Tokenizer(path), EngineConfig())


def test_views_and_layout_match_hf(setup: Any) -> None:
    """The crop plan equals HF's ``_plan_patches`` over many sizes (square-padded slivers,
    images scaled down, elongated ones); a 224 x 112 image's crops are its halves normalized
    (no resize); the expanded prompt is HF's ``replace_image_token`` text, tokenized."""
    from transformers.models.step3p7.image_processing_step3p7 import Step3p7ImageProcessor

    path, _, patch = setup
    hf_plan: Any = Step3p7ImageProcessor._plan_patches
    fake = SimpleNamespace(max_image_size=400,
                           _is_extreme_aspect=Step3p7ImageProcessor._is_extreme_aspect)
    for w in (10, 31, 60, 100, 112, 150, 168, 200, 230, 300, 420, 1000):
        for h in (8, 40, 112, 135, 168, 250, 399, 500):
            assert plan_views(w, h, 168, 112, 400) == hf_plan(fake, w, h, 168, 112), (w, h)
    # worked by hand: 336 x 168 -> windows of 112, 3 x 2 crops (168 snaps up to 224)
    assert plan_views(336, 168, 168, 112, 400) == ((336, 168), (336, 224), 112, 3, 2, False)
    assert plan_views(20, 100, 168, 112, 400) == ((100, 100), (100, 100), 0, 0, 0, True)

    mine = _processor(path)
    array = np.random.default_rng(3).integers(0, 256, (112, 224, 3), dtype=np.uint8)
    whole, crops, mask = mine.require_images().views(Image.fromarray(array))
    mean = torch.tensor(CLIP_MEAN).view(3, 1, 1)
    std = torch.tensor(CLIP_STD).view(3, 1, 1)
    pixels = torch.from_numpy(array).permute(2, 0, 1).float() / 255
    want = torch.stack([(pixels[:, :, :112] - mean) / std, (pixels[:, :, 112:] - mean) / std])
    torch.testing.assert_close(crops, want, atol=1e-5, rtol=0)
    assert whole.shape == (3, 168, 168) and mask == [False, False]

    hf_proc: Any = object.__new__(transformers.Step3p7Processor)
    hf_proc.image_token = TOKENS["image"]
    hf_proc.image_feature_placeholder = TOKENS["image"] * GLOBAL
    hf_proc.patch_feature_placeholder = TOKENS["image"] * CROP
    tok: Any = transformers.AutoTokenizer.from_pretrained(str(path))
    images = [random_image(168, 336, seed=1), random_image(50, 60, seed=2)]
    text = f"Hi {TOKENS['image']} and{TOKENS['image']}!"
    ids, items = mine.process(tok(text, add_special_tokens=False)["input_ids"],
                              {"image": images})
    out = mine.require_images()(images)
    hf_text = text.replace(TOKENS["image"], "\0")
    for n in range(2):
        hf_text = hf_text.replace("\0", hf_proc.replace_image_token(out, n), 1)
    assert ids == tok(hf_text, add_special_tokens=False)["input_ids"]
    assert out["num_local_patches"] == [6, 0]
    assert out["patch_newline_masks"][0] == [False, False, True, False, False, False]
    first = ids[items[0].offset:items[0].offset + items[0].length]
    assert first.count(patch) == 6 * CROP + GLOBAL
    assert first.count(tok.convert_tokens_to_ids(TOKENS["newline"])) == 1


def test_tower_matches_hf_module(setup: Any) -> None:
    """Our tower equals HF's ``Step3p7VisionModel`` (2-D RoPE, layer scales, downsampler) on
    the table's own grid and on a resized one; a wrong RoPE would show."""
    _, hf, _ = setup
    model = Step3p7ForConditionalGeneration(hf.config)
    load_model_weights(model, iter_safetensors(setup[0]))
    tower = model.vision.vision_model
    for shape in ((2, 3, 168, 168), (3, 3, 112, 112)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want = hf.model.vision_model(x).last_hidden_state
            got = tower(x)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    tower.inv_freq.mul_(1.5)
    with torch.no_grad():
        assert not torch.allclose(tower(x), want, atol=1e-3)


@pytest.mark.parametrize("step_tokens", [16, 256])
def test_tokens_and_logprobs_match_hf(setup: Any, step_tokens: int) -> None:
    """Greedy tokens equal HF's ``generate`` with the same pixels; image ``a`` (3 x 2 crops
    and the global view) runs the encoder once for both requests, and no more on a second
    round; the two-image prompt's log-probabilities (image rows included) equal HF's
    forward's; a text prompt beside them. Steps of 16 tokens split every image."""
    path, hf, patch = setup
    hf = cast(Any, hf)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=step_tokens)
    a, b = random_image(168, 336, seed=1), random_image(130, 120, seed=2)

    def hf_inputs(ids: list[int], items: list[Any], images: list[Any]) -> dict[str, Any]:
        if not items:
            return {}
        crops = torch.cat([i.data["pixel_values_local"] for i in items])
        return {"pixel_values": torch.cat([i.data["pixel_values"] for i in items]),
                "pixel_values_local": crops if crops.shape[0] else None,
                "num_local_patches": [i.data["pixel_values_local"].shape[0] for i in items]}

    prompts: list[tuple[list[int], list[Any]]] = [
        ([5, 17, 42, patch, 100, 3], [a]), ([patch, 64, 8, patch, 50], [b, a]),
        ([3, 4, 5, 6, 7, 9, 11], [])]
    try:
        expanded = check_images_against_hf(llm, hf, prompts, hf_inputs, max_tokens=5,
                                           encoder_runs=2, logprobs_of=1)
    finally:
        llm.shutdown()
    crops = [[i.data["pixel_values_local"].shape[0] for i in items] for _, items in expanded]
    assert crops == [[6], [0, 6], []]
    assert [i.length for i in expanded[1][1]] == [GLOBAL + 2, 6 * (CROP + 2) + 1 + GLOBAL + 2]
    assert all(len(ids) > step_tokens for ids, _ in expanded[:2]) == (step_tokens == 16)


def test_checkpoint_names_dummy_weights_and_bad_input(setup: Any, tmp_path: Path) -> None:
    """The published names and HF's in-memory ones load every parameter; dummy weights run
    an image prompt; bad image input is refused naming the field, nothing queued; image
    settings the tower cannot count refuse images by field (text still runs)."""
    path, hf, patch = setup
    config = transformers.AutoConfig.from_pretrained(path)
    for weights in (iter_safetensors(path), hf.state_dict().items()):
        model = Step3p7ForConditionalGeneration(config)
        loaded = load_model_weights(model, weights)
        assert loaded == {name for name, _ in model.named_parameters()}
    picture = random_image(120, 240, seed=0)
    with LLM(str(path), device="cpu", dtype="float32", block_size=4,
             load_format="dummy") as llm:
        out = llm.generate([{"prompt_token_ids": [5, patch, 6],
                             "multi_modal_data": {"image": picture}}],
                           SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
        for prompt, mm_data, match in (
                ([5, patch], {"image": [picture, picture]},
                 r"2 images but the prompt has 1 image placeholders \(token \d+, <im_patch>"),
                ([5, patch], {"video": [picture]}, r"unsupported keys \['video'\]"),
                ([5, patch], {"image": ["cat.png"]}, r"multi_modal_data\.image: expects PIL")):
            with pytest.raises(ValueError, match=match):
                llm.generate([{"prompt_token_ids": [5, 6]},
                              {"prompt_token_ids": prompt, "multi_modal_data": mm_data}],
                             SamplingParams(max_tokens=2), use_tqdm=False)
        assert not llm.engine.has_unfinished()
    bad = Path(shutil.copytree(path, tmp_path / "bad"))
    settings = json.loads((bad / "preprocessor_config.json").read_text())
    settings["patch_size"] = 100
    (bad / "preprocessor_config.json").write_text(json.dumps(settings))
    mine = _processor(bad)
    assert mine.process([5, 6], {}) == ([5, 6], [])
    with pytest.raises(ValueError, match=r"image: preprocessor_config.json patch_size=100: "
                                         r"must be a multiple of 56"):
        mine.process([5, patch], {"image": [picture]})
