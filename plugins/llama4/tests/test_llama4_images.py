"""Llama 4's images (``Llama4ForConditionalGeneration``) against HF transformers: the tile
choice and resize sizes against HF's own ``image_processing_llama4`` functions (imported
over a stand-in for torchvision, which the module imports but these functions never call)
and hand-worked cases; the prompt layout against HF's ``Llama4Processor``; the pixels
against a step-by-step restatement (HF's ``split_to_tiles``, torchvision's resize call on
both of its CPU paths; PIL's resize within a level); the encoder's features against HF's
``get_image_features`` and projector; and through the engine greedy tokens, the encoder
cache on a second round and every prompt position's log-probability against HF's model fed
the same pixels (two images in a prompt, one shared between requests, split across steps),
the chat path, TP=2 (the encoder replicated), checkpoint names, the encoder profile, bad
input refused by name."""

from __future__ import annotations

import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from PIL import Image
from transformers.image_transforms import split_to_tiles
from transformers.image_utils import SizeDict
from transformers.models.llama4.processing_llama4 import Llama4Processor

from mrv2 import LLM, SamplingParams
from mrv2.config import EngineConfig
from mrv2.engine.tokenizer import Tokenizer
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import random_image
from mrv2.testing_engine import check_images_against_hf
from mrv2_llama4.images import (
    IMAGE_TOKENS,
    ImageSettings,
    ImageTokens,
    best_canvas,
    image_layout,
    layout_length,
    preprocess,
    resize,
    resize_target,
    supported_canvases,
)
from mrv2_llama4.inputs import Llama4InputProcessor
from mrv2_llama4.model import Llama4ForConditionalGeneration
from mrv2_llama4.testing import IMAGE_PREPROCESSOR, hf_image_inputs, save_tiny_llama4_images
from mrv2_llama4.vision import Llama4VisionEncoder

SETTINGS = ImageSettings.from_config(IMAGE_PREPROCESSOR)
PER_TILE = 4  # (56 // 14)**2 / 2**2


@pytest.fixture(scope="module")
def hf_images() -> Iterator[Any]:
    """HF's ``image_processing_llama4`` module, imported over stand-in torchvision modules
    (removed again after)."""
    names = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional"]
    stubs = [types.ModuleType(name) for name in names]
    for parent, child in zip(stubs[:-1], stubs[1:], strict=True):
        setattr(parent, child.__name__.rsplit(".", 1)[1], child)
    module = "transformers.models.llama4.image_processing_llama4"
    with pytest.MonkeyPatch.context() as patch:
        for name, stub in zip(names, stubs, strict=True):
            patch.setitem(sys.modules, name, stub)
        import transformers.models.llama4.image_processing_llama4 as hf

        yield hf
        sys.modules.pop(module, None)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Any, Any, LLM]]:
    """The tiny checkpoint with its tokenizer and preprocessor config, HF's model, the HF
    tokenizer and an engine whose steps (16 tokens) split images."""
    path = tmp_path_factory.mktemp("llama4_images")
    hf = save_tiny_llama4_images(path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=16)
    yield path, hf, tokenizer, llm
    llm.shutdown()


def _hf_target(hf_images: Any, size: tuple[int, int], canvas: Any, tile: int,
               to_max: bool) -> tuple[int, int]:
    """HF's ``_preprocess``: the upscaling limit, then ``get_max_res_without_distortion``."""
    target = canvas
    if not to_max:
        target = (min(max(size[0], tile), canvas[0]), min(max(size[1], tile), canvas[1]))
    h, w = hf_images.get_max_res_without_distortion(size, target)
    return max(int(h), 1), max(int(w), 1)


