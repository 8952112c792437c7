"""Qwen2-VL and Qwen2.5-VL videos (decoded frames) through ``LLM`` against HF transformers on
the tiny random checkpoints (CPU, fp32): greedy tokens and every prompt position's
log-probability with one video, an image and a video, a video of an odd frame count (its last
frame repeated) at another fps; the M-RoPE positions of video tokens against HF's
``get_rope_index``; the encoder cache keyed by a video's content; bad videos refused naming the
field before anything runs. Qwen3-VL and Qwen3-VL-MoE (timestamp text between frame groups):
the expanded prompt ids and video rows equal HF's own ``Qwen3VLProcessor``'s, greedy tokens HF
``generate``'s, prompt log-probabilities and positions HF's; the encoder cache keyed by frame
group content; bad clips refused.

HF's video processor needs torchvision, which the CPU CI lacks: HF's video inputs
(``pixel_values_videos``, ``video_grid_thw``, ``second_per_grid_ts``) are built here in plain
torch following ``Qwen2VLVideoProcessor`` (rescale, normalize, ``patchify``: frames padded with
the last one to a multiple of ``temporal_patch_size``) and ``Qwen2_5_VLProcessor``
(``second_per_grid_ts = temporal_patch_size / fps``), at frame sizes that ``smart_resize``
keeps as they are (so no resize filter is involved). For Qwen3-VL, HF's own processor runs
(frames as given, ``do_sample_frames=False``, the fps in ``video_metadata``) with two shims for
the missing torchvision: its class check skipped and its ``normalize`` in plain torch
(``(x - mean) / std``, what torchvision's does); ``do_convert_rgb`` and ``do_resize`` off (RGB
frames whose size its ``smart_resize`` keeps)."""

from __future__ import annotations

import json
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from mrv2 import LLM, SamplingParams
from mrv2.testing_engine import check_bad_videos, check_prompt_logprobs
from mrv2_qwen_vl.mrope import ImageGrid, MRopeTable, mrope_positions, mrope_positions_ref
from mrv2_qwen_vl.testing import (
    END,
    IMAGE,
    START,
    VIDEO,
    make_tiny_qwen2_vl,
    make_tiny_qwen3_vl,
    make_tiny_qwen_vl,
    random_image,
)
from mrv2_qwen_vl.video_qwen3 import Qwen3VideoSettings, frame_group_times, resize_clip

#: family -> (tiny checkpoint builder, HF model class); Qwen2.5-VL with the released models'
#: ``tokens_per_second`` (2: at 2 fps a frame group advances the temporal position by 2)
FAMILIES: dict[str, tuple[Callable[[Path], Path], Any]] = {
    "qwen2_vl": (make_tiny_qwen2_vl, transformers.Qwen2VLForConditionalGeneration),
    "qwen2_5_vl": (lambda path: make_tiny_qwen_vl(path, vision={"tokens_per_second": 2}),
                   transformers.Qwen2_5_VLForConditionalGeneration),
}
#: Qwen3-VL's families (builder, HF model class)
QWEN3: dict[str, tuple[Callable[[Path], Path], Any]] = {
    "qwen3_vl": (make_tiny_qwen3_vl, transformers.Qwen3VLForConditionalGeneration),
    "qwen3_vl_moe": (lambda path: make_tiny_qwen3_vl(path, moe=True),
                     transformers.Qwen3VLMoeForConditionalGeneration),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _frames(count: int, height: int, width: int, seed: int) -> np.ndarray:
    """``[count, height, width, 3]`` random uint8 frames."""
    return np.random.default_rng(seed).integers(0, 256, (count, height, width, 3),
                                                dtype=np.uint8)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = {**FAMILIES, **QWEN3}[family][0](tmp_path_factory.mktemp(family))
        return built[family]

    return get


@pytest.fixture(scope="module")
def hf_models(checkpoints: Callable[[str], Path]) -> Callable[[str], Any]:
    loaded: dict[str, Any] = {}

    def get(family: str) -> Any:
        if family not in loaded:
            model = {**FAMILIES, **QWEN3}[family][1].from_pretrained(checkpoints(family)).eval()
            model.generation_config.eos_token_id = None  # (as ignore_eos)
            loaded[family] = model
        return loaded[family]

    return get


def _llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, **kwargs)


