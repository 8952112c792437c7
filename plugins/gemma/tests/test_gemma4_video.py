"""Gemma 4 videos (decoded frames; ``Gemma4ForConditionalGeneration``) through ``LLM`` against
HF transformers on the tiny random checkpoint (CPU, fp32): the expanded prompt ids, token types
and video rows equal HF's own ``Gemma4Processor``'s (per frame its ``mm:ss`` timestamp,
``<boi>``, its video tokens, ``<eoi>``, joined by spaces; HF's fps default of 24 and a given
fps), greedy tokens equal HF ``generate``'s and every prompt position's log-probability HF's
forward (one video; a video and an image); the encoder cache keyed by frame content; bad
videos refused naming the field before anything is queued.

HF's ``Gemma4VideoProcessor`` needs torchvision (its module does not even import without it),
which the CPU CI lacks. HF's ``Gemma4Processor`` runs here with a stand-in video processor that
builds ``pixel_values_videos`` / ``video_position_ids`` / ``num_soft_tokens_per_video`` in plain
torch following ``Gemma4VideoProcessor._preprocess`` (frames whose size its
aspect-ratio-preserving resize keeps, so no resize filter is involved; the fused rescale and
normalize; patches; padding to ``max_soft_tokens * pooling_kernel_size**2`` rows at positions
``(-1, -1)``) and the metadata HF's ``make_batched_metadata`` makes (frames as given,
``do_sample_frames=False``); its class check is skipped, and ``processing_gemma4`` is imported
with the PIL image processor's module standing in for the torchvision one's (it takes two
names from it, the same code in both). The tiny tokenizer is given the attributes
(``image_token``, ``boi_token`` ...) a Gemma 4 tokenizer carries."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from mrv2 import LLM, SamplingParams
from mrv2.testing import random_image
from mrv2.testing_engine import check_bad_videos, check_prompt_logprobs
from mrv2_gemma.gemma4_video import DEFAULT_FPS, frame_prefixes, timestamp
from mrv2_gemma.testing import AUDIO_SPECIAL
from mrv2_gemma.testing import TinyGemma4Audio as Tiny

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
#: The checkpoint's video processor section (a normalization that is not the identity, so the
#: settings matter; 70 soft tokens of 2 x 2 pooled 4-pixel patches a frame).
VIDEO = {"patch_size": 4, "max_soft_tokens": 70, "pooling_kernel_size": 2, "do_resize": True,
         "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
         "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.3, 0.4]}


def _frames(count: int, height: int, width: int, seed: int) -> np.ndarray:
    """``[count, height, width, 3]`` random uint8 frames."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (count, height, width, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    tiny = Tiny(tmp_path_factory.mktemp("gemma4_video"))
    config_path = tiny.path / "processor_config.json"
    config = json.loads(config_path.read_text())
    config["video_processor"] = {"video_processor_type": "Gemma4VideoProcessor", **VIDEO}
    config_path.write_text(json.dumps(config))
    return tiny


@pytest.fixture(scope="module")
def llm(tiny: Tiny) -> LLM:
    return LLM(str(tiny.path), device="cpu", dtype="float32", block_size=4,
               max_num_batched_tokens=160, limit_mm_per_prompt=2)


