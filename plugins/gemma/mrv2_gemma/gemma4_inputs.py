"""Gemma 4's images, videos and audio: the input processor (prompt expansion, the checkpoint's
image processor, its video settings and audio feature extractor) and the model state (the
encoder cache, each step's soft tokens and image / video frame spans).

**Prompts.** A prompt carries one image token (``config.image_token_id``) per image and one
audio token (``config.audio_token_id``) per clip where the chat template puts them, as in HF
and vLLM. Each is expanded as HF's ``Gemma4Processor`` expands it: ``<boi>``
(``boi_token_id``), as many image tokens as the image has soft tokens, ``<eoi>``
(``eoi_token_id``); for a clip ``<boa>`` (``boa_token_id``), its audio tokens, ``<eoa>``
(``eoa_token_id``, or HF's config name ``eoa_token_index``); no text around them. The soft
tokens are the item's :class:`~mrv2.contract.requests.MultiModalItem` (``"image"`` or
``"audio"``); an image's are ``bidirectional`` when the text config says
``use_bidirectional_attention: "vision"`` (their tokens then attend to each other both ways on
the sliding layers, and no step splits them), a clip's are causal (HF marks audio tokens type
3, outside its two-way blocks). A video placeholder (``config.video_token_id``, ``<|video|>``)
is expanded as HF's ``replace_video_token``: per frame its timestamp text, ``<boi>``, the
frame's video tokens, ``<eoi>``, frames joined by spaces (:mod:`mrv2_gemma.gemma4_video`);
each frame is an item of kind ``"video"``, ``bidirectional`` as an image (HF marks video
tokens type 2, inside its two-way blocks: one block per frame).

**Images.** The checkpoint's image processor (``preprocessor_config.json``: an aspect-ratio
preserving resize to at most ``max_soft_tokens`` pooled patches, rescale, patches padded to
``max_soft_tokens * pooling_kernel_size**2`` with positions ``(-1, -1)``; its PIL backend where
torchvision is absent) makes each image's patch rows and positions; an item's content hash is
over both. The number of soft tokens varies with the image's aspect ratio.

**Videos** (``multi_modal_data["video"]``: decoded frames,
:func:`~mrv2.contract.video_inputs.parse_videos`): resized and cut into patches by the video
settings (:class:`~mrv2_gemma.gemma4_video.Gemma4VideoSettings`); a frame's item keeps its
real patch rows and positions, hashed (``"video:..."``) for the encoder cache, and runs
through the vision encoder as an image does. Its timestamps need the checkpoint's tokenizer.

**Audio** (``multi_modal_data["audio"]``: ``(samples, sampling_rate)``, bare samples at the
extractor's rate, or a list: :func:`~mrv2_gemma.audio_inputs.audio_clips`). A clip at another
rate is resampled to the extractor's (16 kHz; :func:`~mrv2_gemma.audio_inputs.resample`).
The checkpoint's ``Gemma4AudioFeatureExtractor`` (``processor_config.json``'s
``feature_extractor`` section, or a ``preprocessor_config.json`` of that type) makes its
log-mel frames as HF's processor calls it (so a clip past ``max_length``, 30 s, is cut there
as HF cuts it); the item keeps the valid frames (``input_features [frames, mel]``), hashed
for the encoder cache, and has ``ceil(ceil(frames / 2) / 2)`` soft tokens (HF's count: its
two stride-2 convolutions over the valid-frame mask). A clip too short for one token is
refused.

**Each step** (:class:`Gemma4VLModelState`): the soft tokens of the images the step computes
come from the core's encoder cache (:class:`~mrv2.contract.encoder_cache.
EncoderCacheModelState`; one run of the vision encoder per image or video frame, of the audio
encoder per clip), and the step's image and frame spans go to the model's forward as
``bidirectional``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch

from mrv2.contract.batch import InputBatch
from mrv2.contract.encoder_cache import EncoderCacheModelState
from mrv2.contract.input_processor import (
    InputProcessor,
    content_hash,
    preprocessor_config,
    run_image_processor,
)
from mrv2.contract.requests import MultiModalItem, NewRequest
from mrv2.contract.video_inputs import VIDEO_FIELD, VideoClip, parse_videos
from mrv2_gemma.audio_inputs import audio_clips, load_feature_extractor, resample
from mrv2_gemma.gemma4_audio import audio_tokens
from mrv2_gemma.gemma4_video import (
    DEFAULT_FPS,
    Gemma4VideoSettings,
    frame_patches,
    frame_prefixes,
    soft_tokens,
)

__all__ = ["Gemma4InputProcessor", "Gemma4VLModelState"]

_KEYS = ("image", "audio", "video")
#: Samples of a clip (at the extractor's rate) that make its features: the extractor's own
#: ``max_length`` (30 s at 16 kHz), past which HF's processor cuts a clip too.
MAX_AUDIO_SAMPLES = 480_000
#: The longest clip's valid frames the profile runs: HF's 30 s cut at 10 ms a frame.
_PROFILE_FRAMES = 3000


class Gemma4InputProcessor(InputProcessor):
    """Gemma 4's :class:`~mrv2.contract.input_processor.InputProcessor` (module doc)."""

    def __init__(self, model_dir: str, hf_config: Any, tokenizer: Any, config: Any) -> None:
        super().__init__(model_dir, hf_config, tokenizer, config)
        self.image_token = int(hf_config.image_token_id)
        self.boi = int(hf_config.boi_token_id)
        self.eoi = int(hf_config.eoi_token_id)
        text = getattr(hf_config, "text_config", hf_config)
        self.bidirectional = getattr(text, "use_bidirectional_attention", None) == "vision"
        #: The checkpoint's audio feature extractor; None: audio is refused, for the reason in
        #: :attr:`audio_refused` (text and images still run).
        self.feature_extractor: Any = None
        self.audio_refused = ""
        self.load_audio(model_dir, hf_config)
        video = getattr(hf_config, "video_token_id", None)
        self.video_token = -1 if video is None else int(video)
        #: The checkpoint's video processor settings (module doc).
        self.video_settings = Gemma4VideoSettings.load(model_dir)
        if getattr(hf_config, "vision_config", None) is None:
            self.images_refused = "the checkpoint has no vision_config (a text-only Gemma 4)"
            return
        self.load_images(model_dir, "Gemma4ImageProcessor")

    def load_audio(self, model_dir: str, hf_config: Any) -> None:
        """Set the audio tokens and :attr:`feature_extractor`, or keep why audio is refused."""
        ids = [getattr(hf_config, name, None) for name in ("audio_token_id", "boa_token_id")]
        ids.append(getattr(hf_config, "eoa_token_id", None)
                   or getattr(hf_config, "eoa_token_index", None))
        self.audio_token, self.boa, self.eoa = (-1 if i is None else int(i) for i in ids)
        if getattr(hf_config, "audio_config", None) is None:
            self.audio_refused = "the checkpoint has no audio_config (no audio tower)"
        elif min(self.audio_token, self.boa, self.eoa) < 0:
            self.audio_refused = "the config lacks audio_token_id / boa_token_id / eoa_token_id"
        else:
            try:
                self.feature_extractor = load_feature_extractor(
                    model_dir, "Gemma4AudioFeatureExtractor")
            except (FileNotFoundError, ValueError, TypeError) as error:
                self.audio_refused = str(error)
                return
            quarter = int(hf_config.audio_config.subsampling_conv_channels[0]) // 4
            mel = int(self.feature_extractor.feature_size)
            if not 4 * quarter - 3 <= mel <= 4 * quarter:
                self.feature_extractor = None
                self.audio_refused = (f"the feature extractor's feature_size {mel} does not fit "
                                      "audio_config.subsampling_conv_channels[0] "
                                      f"{4 * quarter} (mel bins {4 * quarter - 3} .. "
                                      f"{4 * quarter})")

    def require_audio(self) -> Any:
        """The feature extractor, or ValueError ``multi_modal_data.audio: <why>`` where audio
        is refused (:attr:`audio_refused`)."""
        if self.feature_extractor is None:
            raise ValueError(f"multi_modal_data.audio: {self.audio_refused}")
        return self.feature_extractor

    def process(self, prompt_token_ids: list[int], mm_data: Mapping[str, Any]
                ) -> tuple[list[int], list[MultiModalItem]]:
        """Expand the image, video and audio placeholders and make their items (module doc);
        ValueError naming the field for bad input."""
        unknown = sorted(key for key, value in mm_data.items()
                         if key not in _KEYS and not _empty(value))
        if unknown:
            raise ValueError(f"multi_modal_data has unsupported keys {unknown}; allowed: "
                             "'image', 'audio', 'video'")
        videos, video_places = self.videos_and_places(prompt_token_ids, mm_data.get("video"))
        image = mm_data.get("image")
        images, image_places = self.images_and_places(
            prompt_token_ids, {"image": [] if image is None else image}, self.image_token)
        clips = audio_clips(mm_data.get("audio"))
        if clips:
            self.require_audio()
        if len(clips) > self.limit_per_prompt:
            raise ValueError(f"multi_modal_data.audio: {len(clips)} clips; at most "
                             f"{self.limit_per_prompt} per prompt (--limit-mm-per-prompt)")
        audio_places = [i for i, t in enumerate(prompt_token_ids) if t == self.audio_token]
        if len(audio_places) != len(clips):
            raise ValueError(f"multi_modal_data.audio: {len(clips)} clips but the prompt has "
                             f"{len(audio_places)} audio placeholders (token {self.audio_token})"
                             "; put one per clip")
        if images:
            self.require_images()
        # each placeholder's items: place -> [(kind, data, content hash, soft tokens, prefix)]
        pieces: dict[int, list[tuple[str, dict[str, torch.Tensor], str, int, list[int]]]] = {}
        if images:
            out = run_image_processor(self.image_processor, images)
            pixels = cast(torch.Tensor, out["pixel_values"])
            positions = cast(torch.Tensor, out["image_position_ids"])
            counts = [int(n) for n in out["num_soft_tokens_per_image"]]
            for n, place in enumerate(image_places):
                rows, where = pixels[n].contiguous(), positions[n].contiguous()
                pieces[place] = [("image", {"pixel_values": rows, "position_ids": where},
                                  content_hash(rows, where), counts[n], [])]
        for n, place in enumerate(audio_places):
            features = self.audio_features(n, *clips[n])
            digest = "audio:" + content_hash(features).split(":", 1)[1]
            pieces[place] = [("audio", {"input_features": features}, digest,
                              audio_tokens(features.shape[0]), [])]
        for n, place in enumerate(video_places):
            pieces[place] = self.video_frames(videos[n], f"{VIDEO_FIELD}[{n}]")
        ids: list[int] = []
        items: list[MultiModalItem] = []
        copied = 0  # the first prompt position not yet copied
        for place in sorted(pieces):
            ids.extend(prompt_token_ids[copied:place])
            copied = place + 1
            for kind, data, digest, count, prefix in pieces[place]:
                token, first, last = {"image": (self.image_token, self.boi, self.eoi),
                                      "video": (self.video_token, self.boi, self.eoi),
                                      "audio": (self.audio_token, self.boa, self.eoa)}[kind]
                ids.extend([*prefix, first])
                items.append(MultiModalItem(kind, data, digest, len(ids), count,
                                            bidirectional=self.bidirectional
                                            and kind != "audio"))
                ids.extend([*[token] * count, last])
        ids.extend(prompt_token_ids[copied:])
        return ids, items

    def videos_and_places(self, prompt_token_ids: list[int], value: Any
                          ) -> tuple[list[VideoClip], list[int]]:
        """The prompt's clips and the positions of its video placeholders, one per clip;
        ValueError naming ``multi_modal_data.video`` where videos are refused (no vision
        tower or image processor, no ``video_token_id``, video settings the tower can't take,
        no tokenizer for the timestamps),
        a clip is malformed, there are more than ``--limit-mm-per-prompt`` or the placeholders
        don't match."""
        clips = parse_videos(value, DEFAULT_FPS)
        if clips:
            if self.image_processor is None:
                raise ValueError(f"{VIDEO_FIELD}: {self.images_refused}")
            if self.video_token < 0:
                raise ValueError(f"{VIDEO_FIELD}: the config has no video_token_id")
            vision, settings = self.hf_config.vision_config, self.video_settings
            cut = (settings.patch_size, settings.pooling_kernel_size)
            tower = (int(vision.patch_size), int(vision.pooling_kernel_size))
            if cut != tower:
                raise ValueError(f"{VIDEO_FIELD}: the checkpoint's video processor cuts "
                                 f"(patch_size, pooling_kernel_size) = {cut}, its vision "
                                 f"tower takes {tower}")
            if self.tokenizer is None:
                raise ValueError(f"{VIDEO_FIELD}: Gemma 4 writes each frame's timestamp as "
                                 "text, which needs the checkpoint's tokenizer; this engine "
                                 "has none (pass --tokenizer or use a checkpoint with one)")
        if len(clips) > self.limit_per_prompt:
            raise ValueError(f"{VIDEO_FIELD}: {len(clips)} videos; at most "
                             f"{self.limit_per_prompt} per prompt (--limit-mm-per-prompt)")
        places = ([i for i, t in enumerate(prompt_token_ids) if t == self.video_token]
                  if self.video_token >= 0 else [])
        if len(places) != len(clips):
            raise ValueError(f"{VIDEO_FIELD}: {len(clips)} videos but the prompt has "
                             f"{len(places)} video placeholders (token {self.video_token}, "
                             "<|video|>); put one per video")
        return clips, places

    def video_frames(self, clip: VideoClip, where: str
                     ) -> list[tuple[str, dict[str, torch.Tensor], str, int, list[int]]]:
        """One clip's frame items ``(kind, data, content hash, soft tokens, timestamp
        tokens)`` (:mod:`mrv2_gemma.gemma4_video`)."""
        settings = self.video_settings
        frames = frame_patches(clip, settings, where)
        prefixes = frame_prefixes(len(frames), clip.fps)
        out = []
        for (rows, positions), prefix in zip(frames, prefixes, strict=True):
            digest = "video:" + content_hash(rows, positions).split(":", 1)[1]
            text = list(self.tokenizer.encode(prefix, add_special_tokens=False))
            out.append(("video", {"pixel_values": rows, "position_ids": positions}, digest,
                        soft_tokens(rows.shape[0], settings), [int(t) for t in text]))
        return out

    def audio_features(self, index: int, samples: np.ndarray, rate: int | None
                       ) -> torch.Tensor:
        """Clip ``index``'s valid log-mel frames ``[frames, mel]`` (float32): resampled to
        the extractor's rate where ``rate`` differs, through the extractor as HF's processor
        calls it; ValueError naming the clip where it makes no token."""
        extractor = self.require_audio()
        where = f"multi_modal_data.audio[{index}]"
        target = int(extractor.sampling_rate)
        if rate is not None and rate != target:
            samples = resample(samples, rate, target, limit=MAX_AUDIO_SAMPLES)
        try:
            out = extractor([samples], return_tensors="np", max_length=MAX_AUDIO_SAMPLES,
                            truncation=True)
        except Exception as error:  # noqa: BLE001 (any failure of the extractor on a clip)
            raise ValueError(f"{where}: could not extract its features: "
                             f"{type(error).__name__}: {error}") from error
        features = np.asarray(out["input_features"][0], dtype=np.float32)
        mask = np.asarray(out["input_features_mask"][0], dtype=bool)
        frames = int(mask.sum())
        if audio_tokens(frames) < 1:
            least = int(extractor.frame_length) - int(extractor.frame_length) // 2 + 1
            raise ValueError(f"{where}: a clip of {len(samples)} samples at {target} Hz is too "
                             f"short; at least {least} samples")
        if not mask[:frames].all():  # (the extractor pads at the end only)
            raise ValueError(f"{where}: the feature extractor's frame mask is not a prefix")
        return torch.from_numpy(np.ascontiguousarray(features[:frames]))


