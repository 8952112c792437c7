"""Idefics3 (``Idefics3ForConditionalGeneration``) and SmolVLM
(``SmolVLMForConditionalGeneration``) through the engine against HF transformers: the prompt
expanded as HF's processors expand it (split images with their ``<row_r_col_c>`` tiles and
the global image, and unsplit ones); greedy tokens, the encoder cache on a second round and
every prompt position's log-probability with two images in a prompt, an image shared between
requests and a text prompt beside them, chunked prefill splitting images across steps;
checkpoint names; bad input, video and unsupported configs refused by name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers.models.idefics3.image_processing_pil_idefics3 import (
    Idefics3ImageProcessorPil,
)
from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

from mrv2 import LLM, SamplingParams
from mrv2.config import EngineConfig
from mrv2.engine.tokenizer import Tokenizer
from mrv2.model_loader import iter_safetensors, load_model_weights
from mrv2.testing import make_tiny_tokenizer, random_image, redraw_weights
from mrv2.testing_engine import check_images_against_hf
from mrv2_idefics3.inputs import Idefics3InputProcessor, image_prompt, layout_length
from mrv2_idefics3.model import (
    Idefics3ForConditionalGeneration,
    SmolVLMForConditionalGeneration,
)

ROW_COL = tuple(f"<row_{r + 1}_col_{c + 1}>" for r in range(6) for c in range(6))
SPECIAL = ("<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
           "<video>", *ROW_COL)
#: arch -> (config class, vision overrides, scale_factor, image processor class, its sizes,
#: tied LM head): Idefics3's tiles of 16 (up to 3 x 3), SmolVLM's of 32 (up to 2 x 2), 4
#: image tokens a tile for both.
ARCHS: dict[str, tuple[Any, dict[str, Any], int, Any, dict[str, Any], bool]] = {
    "idefics3": (transformers.Idefics3Config, {"image_size": 16}, 2, Idefics3ImageProcessorPil,
                 {"size": {"longest_edge": 48}, "max_image_size": {"longest_edge": 16}}, False),
    "smolvlm": (transformers.SmolVLMConfig, {"image_size": 32}, 4, SmolVLMImageProcessorPil,
                {"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32}}, True),
}
SEQ = 4  # image tokens a tile


def _checkpoint(path: Path, arch: str) -> tuple[Any, Any, int]:
    """A tiny checkpoint with its tokenizer (the layout tokens special), image processor and
    ``processor_config.json``; HF's model, the image processor and the ``<image>`` id."""
    cls, vision, scale, processor_cls, sizes, tied = ARCHS[arch]
    make_tiny_tokenizer(path, vocab_size=300, special_tokens=SPECIAL)
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(path))
    image = int(tokenizer.convert_tokens_to_ids("<image>"))
    config = cls(
        text_config={"model_type": "llama", "vocab_size": len(tokenizer) + 8, "hidden_size": 64,
                     "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "max_position_embeddings": 1024},
        vision_config={"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "patch_size": 4, **vision},
        scale_factor=scale, image_token_id=image, tie_word_embeddings=tied,
        pad_token_id=None)
    name = ("SmolVLMForConditionalGeneration" if arch == "smolvlm"
            else "Idefics3ForConditionalGeneration")
    config.architectures = [name]
    torch.manual_seed(0)
    hf = getattr(transformers, name)(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(path)
    processor = processor_cls(**sizes)
    processor.save_pretrained(path)
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": SEQ}))
    return hf, processor, image


@pytest.fixture(scope="module", params=sorted(ARCHS))
def setup(request: Any, tmp_path_factory: Any) -> Iterator[tuple[str, Path, Any, Any, int, LLM]]:
    """Per architecture: its checkpoint, HF's model, image processor and ``<image>`` id, and
    an engine whose steps (16 tokens) split images."""
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    hf, processor, image = _checkpoint(path, arch)
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4,
              max_num_batched_tokens=16)
    yield arch, path, hf, processor, image, llm
    llm.shutdown()


def _processor_at(path: Path) -> Idefics3InputProcessor:
    config = transformers.AutoConfig.from_pretrained(path)
    return Idefics3InputProcessor(str(path), config, Tokenizer(path), EngineConfig())


@pytest.mark.parametrize("split", [True, False], ids=["split", "unsplit"])
def test_prompt_expanded_as_hf_processor(setup: Any, tmp_path: Path, split: bool) -> None:
    """The token ids and pixels equal HF's ``Idefics3Processor``'s for a text with two images
    (``do_image_splitting`` on: tiles of each image's own rows x cols, and off: the global
    image alone); each item spans its layout, first to last ``<fake_token_around_image>``."""
    arch, path, _, processor, image, _ = setup
    if not split:
        path = Path(shutil.copytree(path, tmp_path / "unsplit"))
        processor = type(processor)(**{**processor.to_dict(), "do_image_splitting": False})
        processor.save_pretrained(path)
    tokenizer: Any = transformers.AutoTokenizer.from_pretrained(str(path))
    hf_processor = transformers.Idefics3Processor(image_processor=processor,
                                                  tokenizer=tokenizer, image_seq_len=SEQ)
    text = "Hello <image> world, and<image>!"
    images = [random_image(40, 20, seed=1), random_image(10, 12, seed=2)]
    want = hf_processor(text=text, images=images, return_tensors="pt")
    mine = _processor_at(path)
    ids, items = mine.process(tokenizer(text, add_special_tokens=False)["input_ids"],
                              {"image": images})
    assert ids == [int(t) for t in want["input_ids"][0]]
    fake = tokenizer.convert_tokens_to_ids("<fake_token_around_image>")
    tiles = [item.data["pixel_values"].shape[0] for item in items]
    assert tiles == ([7, 10] if arch == "idefics3" else [3, 5]) if split else [1, 1]
    assert ids.count(image) == SEQ * sum(tiles)
    torch.testing.assert_close(torch.cat([item.data["pixel_values"] for item in items]),
                               want["pixel_values"][0])
    for item in items:
        span = ids[item.offset:item.offset + item.length]
        assert span == item.data["token_ids"] and span[0] == span[-1] == fake
    # SmolVLM's processor lays an image out as Idefics3's does (its own function, same text)
    for rows, cols in ((0, 0), (2, 3)):
        theirs = get_image_prompt_string(rows, cols, SEQ, "<fake_token_around_image>",
                                         "<image>", "<global-img>")
        assert image_prompt(rows, cols, SEQ) == theirs
        assert len(tokenizer(theirs, add_special_tokens=False)["input_ids"]) <= \
            layout_length(rows, cols, SEQ)


def _hf_inputs(processor: Any) -> Any:
    def inputs(ids: list[int], items: list[Any], images: list[Any]) -> dict[str, Any]:
        if not images:
            return {}
        out = processor(images=[images], return_tensors="pt")
        return {"pixel_values": out["pixel_values"],
                "pixel_attention_mask": out["pixel_attention_mask"]}
    return inputs


def test_tokens_and_logprobs_match_hf(setup: Any) -> None:
    """Greedy tokens equal HF's ``generate``; image ``a`` runs the encoder once for both
    requests, across steps, and no more on a second round; the prompt's log-probabilities
    equal HF's forward's."""
    _, _, hf, processor, image, llm = setup
    a, b = random_image(40, 20, seed=1), random_image(24, 30, seed=2)
    prompts: list[tuple[list[int], list[Any]]] = [
        ([5, 17, 42, image, 100, 3], [a]), ([image, 64, 8, image, 50], [b, a]),
        ([3, 4, 5, 6], [])]
    expanded = check_images_against_hf(llm, hf, prompts, _hf_inputs(processor), max_tokens=6,
                                       encoder_runs=2, logprobs_of=1)
    for ids, items in expanded[:2]:
        assert all(item.length > 16 for item in items)  # (each split across steps)
        assert ids.count(image) == SEQ * sum(i.data["pixel_values"].shape[0] for i in items)


def test_checkpoint_names(setup: Any) -> None:
    """The saved names and HF's in-memory ones load every parameter."""
    _, path, hf, _, _, _ = setup
    config = transformers.AutoConfig.from_pretrained(path)
    for weights in (iter_safetensors(path), hf.state_dict().items()):
        model = (SmolVLMForConditionalGeneration if "SmolVLM" in type(hf).__name__
                 else Idefics3ForConditionalGeneration)(config)
        loaded = load_model_weights(model, weights)
        assert loaded >= {name for name, _ in model.named_parameters()}


def test_bad_input_refused(setup: Any) -> None:
    """Image counts that do not fit, video (a key or a ``<video>`` token) refused by name,
    nothing queued; a text decoder or tower not built here refused naming the field."""
    _, path, _, _, image, llm = setup
    video = int(llm.engine.input_processor.video_token)
    picture = random_image(16, 16, seed=0)
    params = SamplingParams(max_tokens=2)
    for prompt, mm_data, match in (
            ([5, image], {"image": [picture, picture]}, "2 images but the prompt has 1"),
            ([5, image, image], {"image": [picture]}, "1 images but the prompt has 2"),
            ([5, image], {"video": [picture]}, r"unsupported keys \['video'\].*images only"),
            ([video, image], {"image": [picture]}, "holds <video>.*images only"),
            ([image] * 5, {"image": [picture] * 5}, "5 images; at most 4")):
        with pytest.raises(ValueError, match=match):
            llm.generate([{"prompt_token_ids": prompt, "multi_modal_data": mm_data}],
                         params, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    config = transformers.AutoConfig.from_pretrained(path)
    object.__setattr__(config.text_config, "model_type", "mistral")
    with pytest.raises(ValueError, match="text_config.model_type = 'mistral' is not supp"):
        Idefics3ForConditionalGeneration(config)
    config = transformers.AutoConfig.from_pretrained(path)
    object.__setattr__(config.vision_config, "model_type", "siglip_vision_model")
    with pytest.raises(ValueError, match="vision_config.model_type = 'siglip_vision_model'"):
        Idefics3ForConditionalGeneration(config)


def test_mismatched_processor_refuses_images(setup: Any, tmp_path: Path) -> None:
    """A ``processor_config.json`` whose ``image_seq_len`` the tiles do not give, or tiles
    the pixel shuffle can't fold: images refused naming the field, text prompts still run."""
    _, path, _, processor, image, _ = setup
    path = Path(shutil.copytree(path, tmp_path / "bad"))
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": 9}))
    mine = _processor_at(path)
    assert mine.process([5, 6], {}) == ([5, 6], [])
    with pytest.raises(ValueError, match="processor_config.json image_seq_len=9"):
        mine.process([5, image], {"image": [random_image(16, 16, seed=0)]})
    (path / "processor_config.json").unlink()
    type(processor)(**{**processor.to_dict(), "max_image_size": {"longest_edge": 20}}
                    ).save_pretrained(path)
    with pytest.raises(ValueError, match="max_image_size.longest_edge"):
        _processor_at(path).process([image], {"image": [random_image(16, 16, seed=0)]})


def test_profile_encoder_runs_the_largest_image(setup: Any, monkeypatch: Any) -> None:
    """The profile runs the encoder over the most tiles an image may have (``size`` over
    ``max_image_size`` per side, squared, plus the global image), fewer where the layout would
    not fit the prompt budget, none where even an unsplit image would not."""
    arch, _, _, _, _, llm = setup
    state = llm.engine.runner.model_state
    model = llm.engine.runner.model
    seen: list[tuple[int, ...]] = []
    monkeypatch.setattr(model, "embed_image", lambda pixels: seen.append(tuple(pixels.shape)))
    side = 16 if arch == "idefics3" else 32
    most = 10 if arch == "idefics3" else 5
    for budget in (10_000, 20, 5):
        assert state.profile_encoder(budget) == state.encoder_cache_bytes
    assert seen == [(most, 3, side, side), (1, 3, side, side)]