def _hf_video(frames: np.ndarray, settings: dict[str, Any]) -> tuple[torch.Tensor, list[int]]:
    """HF ``Qwen2VLVideoProcessor``'s rows and grid of one clip whose frame size
    ``smart_resize`` keeps (its rescale, normalize and ``patchify``, in plain torch)."""
    video = torch.from_numpy(np.array(frames)).permute(0, 3, 1, 2).float()[None]  # [1, T, C, H, W]
    mean = torch.tensor(settings["image_mean"]).view(1, 1, 3, 1, 1)
    std = torch.tensor(settings["image_std"]).view(1, 1, 3, 1, 1)
    video = (video * settings["rescale_factor"] - mean) / std
    patch, merge = settings["patch_size"], settings["merge_size"]
    temporal = settings["temporal_patch_size"]
    batch, num_frames, channel, height, width = video.shape
    if pad := -num_frames % temporal:
        video = torch.cat((video, video[:, -1:].expand(-1, pad, -1, -1, -1)), dim=1)
        num_frames += pad
    grid_t, grid_h, grid_w = num_frames // temporal, height // patch, width // patch
    patches = video.view(batch, grid_t, temporal, channel, grid_h // merge, merge, patch,
                         grid_w // merge, merge, patch)
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    rows = patches.reshape(grid_t * grid_h * grid_w, channel * temporal * patch * patch)
    return rows, [grid_t, grid_h, grid_w]


def _hf_image(image: Image.Image, settings: dict[str, Any]) -> tuple[torch.Tensor, list[int]]:
    """An image's rows and grid (an image is a clip of one frame, repeated)."""
    return _hf_video(np.asarray(image)[None], settings)


# Each case: the prompt's parts (token lists, ("video", clip, fps or None), ("image", image)).
# The shapes keep each video's frame groups' positions below max(h', w') (merged), where HF
# 5.17's text-after-a-video positions agree with the original rule (mrv2_qwen_vl.mrope).
CASES: dict[str, Callable[[], list[Any]]] = {
    # 4 frames of 84 x 84: t = 2 frame groups of 3 x 3 merged tokens (a numpy clip)
    "one_video": lambda: [[5, 17], ("video", _frames(4, 84, 84, 0), None), [42, 9, 100]],
    # a video (a list of PIL frames, 3 x 4 merged) before an image, text between and after
    "image_and_video": lambda: [
        [3], ("video", [Image.fromarray(f) for f in _frames(4, 84, 112, 1)], None),
        [8, 120, 7], ("image", random_image(84, 56, 2)), [33, 4]],
    # 3 frames (the last repeated: t = 2), a torch [T, 3, H, W] clip sampled at 1 fps
    # (Qwen2.5-VL: its second frame group 4 positions on)
    "odd_frames": lambda: [
        [11], ("video", torch.from_numpy(_frames(3, 140, 56, 3)).permute(0, 3, 1, 2), 1.0),
        [60, 2]],
}


def _as_numpy(clip: Any) -> np.ndarray:
    if isinstance(clip, torch.Tensor):
        return clip.permute(0, 2, 3, 1).numpy()
    if isinstance(clip, list):
        return np.stack([np.asarray(frame) for frame in clip])
    return np.asarray(clip)


def _build(parts: list[Any], family: str, settings: dict[str, Any]
           ) -> tuple[dict[str, Any], list[int], dict[str, Any]]:
    """``(the engine's request, HF's expanded prompt ids, HF's extra inputs)``."""
    ids: list[int] = []
    hf_ids: list[int] = []
    images, videos, video_rows, video_grids, seconds = [], [], [], [], []
    image_rows, image_grids = [], []
    merge = settings["merge_size"] ** 2
    for part in parts:
        if isinstance(part, list):
            ids += part
            hf_ids += part
        elif part[0] == "image":
            ids += [START, IMAGE, END]
            images.append(part[1])
            rows, grid = _hf_image(part[1], settings)
            image_rows.append(rows)
            image_grids.append([1, *grid[1:]])
            hf_ids += [START, *[IMAGE] * (grid[1] * grid[2] // merge), END]
        else:
            _, clip, fps = part
            ids += [START, VIDEO, END]
            videos.append(clip if fps is None else (clip, {"fps": fps}))
            rows, grid = _hf_video(_as_numpy(clip), settings)
            video_rows.append(rows)
            video_grids.append(grid)
            seconds.append(settings["temporal_patch_size"] / (fps or 2.0))
            hf_ids += [START, *[VIDEO] * (grid[0] * grid[1] * grid[2] // merge), END]
    mm: dict[str, Any] = {"video": videos}
    if images:
        mm["image"] = images
    kwargs: dict[str, Any] = {"pixel_values_videos": torch.cat(video_rows),
                              "video_grid_thw": torch.tensor(video_grids)}
    if images:
        kwargs["pixel_values"] = torch.cat(image_rows)
        kwargs["image_grid_thw"] = torch.tensor(image_grids)
    if family == "qwen2_5_vl":
        kwargs["second_per_grid_ts"] = torch.tensor(seconds)
    return {"prompt_token_ids": ids, "multi_modal_data": mm}, hf_ids, kwargs


def _types(ids: torch.Tensor) -> torch.Tensor:
    return (ids == IMAGE).int() + 2 * (ids == VIDEO).int()


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_video_matches_hf(checkpoints: Callable[[str], Path], hf_models: Callable[[str], Any],
                          family: str, case: str) -> None:
    """The engine's expansion and pixel rows equal HF's inputs; greedy tokens equal HF
    ``generate``'s; every prompt position's log-probability is within 1e-4 of HF's forward
    (video rows, their temporal M-RoPE positions, the text after them)."""
    path = checkpoints(family)
    settings = json.loads((path / "preprocessor_config.json").read_text())
    hf_model = hf_models(family)
    request, hf_ids, kwargs = _build(CASES[case](), family, settings)
    llm = _llm(path)
    processor = llm.engine.input_processor
    assert processor is not None
    ids, items = processor.process(request["prompt_token_ids"], request["multi_modal_data"])
    assert ids == hf_ids
    videos = [item for item in items if item.kind == "video"]
    torch.testing.assert_close(torch.cat([v.data["pixel_values"] for v in videos]),
                               kwargs["pixel_values_videos"], rtol=0, atol=1e-5)
    assert [list(v.data["grid_thw"]) for v in videos] == kwargs["video_grid_thw"].tolist()
    got = llm.generate([request], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    input_ids = torch.tensor([hf_ids])
    with torch.no_grad():
        want = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 mm_token_type_ids=_types(input_ids), max_new_tokens=6,
                                 do_sample=False, **kwargs)
        logits = hf_model(input_ids, mm_token_type_ids=_types(input_ids), **kwargs).logits[0]
    assert got == want[0, len(hf_ids):].tolist()
    check_prompt_logprobs(llm, request, hf_ids, logits)


def test_video_positions() -> None:
    """Video tokens' M-RoPE positions: frame group ``t`` at ``s + int(t * interval)``, the text
    after one past the video's largest position. The reference equals HF's
    ``get_rope_index`` (with ``second_per_grid_ts``) on videos whose frame groups stay below
    ``max(h', w')``, an image between them, and hand-written positions where HF 5.17 differs
    (a video's frame groups reaching further; a fractional interval, truncated after the
    product); the device table equals the reference, decode positions included."""
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf

    config = transformers.Qwen2_5_VLConfig(vision_config={"spatial_merge_size": 2,
                                                          "tokens_per_second": 3})
    seconds = [1.0, 1.0]  # (whole seconds: HF 5.17 truncates them before the product)
    grids = [ImageGrid(2, 3, 7, 1, 3 * seconds[0]), ImageGrid(25, 1, 1, 3),
             ImageGrid(30, 2, 1, 4, 3 * seconds[1])]
    num_tokens = 40
    types_ = torch.zeros(1, num_tokens, dtype=torch.int32)
    for g, kind in zip(grids, [2, 1, 2], strict=True):
        types_[0, g.offset: g.offset + g.length] = kind
    model = types.SimpleNamespace(config=config, get_vision_position_ids=lambda *a, **k: (
        hf.Qwen2_5_VLModel.get_vision_position_ids(None, *a, **k)))

    def thw(gs: list[ImageGrid]) -> torch.Tensor:
        return torch.tensor([[g.t, g.h * 2, g.w * 2] for g in gs])

    want, delta = hf.Qwen2_5_VLModel.get_rope_index(
        model, torch.full((1, num_tokens), 3), types_, image_grid_thw=thw([grids[1]]),
        video_grid_thw=thw([grids[0], grids[2]]), second_per_grid_ts=torch.tensor(seconds))
    ref, shift = mrope_positions_ref(num_tokens, grids)
    assert ref == want[:, 0].tolist() and shift == int(delta)
    assert ref[0][2 + 7] == 2 + 3  # (the second frame group of the first video)
    # frame groups past max(h', w') = 2: the text after resumes at 6 + 1
    further = [ImageGrid(2, 3, 1, 2, 2.0)]
    assert mrope_positions_ref(10, further) == ([[0, 1, 2, 2, 4, 4, 6, 6, 7, 8],
                                                 [0, 1, 2, 2, 2, 2, 2, 2, 7, 8],
                                                 [0, 1, 2, 3, 2, 3, 2, 3, 7, 8]], -1)
    # interval 1.5: groups at int(0), int(1.5), int(3.0); the shift after it is positive
    fractional = [ImageGrid(0, 3, 1, 1, 1.5)]
    assert mrope_positions_ref(5, fractional) == ([[0, 1, 3, 4, 5], [0, 0, 0, 4, 5],
                                                   [0, 0, 0, 4, 5]], 1)
    table = MRopeTable(max_rows=4, max_items=3, device=torch.device("cpu"))
    for row, case in enumerate([grids, further, fractional]):
        table.set_row(row, case)
        n = max(g.offset + g.length for g in case) + 5  # (decode positions past the prompt)
        got = mrope_positions(torch.arange(n), torch.full((n,), row), table)
        assert got.tolist() == mrope_positions_ref(n, case)[0]


def test_encoder_cache_keys_videos_by_content(checkpoints: Callable[[str], Path]) -> None:
    """The same clip again (in another prompt, no prefix cache) runs no encoder and gives the
    same tokens; a different clip of the same shape, or the same one at another fps on
    Qwen2.5-VL (other positions), is a different item; chunked prefill (steps of 4 tokens
    through a video's 8 rows) gives the whole-prompt tokens."""
    path = checkpoints("qwen2_5_vl")
    llm = _llm(path, enable_prefix_caching=False)
    clip, other = _frames(4, 56, 56, 7), _frames(4, 56, 56, 8)

    def request(video: Any, head: int = 5) -> dict[str, Any]:
        return {"prompt_token_ids": [head, START, VIDEO, END, 9],
                "multi_modal_data": {"video": video}}

    state = llm.engine.runner.model_state
    first = llm.generate([request(clip)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert state.encoder_runs == 1
    again = llm.generate([request(clip.copy(), head=6), request(clip)], GREEDY,
                         use_tqdm=False)
    assert state.encoder_runs == 1
    assert again[1].outputs[0].token_ids == first
    different = llm.generate([request(other)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert state.encoder_runs == 2 and different != first
    slower = llm.generate([request((clip, {"fps": 1.0}))], GREEDY, use_tqdm=False)
    assert state.encoder_runs == 3 and len(slower[0].outputs[0].token_ids) == 6
    chunked = _llm(path, enable_prefix_caching=False, max_num_batched_tokens=4)
    assert chunked.generate([request(clip)], GREEDY,
                            use_tqdm=False)[0].outputs[0].token_ids == first


def test_bad_videos_name_the_field(checkpoints: Callable[[str], Path]) -> None:
    """Wrong ndim, dtype, channel count, no frames, a bad fps, more videos than
    placeholders, too many items for ``--limit-mm-per-prompt``: a ValueError naming
    ``multi_modal_data.video`` before any request of the batch is queued."""
    llm = _llm(checkpoints("qwen2_5_vl"), limit_mm_per_prompt=2)
    ids = [5, START, VIDEO, END, 9]
    good = _frames(2, 56, 56, 0)
    check_bad_videos(llm, ids, good, [
        ([good] * 3, r"multi_modal_data: 0 images and 3 videos; at most 2 per prompt"),
    ])


def test_video_takes_the_video_processor_config(tmp_path: Path) -> None:
    """A Qwen2.5-VL checkpoint with a ``video_preprocessor_config.json`` of its own (a smaller
    pixel budget, other normalization): its videos take those settings, as HF 5.17's
    ``Qwen2VLVideoProcessor`` does, its images the image processor's. Frames of 224 x 224 fit
    the image budget but resize to HF ``smart_resize``'s 112 x 112 under the video one; 112 x
    112 frames are kept and normalized with the video config's mean and std (rows HF's);
    ``min_pixels`` / ``max_pixels`` win over ``size`` (HF's ``__init__``)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    from mrv2_qwen_vl.video import Qwen2VideoSettings

    path = make_tiny_qwen_vl(tmp_path / "ckpt", vision={"tokens_per_second": 2})
    image_settings = json.loads((path / "preprocessor_config.json").read_text())
    video_settings = {
        "video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 14,
        "temporal_patch_size": 2, "merge_size": 2, "rescale_factor": 1 / 255,
        "size": {"shortest_edge": 2 * 28 * 28, "longest_edge": 64 * 28 * 28},
        "min_pixels": 4 * 28 * 28, "max_pixels": 16 * 28 * 28,
        "image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3]}
    (path / "video_preprocessor_config.json").write_text(json.dumps(video_settings))
    settings = Qwen2VideoSettings.load(path)
    assert (settings.min_pixels, settings.max_pixels) == (4 * 28 * 28, 16 * 28 * 28)
    processor = _llm(path).engine.input_processor
    assert processor is not None
    ids = [5, START, VIDEO, END, 9]
    big = _frames(4, 224, 224, 3)
    h, w = smart_resize(224, 224, factor=28, min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
    assert (h, w) == (112, 112) and image_settings["size"]["longest_edge"] >= 224 * 224
    _, items = processor.process(ids, {"video": big})
    assert [list(item.data["grid_thw"]) for item in items] == [[2, h // 14, w // 14]]
    small = _frames(4, 112, 112, 4)
    _, items = processor.process(ids, {"video": small})
    rows, grid = _hf_video(small, video_settings)
    torch.testing.assert_close(items[0].data["pixel_values"], rows, rtol=0, atol=1e-5)
    assert list(items[0].data["grid_thw"]) == grid
    image = random_image(112, 112, 5)
    _, items = processor.process([5, START, IMAGE, END], {"image": image})
    torch.testing.assert_close(items[0].data["pixel_values"],
                               _hf_image(image, image_settings)[0], rtol=0, atol=1e-5)


# -- Qwen3-VL: timestamp text between frame groups --------------------------------------------

def _hf_qwen3_processor(path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """HF's own ``Qwen3VLProcessor`` of the checkpoint (module doc: the torchvision shims)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from mrv2_qwen_vl.processor import load_image_processor

    video = Qwen3VLVideoProcessor.from_pretrained(path)
    video.normalize = lambda image, mean, std: (  # type: ignore[method-assign]
        (image - torch.as_tensor(mean).view(-1, 1, 1)) / torch.as_tensor(std).view(-1, 1, 1))
    monkeypatch.setattr(transformers.ProcessorMixin, "check_argument_for_proper_class",
                        lambda *args: None)
    return transformers.Qwen3VLProcessor(
        image_processor=load_image_processor(path),
        tokenizer=transformers.AutoTokenizer.from_pretrained(path), video_processor=video)


# Each case: the prompt text, its videos ((clip, fps or None) each) and images. Frame sizes are
# multiples of 32 within the video processor's pixel budget (kept as they are).
QWEN3_CASES: dict[str, Callable[[], tuple[str, list[tuple[Any, float | None]], list[Any]]]] = {
    # 4 frames of 64 x 96 at the default 2 fps: groups at 0.25 s and 1.25 s of 2 x 3 tokens
    "one_video": lambda: ("Describe<|vision_start|><|video_pad|><|vision_end|> it.",
                          [(_frames(4, 64, 96, 0), None)], []),
    # 3 PIL frames (the last repeated) at 1 fps (groups at 0.5 s and 2.0 s), then an image
    "video_and_image": lambda: (
        "A<|vision_start|><|video_pad|><|vision_end|> then "
        "<|vision_start|><|image_pad|><|vision_end|>!",
        [([Image.fromarray(f) for f in _frames(3, 96, 64, 1)], 1.0)], [random_image(64, 96, 2)]),
}


@pytest.mark.parametrize(("family", "case"), [("qwen3_vl", "one_video"),
                                              ("qwen3_vl", "video_and_image"),
                                              ("qwen3_vl_moe", "one_video")])
def test_qwen3_video_matches_hf(checkpoints: Callable[[str], Path],
                                hf_models: Callable[[str], Any],
                                monkeypatch: pytest.MonkeyPatch, family: str, case: str) -> None:
    """Qwen3-VL's expanded prompt (timestamp text, vision start / end per frame group) and
    video rows equal HF ``Qwen3VLProcessor``'s; the M-RoPE positions of its frame-group items
    equal HF's ``get_rope_index``; greedy tokens equal HF ``generate``'s; every prompt
    position's log-probability is within 1e-4 of HF's forward (deepstack features of video
    rows included)."""
    path = checkpoints(family)
    hf_model = hf_models(family)
    text, clips, images = QWEN3_CASES[case]()
    processor = _hf_qwen3_processor(path, monkeypatch)
    arrays = [_as_numpy(clip) for clip, _ in clips]
    hf = processor(
        text=[text], images=images or None, return_tensors="pt",
        videos=[torch.from_numpy(a).permute(0, 3, 1, 2) for a in arrays],
        videos_kwargs={"do_resize": False, "do_convert_rgb": False, "do_sample_frames": False,
                       "video_metadata": [{"fps": fps or 2.0, "total_num_frames": len(a),
                                           "frames_indices": list(range(len(a)))}
                                          for a, (_, fps) in zip(arrays, clips, strict=True)]})
    hf_ids = hf["input_ids"][0].tolist()
    mm: dict[str, Any] = {"video": [clip if fps is None else (clip, {"fps": fps})
                                    for clip, fps in clips]}
    if images:
        mm["image"] = images
    request = {"prompt_token_ids": processor.tokenizer.encode(text, add_special_tokens=False),
               "multi_modal_data": mm}
    llm = _llm(path)
    engine_processor = llm.engine.input_processor
    assert engine_processor is not None
    ids, items = engine_processor.process(request["prompt_token_ids"], mm)
    assert ids == hf_ids
    videos = [item for item in items if item.kind == "video"]
    assert len(videos) == int(hf["video_grid_thw"][:, 0].sum())  # an item per frame group
    torch.testing.assert_close(torch.cat([v.data["pixel_values"] for v in videos]),
                               hf["pixel_values_videos"], rtol=0, atol=1e-5)
    input_ids = hf["input_ids"]
    types_ = hf["mm_token_type_ids"]
    kwargs = {key: hf[key] for key in ("pixel_values", "image_grid_thw", "pixel_values_videos",
                                       "video_grid_thw") if key in hf}
    want_pos, _ = hf_model.model.get_rope_index(
        input_ids, types_, image_grid_thw=kwargs.get("image_grid_thw"),
        video_grid_thw=hf["video_grid_thw"])
    grids = [ImageGrid(item.offset, *(int(v) for v in item.data["grid_thw"][:1]),
                       int(item.data["grid_thw"][1]) // 2, int(item.data["grid_thw"][2]) // 2)
             for item in items]
    assert mrope_positions_ref(len(ids), grids)[0] == want_pos[:, 0].tolist()
    got = llm.generate([request], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        want = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 mm_token_type_ids=types_, max_new_tokens=6, do_sample=False,
                                 **kwargs)
        logits = hf_model(input_ids, mm_token_type_ids=types_, **kwargs).logits[0]
    assert got == want[0, len(hf_ids):].tolist()
    check_prompt_logprobs(llm, request, hf_ids, logits)


def test_qwen3_encoder_cache_keys_frame_groups_by_content(
        checkpoints: Callable[[str], Path]) -> None:
    """Qwen3-VL's frame groups are items of their own content: the same clip again runs no
    encoder (two groups: two runs the first time) and gives the same tokens; another clip runs
    two more; the same frames at another fps change only the timestamp text (no encoder run);
    chunked prefill (steps of 4 tokens) gives the whole-prompt tokens."""
    llm = _llm(checkpoints("qwen3_vl"), enable_prefix_caching=False)
    clip, other = _frames(4, 64, 64, 7), _frames(4, 64, 64, 8)

    def request(video: Any, head: int = 5) -> dict[str, Any]:
        return {"prompt_token_ids": [head, START, VIDEO, END, 9],
                "multi_modal_data": {"video": video}}

    state = llm.engine.runner.model_state
    first = llm.generate([request(clip)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert state.encoder_runs == 2
    again = llm.generate([request(clip.copy(), head=6), request(clip)], GREEDY,
                         use_tqdm=False)
    assert state.encoder_runs == 2 and again[1].outputs[0].token_ids == first
    llm.generate([request(other)], GREEDY, use_tqdm=False)
    assert state.encoder_runs == 4
    slower = llm.generate([request((clip, {"fps": 1.0}))], GREEDY, use_tqdm=False)
    assert state.encoder_runs == 4 and len(slower[0].outputs[0].token_ids) == 6
    chunked = _llm(checkpoints("qwen3_vl"), enable_prefix_caching=False,
                   max_num_batched_tokens=4)
    assert chunked.generate([request(clip)], GREEDY,
                            use_tqdm=False)[0].outputs[0].token_ids == first


def test_qwen3_video_resize_and_bad_clips(checkpoints: Callable[[str], Path]) -> None:
    """A Qwen3-VL clip whose size ``smart_resize`` changes is resized as a whole (its grid
    HF's video processor's count); timestamps are HF's; too few or too many frames (the tiny
    config's ``max_frames`` 16) and a missing tokenizer: a ValueError naming
    ``multi_modal_data.video`` before anything runs."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    path = checkpoints("qwen3_vl")
    llm = _llm(path)
    processor = llm.engine.input_processor
    assert processor is not None
    ids = [5, START, VIDEO, END, 9]
    frames = _frames(4, 70, 100, 4)
    settings = Qwen3VideoSettings.load(path)
    assert settings.max_frames == 16 and settings.max_pixels == 512 * 32 * 32
    resized = resize_clip(frames, settings, "x")
    assert resized.shape[1] % 32 == 0 and resized.shape[2] % 32 == 0
    _, items = processor.process(ids, {"video": frames})
    hf_count = Qwen3VLVideoProcessor.from_pretrained(path).get_num_of_video_patches(4, 70, 100)
    assert sum(int(np.prod(item.data["grid_thw"])) for item in items) == hf_count
    assert frame_group_times(5, 3.0, 2) == Qwen3VLProcessor._calculate_timestamps(
        None, list(range(5)), 3.0, 2)  # type: ignore[arg-type]
    for clip, message in [
        (_frames(1, 64, 64, 0), r"multi_modal_data\.video\[0\]: a Qwen3-VL clip needs 2 to 16 "
                                r"frames \(temporal_patch_size \.\. max_frames\), got 1"),
        (_frames(17, 32, 32, 0), r"multi_modal_data\.video\[0\]: a Qwen3-VL clip needs 2 to 16 "
                                 r"frames .*, got 17")]:
        with pytest.raises(ValueError, match=message):
            llm.generate([{"prompt_token_ids": [5, 6]},
                          {"prompt_token_ids": ids, "multi_modal_data": {"video": clip}}],
                         GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    no_tokenizer = type(processor)(processor.model_dir, processor.hf_config, None,
                                   processor.config)
    with pytest.raises(ValueError, match=r"multi_modal_data\.video: Qwen3-VL writes each frame "
                                         r"group's timestamp as text, which needs the "
                                         r"checkpoint's tokenizer"):
        no_tokenizer.process(ids, {"video": frames})