@pytest.mark.parametrize("to_max", [False, True], ids=["fit", "max-canvas"])
def test_canvas_and_resize_size_are_hf(hf_images: Any, to_max: bool) -> None:
    """The canvases, the canvas picked and the resize size are HF's functions' for image
    sizes of every shape (tiny, exact tile multiples, very wide and tall, random), tiles of
    336 and 56 and up to 1, 4 and 16 tiles."""
    gen = np.random.default_rng(0)
    sizes = [(1, 1), (336, 336), (672, 1008), (335, 337), (56, 560), (4000, 30), (30, 4000)]
    sizes += [(int(h), int(w)) for h, w in gen.integers(1, 3000, (60, 2))]
    for tile, max_patches in ((336, 16), (336, 1), (56, 4)):
        canvases = supported_canvases(max_patches, tile)
        want = hf_images.find_supported_resolutions(max_patches,
                                                    SizeDict(height=tile, width=tile))
        assert canvases == want
        table = torch.tensor(want)
        for size in sizes:
            canvas = best_canvas(size, canvases, to_max)
            hf_canvas = hf_images.get_best_fit(size, table, resize_to_max_canvas=to_max)
            assert canvas.tolist() == hf_canvas.tolist(), size
            assert resize_target(size, canvas, tile, to_max) == _hf_target(
                hf_images, size, hf_canvas, tile, to_max), size


def test_canvas_hand_worked() -> None:
    """Tiles of 336, at most 16: a small image goes on one tile, upscaled by its limiting side
    to 336 (no further); 500 x 900 goes on 2 x 3 tiles (the smallest upscale, 1.12, with the
    least area) unresized; 1000 x 5000 can't fit unshrunk, so 2 x 8 tiles (the least
    shrinking, 0.5376) and 537 x 2688 (HF's float32 scale floors 537.6)."""
    canvases = supported_canvases(16, 336)
    assert len(canvases) == 50 and canvases[:3] == [(336, 5376), (672, 2688), (336, 1344)]
    for size, canvas, target in (((100, 50), (336, 336), (336, 168)),
                                 ((500, 900), (672, 1008), (500, 900)),
                                 ((1000, 5000), (672, 2688), (537, 2688))):
        chosen = best_canvas(size, canvases)
        assert tuple(chosen.tolist()) == canvas
        assert resize_target(size, chosen, 336) == target


def _ids(text: str, tokens: ImageTokens) -> list[int]:
    names = dict(zip(IMAGE_TOKENS, (tokens.start, tokens.end, tokens.image, tokens.patch,
                                    tokens.tile_x, tokens.tile_y), strict=True))
    pieces = re.findall(r"<\|[a-z_]+\|>", text)
    assert "".join(pieces) == text
    return [names[p] for p in pieces]


def test_prompt_layout_is_hf() -> None:
    """Each grid's layout is HF ``Llama4Processor._prompt_split_image``'s string, token for
    token; :func:`layout_length` is its length."""
    tokens = ImageTokens(10, 11, 12, 13, 14, 15)
    for rows, cols in ((1, 1), (1, 3), (3, 1), (2, 2), (4, 4)):
        for per_tile in (PER_TILE, 144):
            text = Llama4Processor._prompt_split_image(cast(Any, None), (rows, cols), per_tile)
            want = _ids(text, tokens)
            got = image_layout(rows, cols, per_tile, tokens)
            assert got == want and len(got) == layout_length(rows * cols, per_tile)
    assert image_layout(1, 2, 1, tokens) == [10, 13, 14, 13, 15, 12, 13, 11]


def _reference_resize(pixels: torch.Tensor, size: tuple[int, int], native: bool
                      ) -> torch.Tensor:
    """torchvision's resize of a uint8 CPU image: uint8 bilinear with AVX2 or AVX512 (as
    torchvision 0.29 decides), else fp32 then rounded."""
    if tuple(pixels.shape[-2:]) == size:
        return pixels
    x = pixels[None] if native else pixels[None].float()
    x = F.interpolate(x, size=list(size), mode="bilinear", align_corners=False, antialias=True)
    return x[0] if native else x[0].round().to(torch.uint8)


