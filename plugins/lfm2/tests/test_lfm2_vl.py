"""LFM2-VL (``Lfm2VlForConditionalGeneration``) through the engine against HF transformers:
greedy tokens, the encoder cache on a second round and every prompt position's
log-probability (image rows included) with a tiled image (tiles and thumbnail) and an untiled
one in a prompt, an image shared between requests and a text prompt beside them, chunked
prefill splitting images across steps; HF's prompt layout; checkpoint names; bad input and
unsupported configs refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
from transformers.models.lfm2_vl.processing_lfm2_vl import Lfm2VlProcessor

from mrv2 import LLM, SamplingParams
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import random_image
from mrv2.testing_engine import check_images_against_hf
from mrv2_lfm2.testing import hf_vl_inputs, save_tiny_lfm2_vl
from mrv2_lfm2.vl import Lfm2VlForConditionalGeneration

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning")

#: variant -> (top-level overrides, image settings overrides): tiles with a thumbnail, a
#: layer-normed projector and an untied head; images never tiled, no projector norm, tied.
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tiled": ({}, {}),
    "untiled": ({"projector_use_layernorm": False, "tie_word_embeddings": True},
                {"do_image_splitting": False}),
}
STEP = 8
BIG, SMALL = random_image(40, 56, seed=1), random_image(12, 20, seed=2)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def setup(request: Any, tmp_path_factory: Any) -> Iterator[tuple[str, Path, Any, int, LLM]]:
    """Per variant: the checkpoint, HF's model, the ``<image>`` id and an engine whose steps
    (:data:`STEP` tokens) split images."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    overrides, images = VARIANTS[name]
    hf, image = save_tiny_lfm2_vl(path, images=images, **overrides)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=STEP)
    yield name, path, hf, image, llm
    llm.shutdown()


def test_tokens_and_logprobs_match_hf(setup: Any) -> None:
    """Greedy tokens equal HF's ``generate`` (a text prompt's too); ``BIG`` runs the encoder
    once for both requests, across steps, and no more on a second round; the two-image
    prompt's log-probabilities equal HF's forward's; the layout is HF's processor's."""
    name, _, hf, image, llm = setup
    prompts: list[tuple[list[int], list[Any]]] = [
        ([5, 17, 42, image, 100, 3], [BIG]), ([image, 64, 8, image, 50], [SMALL, BIG]),
        ([3, 4, 5, 6], [])]
    expanded = check_images_against_hf(
        llm, hf, prompts, lambda ids, items, images: hf_vl_inputs(items), max_tokens=6,
        encoder_runs=2, logprobs_of=1)
    processor = llm.engine.input_processor
    tokenizer: Any = processor.hf_tokenizer
    stub = SimpleNamespace(image_token="<image>", image_start_token="<|image_start|>",
                           image_end_token="<|image_end|>",
                           image_thumbnail_token="<|img_thumbnail|>")
    big = expanded[0][1][0]
    # 40 x 56 is over 8 tokens' 1024 pixels (x 2): 2 x 2 tiles of 4 tokens and a 16 x 24
    # thumbnail (4 x 6 patches, 6 tokens) where tiled; 16 x 24 alone where not
    rows, cols = (2, 2) if name == "tiled" else (1, 1)
    assert big.data["shapes"] == [(4, 4)] * (rows * cols) * (rows > 1) + [(4, 6)]
    text = Lfm2VlProcessor._build_image_tokens(stub, rows, cols, 4, 6, True,  # type: ignore[arg-type]
                                               True)
    assert big.data["token_ids"] == tokenizer.encode(text, add_special_tokens=False)
    assert expanded[0][0].count(image) == 4 * rows * cols * (rows > 1) + 6
    assert big.offset // STEP != (big.offset + big.length - 1) // STEP  # (split across steps)


def test_checkpoint_names(setup: Any) -> None:
    """The saved names, HF's in-memory ones and the older nested ``vision_tower.vision_model.``
    layout (a pooling head's tensors skipped) load every parameter."""
    _, path, hf, _, _ = setup
    config = transformers.AutoConfig.from_pretrained(path)
    nested = [(n.replace("vision_tower.", "vision_tower.vision_model."), t)
              for n, t in hf.state_dict().items()]
    nested.append(("model.vision_tower.vision_model.head.probe", torch.zeros(1, 1, 32)))
    for weights in (iter_safetensors(path), hf.state_dict().items(), nested):
        model = Lfm2VlForConditionalGeneration(config)
        loaded = load_model_weights(model, weights)
        assert loaded >= {name for name, _ in model.named_parameters()}


def test_bad_input_refused(setup: Any, tmp_path: Path) -> None:
    """Image counts that do not fit, other keys and things that are not images refused by
    name, nothing queued; a decoder or tower not built here, and image settings that do not
    fit the model (text prompts still run), refused naming the field."""
    _, path, _, image, llm = setup
    params = SamplingParams(max_tokens=2)
    for prompt, mm_data, match in (
            ([5, image], {"image": [SMALL, SMALL]}, "2 images but the prompt has 1"),
            ([5, image, image], {"image": [SMALL]}, "1 images but the prompt has 2"),
            ([5, image], {"video": [SMALL]}, r"unsupported keys \['video'\]"),
            ([5, image], {"image": ["cat.png"]}, r"multi_modal_data\.image: expects PIL"),
            ([image] * 5, {"image": [SMALL] * 5}, "5 images; at most 4")):
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt_token_ids": [3, 4]},
                          {"prompt_token_ids": prompt, "multi_modal_data": mm_data}],
                         params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    for part, kind in (("text_config", "lfm2_moe"), ("vision_config", "siglip_vision_model")):
        config = transformers.AutoConfig.from_pretrained(path)
        object.__setattr__(getattr(config, part), "model_type", kind)
        with pytest.raises(ValueError, match=f"{part}.model_type = '{kind}' is not supported"):
            Lfm2VlForConditionalGeneration(config)
    settings = json.loads((path / "preprocessor_config.json").read_text())
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**settings, "encoder_patch_size": 8}))
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    config = transformers.AutoConfig.from_pretrained(path)
    mine = type(llm.engine.input_processor)(str(tmp_path), config,
                                            llm.engine.input_processor.tokenizer,
                                            llm.engine.config)
    assert mine.process([5, 6], {}) == ([5, 6], [])
    with pytest.raises(ValueError, match="encoder_patch_size=8 .* vision_config.patch_size=4"):
        mine.process([5, image], {"image": [SMALL]})