def _empty(value: Any) -> bool:
    """Whether a ``multi_modal_data`` value carries no item (None or an empty list)."""
    return value is None or (isinstance(value, (list, tuple)) and not value)


class Gemma4VLModelState(EncoderCacheModelState):
    """The model state of ``Gemma4ForConditionalGeneration`` with images, videos and audio
    (module doc)."""

    item_kinds = _KEYS

    def __init__(self, model: Any, hf_config: Any, config: Any, buffers: Any, block_size: int,
                 device: torch.device) -> None:
        super().__init__(model, hf_config, config, buffers, block_size, device)
        vision = cast(Any, model).vision
        #: The width of an image's patch rows and the pooling kernel (None: no vision tower).
        self.pixel_width: int | None = None
        self.pool: int | None = None
        if vision is not None:
            self.pixel_width = int(vision.vision_tower.patch_embedder.input_proj.in_features)
            self.pool = int(vision.kernel)
        audio = cast(Any, model).audio
        #: The mel widths the audio encoder takes (None: no audio tower).
        self.mel_bins: tuple[int, ...] | None = None if audio is None else tuple(audio.mel_bins)

    def check_item(self, request: NewRequest, item: MultiModalItem) -> None:
        """An image or video frame of ``[patches, C * P * P]`` pixels, ``[patches, 2]``
        positions and as many placeholders as its real patches pool to; a clip of ``[frames,
        mel]`` features and as many placeholders as its frames subsample to."""
        super().check_item(request, item)
        if item.kind == "audio":
            self._check_audio(request, item)
            return
        if self.pixel_width is None or self.pool is None:
            raise ValueError(f"request {request.req_id!r}: the checkpoint has no vision tower")
        what = "an image" if item.kind == "image" else "a video frame"
        data = item.data if isinstance(item.data, Mapping) else {}
        pixels, where = data.get("pixel_values"), data.get("position_ids")
        if not (isinstance(pixels, torch.Tensor) and isinstance(where, torch.Tensor)
                and pixels.dim() == 2 and pixels.shape[1] == self.pixel_width
                and tuple(where.shape) == (pixels.shape[0], 2)):
            raise ValueError(f"request {request.req_id!r}: {what} needs pixel_values "
                             f"[patches, {self.pixel_width}] and position_ids [patches, 2]")
        width, height = _grid(where)
        real = int((where[:, 0] >= 0).sum())
        ordered = bool((where[:real, 0] >= 0).all())
        if (not ordered or real != width * height or width % self.pool
                or height % self.pool):
            raise ValueError(f"request {request.req_id!r}: {what}'s position_ids must make a "
                             f"{self.pool}-divisible grid from (0, 0), padding at the end")
        if real // self.pool**2 != item.length:
            raise ValueError(f"request {request.req_id!r}: {what} of {real} patches has "
                             f"{real // self.pool**2} soft tokens, got length {item.length}")

    def _check_audio(self, request: NewRequest, item: MultiModalItem) -> None:
        if self.mel_bins is None:
            raise ValueError(f"request {request.req_id!r}: the checkpoint has no audio tower")
        data = item.data if isinstance(item.data, Mapping) else {}
        features = data.get("input_features")
        if not (isinstance(features, torch.Tensor) and features.dim() == 2
                and features.is_floating_point() and features.shape[1] in self.mel_bins):
            raise ValueError(f"request {request.req_id!r}: a clip needs input_features "
                             f"[frames, mel] (float, mel in {list(self.mel_bins)})")
        if audio_tokens(features.shape[0]) != item.length:
            raise ValueError(f"request {request.req_id!r}: a clip of {features.shape[0]} frames "
                             f"has {audio_tokens(features.shape[0])} soft tokens, got length "
                             f"{item.length}")

    def embed_item(self, item: MultiModalItem) -> torch.Tensor:
        """One run of the vision encoder (an image or a video frame) or the audio encoder (a
        clip): ``[soft tokens, hidden_size]``."""
        if item.kind == "audio":
            features = self.upload(cast(torch.Tensor, item.data["input_features"]))
            return cast(torch.Tensor, cast(Any, self.model).embed_audio(features))
        where = cast(torch.Tensor, item.data["position_ids"])
        grid = _grid(where)  # (host tensors: no device read)
        rows = grid[0] * grid[1]  # the real patches, first (the padding is not copied)
        pixels = self.upload(cast(torch.Tensor, item.data["pixel_values"])[:rows])
        where = self.upload(where[:rows])
        return cast(torch.Tensor, cast(Any, self.model).embed_image(pixels, where, grid))

    def profile_encoder(self, max_prompt_tokens: int) -> int:
        """The encoders over their largest inputs, outputs dropped: one image of the
        processor's largest size (``max_soft_tokens`` pooled patches, 280 unless
        ``preprocessor_config.json`` says otherwise, or the video settings' where larger;
        random pixels, a square grid) and one
        clip of HF's longest (30 s: 3000 frames, or the prompt's room; random features);
        returns :attr:`encoder_cache_bytes`."""
        if self.pixel_width is not None and self.pool is not None:
            model_dir = self.config.model.model
            most = max(int(preprocessor_config(model_dir).get("max_soft_tokens") or 280),
                       Gemma4VideoSettings.load(model_dir).max_soft_tokens)
            side = math.isqrt(min(most, max(1, max_prompt_tokens))) * self.pool
            grid = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side),
                                              indexing="xy"), dim=-1).reshape(-1, 2)
            pixels = torch.rand(side * side, self.pixel_width)
            cast(Any, self.model).embed_image(pixels.to(self.device), grid.to(self.device),
                                              (side, side))
        if self.mel_bins is not None:
            frames = min(_PROFILE_FRAMES, 4 * max(1, max_prompt_tokens))
            features = torch.randn(frames, self.mel_bins[-1])
            cast(Any, self.model).embed_audio(features.to(self.device))
        return self.encoder_cache_bytes

    def prepare_inputs(self, batch: InputBatch) -> dict[str, Any]:
        """The default inputs (image and frame rows spliced in) and, for a step with image or
        video tokens, their spans as ``bidirectional``."""
        inputs = super().prepare_inputs(batch)
        spans = self.step_spans(batch)
        if spans:
            inputs["bidirectional"] = spans
        return inputs


def _grid(positions: torch.Tensor) -> tuple[int, int]:
    """``(width, height)`` in patches of an image's CPU ``position_ids`` (``(-1, -1)``:
    padding)."""
    real = positions[positions[:, 0] >= 0]
    if not len(real):
        return 0, 0
    return int(real[:, 0].max()) + 1, int(real[:, 1].max()) + 1