def _reference_tiles(hf_images: Any, image: Image.Image, native: bool) -> torch.Tensor:
    """HF's fast processor, step by step: RGB, canvas, size, resize, zero pad, bf16 rescale
    and normalize, ``split_to_tiles``, the global tile."""
    rgb = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
    size, tile = (rgb.shape[1], rgb.shape[2]), 56
    canvas = hf_images.get_best_fit(size, torch.tensor(hf_images.find_supported_resolutions(
        4, SizeDict(height=tile, width=tile))))
    resized = _reference_resize(rgb, _hf_target(hf_images, size, canvas, tile, False), native)
    padded = torch.zeros(3, int(canvas[0]), int(canvas[1]), dtype=torch.uint8)
    padded[:, :resized.shape[1], :resized.shape[2]] = resized
    mean = torch.tensor(IMAGE_PREPROCESSOR["image_mean"], dtype=torch.bfloat16)[:, None, None]
    std = torch.tensor(IMAGE_PREPROCESSOR["image_std"], dtype=torch.bfloat16)[:, None, None]

    def norm(x: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.bfloat16) * (1 / 255) - mean) / std

    rows, cols = int(canvas[0]) // tile, int(canvas[1]) // tile
    tiles = split_to_tiles(norm(padded)[None], rows, cols)[0]
    if rows * cols == 1:
        return tiles
    return torch.cat([tiles, norm(_reference_resize(rgb, (tile, tile), native))[None]])


@pytest.mark.parametrize("capability", ["AVX2", "AVX512", "DEFAULT"])
def test_pixels_are_the_fast_processors(hf_images: Any, capability: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles equal the step-by-step restatement bit for bit, on torchvision's uint8 path
    (AVX2, AVX512) and its fp32 path (no AVX), for an image on 1 x 3 tiles, one upscaled onto
    one tile (grayscale: converted to RGB), a transparent one shrunk onto 2 x 2; PIL's resize is
    within a level of 255 of the resize."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    gray = Image.fromarray(np.random.default_rng(3).integers(0, 256, (30, 20), dtype=np.uint8))
    rgba = Image.fromarray(np.random.default_rng(4).integers(0, 256, (200, 150, 4),
                                                              dtype=np.uint8))
    for image, grid in ((random_image(60, 130, seed=1), (1, 3)), (gray, (1, 1)),
                        (rgba, (2, 2))):
        tiles, got_grid = preprocess(image, SETTINGS)
        assert got_grid == grid and tiles.dtype == torch.bfloat16
        want = _reference_tiles(hf_images, image, capability != "DEFAULT")
        assert tiles.shape == want.shape and torch.equal(tiles, want)
    rgb = torch.from_numpy(np.array(rgba.convert("RGB"))).permute(2, 0, 1)
    pil = np.array(rgba.convert("RGB").resize((56, 75), Image.Resampling.BILINEAR))
    diff = resize(rgb, (75, 56)).int() - torch.from_numpy(pil).permute(2, 0, 1).int()
    assert diff.abs().max() <= 1


def test_encoder_matches_hf(setup: tuple[Path, Any, Any, LLM],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoder's features of five random tiles equal HF's ``get_image_features`` and
    projector; without the 2-D RoPE they do not."""
    path, hf, _, _ = setup
    model = Llama4ForConditionalGeneration(transformers.AutoConfig.from_pretrained(path))
    load_model_weights(model, iter_safetensors(path))
    pixels = torch.randn(5, 3, 56, 56, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = hf.get_image_features(pixel_values=pixels, vision_feature_select_strategy=None)
        want = hf.multi_modal_projector(out.last_hidden_state.flatten(0, 1))
        got = model.embed_image(pixels)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        vision = model.vision
        monkeypatch.setattr(vision, "turns", lambda device: torch.ones(17, 8, dtype=torch.cfloat))
        assert (model.embed_image(pixels) - want).abs().amax() > 1e-2


def test_tokens_and_logprobs_match_hf(setup: tuple[Path, Any, Any, LLM]) -> None:
    """Greedy tokens equal HF's ``generate``; image ``a`` (1 x 3 tiles and the global one)
    runs the encoder once for both requests, across steps, and no more on a second round;
    the prompt's log-probabilities equal HF's forward's; each item spans its layout."""
    _, hf, tokenizer, llm = setup
    image = int(tokenizer.convert_tokens_to_ids("<|image|>"))
    patch = int(hf.config.image_token_index)
    a, b = random_image(60, 130, seed=1), random_image(30, 20, seed=2)
    prompts: list[tuple[list[int], list[Any]]] = [
        ([5, 17, 42, image, 100, 3], [a]), ([image, 64, 8, image, 50, 9], [b, a]),
        ([3, 4, 5, 6], [])]
    expanded = check_images_against_hf(llm, hf, prompts, hf_image_inputs, max_tokens=6,
                                       encoder_runs=2, logprobs_of=1)
    ids, items = expanded[1]
    assert [item.data["pixel_values"].shape[0] for item in items] == [1, 4]
    assert [item.length for item in items] == [7, 22]  # (a: split across steps of 16)
    start, end = (int(tokenizer.convert_tokens_to_ids(t)) for t in IMAGE_TOKENS[:2])
    for item in items:
        span = ids[item.offset:item.offset + item.length]
        assert span == item.data["token_ids"] and span[0] == start and span[-1] == end
    assert ids.count(patch) == PER_TILE * 5


def test_chat_matches_hf(setup: tuple[Path, Any, Any, LLM]) -> None:
    """``LLM.chat`` with an image part (the template's ``<|image|>``) gives HF's greedy
    tokens."""
    _, hf, tokenizer, llm = setup
    picture = random_image(120, 110, seed=5)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                             {"type": "image", "image": picture},
                                             {"type": "text", "text": "world"}]}]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    got = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids
    prompt = tokenizer.encode("<|user|>Hello<|image|>world</s><|assistant|>",
                              add_special_tokens=False)  # (the template's rendering)
    ids, items = llm.engine.input_processor.process(prompt, {"image": [picture]})
    assert items[0].data["pixel_values"].shape[0] == 5  # (2 x 2 tiles, the global one)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                          dtype=torch.long), max_new_tokens=5, do_sample=False,
                          **hf_image_inputs(ids, items, [picture]))
    assert list(got) == [int(t) for t in out[0, len(ids):]]