class _HFVideoProcessor:
    """``Gemma4VideoProcessor`` in plain torch (module doc)."""

    def __call__(self, videos: Any, video_metadata: Any = None, **kwargs: Any) -> Any:
        from transformers.models.gemma4.image_processing_pil_gemma4 import (
            get_aspect_ratio_preserving_size,
        )
        from transformers.video_utils import make_batched_metadata, make_batched_videos

        videos = make_batched_videos(videos)
        metadata = make_batched_metadata(videos, video_metadata=video_metadata)
        p, k = VIDEO["patch_size"], VIDEO["pooling_kernel_size"]
        max_patches = VIDEO["max_soft_tokens"] * k * k
        pixels, positions, counts = [], [], []
        for clip in videos:
            video = torch.from_numpy(np.asarray(clip)).permute(0, 3, 1, 2).contiguous()
            t, c, h, w = video.shape
            assert get_aspect_ratio_preserving_size(h, w, p, max_patches, k) == (h, w)
            mean = torch.tensor(VIDEO["image_mean"]) * (1.0 / VIDEO["rescale_factor"])
            std = torch.tensor(VIDEO["image_std"]) * (1.0 / VIDEO["rescale_factor"])
            video = (video.to(torch.float32) - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
            ph, pw = h // p, w // p
            patches = video.reshape(t, c, ph, p, pw, p).permute(0, 2, 4, 3, 5, 1)
            patches = patches.reshape(t, ph * pw, -1)
            counts.append(patches.shape[1] // k**2)
            grid = torch.stack(torch.meshgrid(torch.arange(pw), torch.arange(ph), indexing="xy"),
                               dim=-1).reshape(ph * pw, 2)[None].repeat(t, 1, 1)
            pad = max_patches - patches.shape[1]
            pixels.append(torch.nn.functional.pad(patches, [0, 0, 0, pad, 0, 0]))
            positions.append(torch.nn.functional.pad(grid, (0, 0, 0, pad, 0, 0), value=-1))
        return transformers.BatchFeature({
            "pixel_values_videos": torch.stack(pixels),
            "video_position_ids": torch.stack(positions),
            "num_soft_tokens_per_video": counts, "video_metadata": metadata})


@pytest.fixture(scope="module")
def hf_processor(tiny: Tiny) -> Any:
    """HF's own ``Gemma4Processor`` of the checkpoint (module doc)."""
    tok: Any = transformers.AutoTokenizer.from_pretrained(str(tiny.path))
    image, boi, eoi, _, audio, boa, eoa = AUDIO_SPECIAL
    for name, value in [("image_token", image), ("boi_token", boi), ("eoi_token", eoi),
                        ("audio_token", audio), ("boa_token", boa), ("eoa_token", eoa)]:
        setattr(tok, name, value)
    tok.image_token_id = tok.convert_tokens_to_ids(image)
    tok.audio_token_id = tok.convert_tokens_to_ids(audio)
    with pytest.MonkeyPatch.context() as patch:
        # (processing_gemma4 imports two names of the torchvision image processor's module:
        # the PIL one's, the same code, stand in while it is imported)
        from transformers.models.gemma4 import image_processing_pil_gemma4 as pil

        patch.setitem(sys.modules, "transformers.models.gemma4.image_processing_gemma4", pil)
        from transformers.models.gemma4.processing_gemma4 import Gemma4Processor
    check = transformers.ProcessorMixin.check_argument_for_proper_class
    transformers.ProcessorMixin.check_argument_for_proper_class = (  # type: ignore[method-assign]
        lambda *args: None)
    try:
        return Gemma4Processor(
            feature_extractor=tiny.extractor,
            image_processor=transformers.Gemma4ImageProcessorPil.from_pretrained(tiny.path),
            tokenizer=tok, video_processor=_HFVideoProcessor())
    finally:
        transformers.ProcessorMixin.check_argument_for_proper_class = (  # type: ignore
            check)


# Each case: the prompt text, its video (frames, fps or None: the default) and images.
CASES: dict[str, Any] = {
    # 3 frames of 56 x 80 (70 tokens each) at HF's default 24 fps: all at 00:00
    "one_video": lambda: ("<|user|>Describe<|video|> it</s><|assistant|>",
                          (_frames(3, 56, 80, 0), None), []),
    # 2 PIL frames of 80 x 56 at 0.5 fps (00:00, 00:02), then an image
    "video_and_image": lambda: (
        "<|user|>A<|video|> then<|image|>!</s><|assistant|>",
        ([Image.fromarray(f) for f in _frames(2, 80, 56, 1)], 0.5), [random_image(40, 48, 2)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_video_matches_hf(tiny: Tiny, llm: LLM, hf_processor: Any, case: str) -> None:
    """The expanded ids, token types and frame rows HF's processor's; greedy tokens HF
    ``generate``'s; one encoder run per frame and image, none on a second round; every prompt
    position's log-probability HF's forward's."""
    text, (clip, fps), images = CASES[case]()
    frames = np.stack([np.asarray(f) for f in clip]) if isinstance(clip, list) else clip
    kwargs: dict[str, Any] = {}
    if fps is not None:
        kwargs["video_metadata"] = [{"total_num_frames": len(frames), "fps": fps,
                                     "frames_indices": list(range(len(frames)))}]
    hf_in = hf_processor(text=[text], videos=[frames], images=[images] if images else None,
                         return_tensors="pt", padding=False, **kwargs)
    prompt = list(hf_processor.tokenizer(text)["input_ids"])
    data: dict[str, Any] = {"video": clip if fps is None else (clip, {"fps": fps})}
    if images:
        data["image"] = images
    processor = llm.engine.input_processor
    assert processor is not None
    ids, items = processor.process(prompt, data)
    assert ids == hf_in["input_ids"][0].tolist()
    video = [i for i in items if i.kind == "video"]
    assert len(video) == len(frames) and all(i.bidirectional for i in items)
    real = hf_in["video_position_ids"][0, :, :, 0] >= 0
    for n, item in enumerate(video):
        assert torch.equal(item.data["position_ids"], hf_in["video_position_ids"][0, n][real[n]])
        torch.testing.assert_close(item.data["pixel_values"],
                                   hf_in["pixel_values_videos"][0, n][real[n]], rtol=0, atol=1e-6)
    seconds = [n / (fps or DEFAULT_FPS) for n in range(len(frames))]
    decoded = hf_processor.tokenizer.decode(ids)
    assert [m for m in re.findall(r"\d\d:\d\d", decoded)] == [timestamp(s) for s in seconds]
    hf_inputs = {k: v for k, v in hf_in.items() if k not in ("input_ids", "attention_mask")}
    row = torch.tensor([ids])
    want_types = (row == tiny.image).long() + 2 * (row == llm.engine.input_processor.video_token
                                                   ).long()
    assert torch.equal(hf_in["mm_token_type_ids"], want_types)
    tiny.hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = tiny.hf.generate(row, attention_mask=torch.ones_like(row), max_new_tokens=6,
                               do_sample=False, **hf_inputs)
    want = out[0, len(ids):].tolist()
    request = {"prompt_token_ids": prompt, "multi_modal_data": data}
    state = llm.engine.runner.model_state
    before = state.encoder_runs
    got = llm.generate([request], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert list(got) == want
    assert state.encoder_runs - before == len(items)
    again = llm.generate([request], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert list(again) == want and state.encoder_runs - before == len(items)
    with torch.no_grad():
        logits = tiny.hf(row, **hf_inputs).logits
    check_prompt_logprobs(llm, request, ids, logits[0], atol=1e-4)


def test_frame_layout_and_resize(llm: LLM) -> None:
    """The text around frames (HF's ``mm:ss``: minutes past an hour, truncated seconds); a clip
    whose size the processor changes is resized to HF's aspect-preserving size (its soft
    tokens the image processor's count for that size at the video's budget)."""
    assert frame_prefixes(3, 0.4) == ["00:00 ", " 00:02 ", " 00:05 "]
    assert timestamp(3725.9) == "62:05" and timestamp(59.99) == "00:59"
    processor: Any = llm.engine.input_processor
    boi, eoi, video = processor.boi, processor.eoi, processor.video_token
    clip = torch.from_numpy(_frames(2, 30, 44, 3)).permute(0, 3, 1, 2)  # (a torch clip)
    ids, items = processor.process([5, video, 9], {"video": clip})
    image = transformers.Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70,
                                                 pooling_kernel_size=2)
    count = image([Image.fromarray(_frames(1, 30, 44, 3)[0])])["num_soft_tokens_per_image"][0]
    assert [i.length for i in items] == [count, count] and count < 70
    tokenizer = processor.tokenizer
    stamp0 = tokenizer.encode("00:00 ", add_special_tokens=False)
    stamp1 = tokenizer.encode(" 00:00 ", add_special_tokens=False)
    assert ids == [5, *stamp0, boi, *[video] * count, eoi, *stamp1, boi, *[video] * count, eoi,
                   9]
    assert items[0].offset == 1 + len(stamp0) + 1


def test_encoder_cache_keys_frames_by_content(tiny: Tiny, llm: LLM) -> None:
    """The same clip again (a copy, another prompt) runs no encoder; a clip with one frame
    changed runs it once; the same frames at another fps run none (only the timestamps
    differ), and several clips in one prompt; chunked prefill (steps of at most 76 tokens, a
    frame's 72 never split) gives the whole-prompt tokens."""
    processor: Any = llm.engine.input_processor
    video = processor.video_token
    clip = _frames(2, 56, 80, 7)
    other = clip.copy()
    other[1, 0, 0, 0] ^= 1

    def request(value: Any, head: int = 5, videos: int = 1) -> dict[str, Any]:
        return {"prompt_token_ids": [head, *[video, 9] * videos],
                "multi_modal_data": {"video": value}}

    state = llm.engine.runner.model_state
    start = state.encoder_runs
    first = llm.generate([request(clip)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert state.encoder_runs - start == 2
    again = llm.generate([request(clip.copy(), head=6), request(clip)], GREEDY, use_tqdm=False)
    assert state.encoder_runs - start == 2 and again[1].outputs[0].token_ids == first
    llm.generate([request(other)], GREEDY, use_tqdm=False)
    assert state.encoder_runs - start == 3
    llm.generate([request((clip, {"fps": 1.0}))], GREEDY, use_tqdm=False)
    both = llm.generate([request([clip, (other, {"fps": 2})], videos=2)], GREEDY,
                        use_tqdm=False)[0].outputs[0].token_ids
    assert state.encoder_runs - start == 3
    chunked = LLM(str(tiny.path), device="cpu", dtype="float32", block_size=4,
                  max_num_batched_tokens=76, limit_mm_per_prompt=2, enable_prefix_caching=False)
    assert chunked.generate([request(clip), request([clip, (other, {"fps": 2})], videos=2)],
                            GREEDY, use_tqdm=False)[0].outputs[0].token_ids == first
    assert chunked.generate([request([clip, (other, {"fps": 2})], videos=2)], GREEDY,
                            use_tqdm=False)[0].outputs[0].token_ids == both


def test_bad_videos_name_the_field(llm: LLM) -> None:
    """Wrong ndim, dtype, channel count, no frames, a bad fps, more videos than placeholders
    or than ``--limit-mm-per-prompt``, frames of different sizes, video settings the tower
    can't take: a ValueError naming ``multi_modal_data.video`` before any request of the batch
    is queued."""
    processor: Any = llm.engine.input_processor
    ids = [5, processor.video_token, 9]
    good = _frames(2, 56, 80, 0)
    check_bad_videos(llm, ids, good, [
        ([good[0], good[1, :8]], r"multi_modal_data\.video\[0\]\[1\]: frame of shape"),
        ([good] * 3, r"multi_modal_data\.video: 3 videos; at most 2 per prompt"),
    ])
    saved = processor.video_settings  # (video settings the tower can't take)
    processor.video_settings = dataclasses.replace(saved, patch_size=8)
    try:
        with pytest.raises(ValueError, match=r"multi_modal_data\.video: the checkpoint's video "
                                             r"processor cuts \(patch_size, pooling_kernel_size\) "
                                             r"= \(8, 2\), its vision tower takes \(4, 2\)"):
            processor.process(ids, {"video": good})
    finally:
        processor.video_settings = saved


def test_video_settings_fall_back(tmp_path: Path) -> None:
    """Without a ``video_processor`` section, ``video_preprocessor_config.json``, else
    ``preprocessor_config.json``, over ``Gemma4VideoProcessor``'s defaults."""
    from mrv2_gemma.gemma4_video import Gemma4VideoSettings

    assert Gemma4VideoSettings.load(tmp_path) == Gemma4VideoSettings()
    assert Gemma4VideoSettings().max_soft_tokens == 70
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"patch_size": 4, "max_soft_tokens": 280, "do_normalize": False}))
    loaded = Gemma4VideoSettings.load(tmp_path)
    assert (loaded.patch_size, loaded.max_soft_tokens, loaded.do_normalize) == (4, 280, False)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"patch_size": 8}))
    assert Gemma4VideoSettings.load(tmp_path).patch_size == 8
    # a size HF's processors refuse, refused alike (naming the field and the allowed values)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 100}))
    with pytest.raises(ValueError, match=r"max_soft_tokens must be one of \(70, 140, 280, 560, "
                                         r"1120\), got 100"):
        Gemma4VideoSettings.load(tmp_path)