def test_tensor_parallel_matches_hf(setup: tuple[Path, Any, Any, LLM]) -> None:
    """TP=2 (two CPU processes: the text model split, the encoder whole on both ranks) gives
    HF's greedy tokens for two image prompts, one split across steps."""
    path, hf, tokenizer, llm = setup
    image = int(tokenizer.convert_tokens_to_ids("<|image|>"))
    prompts = [([5, image, 7, 8], [random_image(60, 130, seed=1)]),
               ([image, 9], [random_image(30, 20, seed=2)])]
    hf.generation_config.eos_token_id = None
    want = []
    for prompt, images in prompts:
        ids, items = llm.engine.input_processor.process(prompt, {"image": images})
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                              dtype=torch.long), max_new_tokens=6, do_sample=False,
                              **hf_image_inputs(ids, items, images))
        want.append([int(t) for t in out[0, len(ids):]])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(path), device="cpu", dtype="float32", block_size=4, tensor_parallel_size=2,
             max_num_batched_tokens=16) as tp:
        outs = tp.generate([{"prompt_token_ids": p, "multi_modal_data": {"image": i}}
                            for p, i in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_checkpoint_names(setup: tuple[Path, Any, Any, LLM]) -> None:
    """The saved names and HF's in-memory ones load every parameter, the encoder's included."""
    path, hf, _, _ = setup
    config = transformers.AutoConfig.from_pretrained(path)
    for weights in (iter_safetensors(path), hf.state_dict().items()):
        model = Llama4ForConditionalGeneration(config)
        loaded = load_model_weights(model, weights)
        names = {name for name, _ in model.named_parameters()}
        assert loaded >= names and any(name.startswith("vision.") for name in names)


def test_profile_encoder_runs_the_largest_image(setup: tuple[Path, Any, Any, LLM],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile runs the encoder over ``max_patches`` tiles and the global one, fewer
    where the layout would not fit the prompt budget, none below one tile's layout."""
    _, _, _, llm = setup
    state = llm.engine.runner.model_state
    model = llm.engine.runner.model
    seen: list[tuple[int, ...]] = []
    monkeypatch.setattr(model, "embed_image", lambda pixels: seen.append(tuple(pixels.shape)))
    for budget in (1000, layout_length(3, PER_TILE), layout_length(2, PER_TILE) - 1, 6):
        state.profile_encoder(budget)
    assert seen == [(5, 3, 56, 56), (4, 3, 56, 56), (1, 3, 56, 56)]


def test_bad_input_refused(setup: tuple[Path, Any, Any, LLM]) -> None:
    """Image counts that do not fit the prompt or ``--limit-mm-per-prompt``, video, objects
    that are not images and prompts already expanded are refused by name, nothing queued."""
    _, hf, tokenizer, llm = setup
    image = int(tokenizer.convert_tokens_to_ids("<|image|>"))
    patch = int(hf.config.image_token_index)
    picture = random_image(16, 16, seed=0)
    params = SamplingParams(max_tokens=2)
    for prompt, mm_data, match in (
            ([5, image], {"image": [picture, picture]}, "2 images but the prompt has 1"),
            ([5, image, image], {"image": [picture]}, "1 images but the prompt has 2"),
            ([5, image], {"video": [picture]}, r"unsupported keys \['video'\].*images only"),
            ([image] * 5, {"image": [picture] * 5}, "5 images; at most 4"),
            ([5, image], {"image": ["a.png"]}, "expects PIL images or uint8 .* got str"),
            ([5, image], {"image": [np.zeros((4, 4), np.uint8)]}, r"RGB uint8 \[H, W, 3\]"),
            ([patch, image], {"image": [picture]}, "already holds <|patch|>")):
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": mm_data}],
                         params, use_tqdm=False)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(("field", "value", "match"), [
    ("size", {"height": 56, "width": 112}, "size = .*square"),
    ("resample", 1, "resample = 1: supported: 2 .*3"),
    ("do_normalize", False, "do_normalize = False: only true"),
    ("image_mean", [0.5, 0.5], "image_mean = .*three numbers"),
    ("image_processor_type", "CLIPImageProcessor", "image_processor_type = 'CLIPImage"),
    ("max_patches", 0, "max_patches = 0")])
def test_bad_preprocessor_config_refused(field: str, value: Any, match: str) -> None:
    """A ``preprocessor_config.json`` field HF refuses or mrv2 does not implement is named."""
    with pytest.raises(ValueError, match=f"preprocessor_config.json {match}"):
        ImageSettings.from_config({**IMAGE_PREPROCESSOR, field: value})


def test_mismatched_checkpoint_refuses_images(setup: tuple[Path, Any, Any, LLM],
                                              tmp_path: Path) -> None:
    """Tiles of another size than the tower's, a tokenizer whose ``<|patch|>`` is not the
    config's ``image_token_index``, or no tokenizer: images refused naming why, text prompts
    pass; vision configs HF's model can't run are refused naming the field."""
    path, _, tokenizer, _ = setup
    config = transformers.AutoConfig.from_pretrained(path)
    image = int(tokenizer.convert_tokens_to_ids("<|image|>"))
    picture = random_image(16, 16, seed=0)
    save_tiny_llama4_images(tmp_path, preprocessor={**IMAGE_PREPROCESSOR,
                                                    "size": {"height": 28, "width": 28}})
    other = transformers.AutoConfig.from_pretrained(tmp_path)
    moved = transformers.AutoConfig.from_pretrained(path)
    moved.image_token_index = 7
    for cfg, tok, match in (
            (other, Tokenizer(tmp_path), "size = 28 x 28: .*vision_config.image_size = 56"),
            (moved, Tokenizer(path), r"<\|patch\|> is id \d+, but config.json "
                                     "image_token_index is 7"),
            (config, None, "needs the checkpoint's tokenizer")):
        mine = Llama4InputProcessor(str(tmp_path), cfg, tok, EngineConfig())
        assert mine.process([5, 6], {}) == ([5, 6], [])
        with pytest.raises(ValueError, match=f"multi_modal_data.image: .*{match}"):
            mine.process([5, image], {"image": [picture]})
    for field, value, match in (("pixel_shuffle_ratio", 0.3, "must be 1 / k"),
                                ("intermediate_size", 64, "hidden_size / pixel_shuffle_ratio"),
                                ("num_attention_heads", 16, "multiple of 4")):
        bad = transformers.AutoConfig.from_pretrained(path)
        object.__setattr__(bad.vision_config, field, value)
        with pytest.raises(ValueError, match=f"vision_config.{field}.*{match}"):
            Llama4VisionEncoder(bad)
