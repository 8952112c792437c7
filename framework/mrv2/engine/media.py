"""Images and audio in chat messages: content parts to template placeholders plus
``multi_modal_data``.

Chat messages (``LLM.chat``, the OpenAI server) may carry content lists of parts:
``{"type": "text", "text": ...}``, ``{"type": "image", "image": PIL.Image}`` or OpenAI's
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``.
:func:`split_chat_media` replaces each image part with ``{"type": "image"}``. The family's
chat template renders that as its placeholder (Qwen2.5-VL:
``<|vision_start|><|image_pad|><|vision_end|>``). The images are returned in order, for the
input processor. :func:`load_image_url` decodes ``data:`` URIs; it fetches ``http(s)`` URLs
only when allowed (``--allow-remote-media``), and with a size cap. Every failure is a
``ValueError`` naming the part.

Audio parts, OpenAI's ``{"type": "input_audio", "input_audio": {"data": "<base64 WAV>",
"format": "wav"}}``, are taken too: each becomes
``{"type": "audio"}`` for the template, and its clip, decoded by :func:`decode_wav` (PCM of
8, 16, 24 or 32 bits, the channels averaged to mono, as floats in [-1, 1]), goes to
``multi_modal_data["audio"]`` as ``(samples, sampling_rate)``, as vLLM takes it; a family's
input processor that takes no audio refuses it, naming the key.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.request
import wave
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["MAX_AUDIO_BYTES", "MAX_IMAGE_BYTES", "decode_wav", "load_image_url",
           "load_input_audio", "split_chat_media"]

#: Largest encoded image accepted (a data URI's payload or a fetched body).
MAX_IMAGE_BYTES = 20 << 20
#: Largest decoded audio accepted (an ``input_audio`` part's WAV data).
MAX_AUDIO_BYTES = 20 << 20
_FETCH_TIMEOUT_S = 10.0


def _decode(raw: bytes, where: str) -> Any:
    if len(raw) > MAX_IMAGE_BYTES:
        raise ValueError(f"{where}: the image is {len(raw) / 2**20:.1f} MiB; at most "
                         f"{MAX_IMAGE_BYTES >> 20} MiB")
    try:
        from PIL import Image
    except ImportError as error:
        raise ValueError(f"{where}: images need pillow (pip install pillow)") from error
    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise ValueError(f"{where}: could not decode the image: {error}") from error


def load_image_url(url: str, allow_remote: bool = False, where: str = "image_url") -> Any:
    """A PIL image from a ``data:`` URI, or from an ``http(s)`` URL when ``allow_remote``."""
    if url.startswith("data:"):
        header, _, payload = url.partition(",")
        if not header.endswith(";base64"):
            raise ValueError(f"{where}: a data URI must be base64 (data:image/...;base64,...)")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as error:
            raise ValueError(f"{where}: the data URI is not valid base64: {error}") from error
        return _decode(raw, where)
    if url.startswith(("http://", "https://")):
        if not allow_remote:
            raise ValueError(f"{where}: remote URLs are not fetched (start with "
                             "--allow-remote-media to allow it); send the image as a data: URI")
        try:
            with urllib.request.urlopen(url, timeout=_FETCH_TIMEOUT_S) as response:
                raw = response.read(MAX_IMAGE_BYTES + 1)
        except OSError as error:
            raise ValueError(f"{where}: could not fetch {url!r}: {error}") from error
        return _decode(raw, where)
    raise ValueError(f"{where}: unsupported URL {url[:40]!r}; allowed: data: URIs"
                     + (", http(s)" if allow_remote else ""))


def decode_wav(raw: bytes, where: str = "input_audio") -> tuple[np.ndarray, int]:
    """``(mono float32 samples in [-1, 1], sampling rate)`` of WAV bytes: integer PCM of 8
    (unsigned), 16, 24 or 32 bits, its channels averaged. ValueError naming ``where``."""
    try:
        with wave.open(io.BytesIO(raw), "rb") as wav:
            channels, width, rate = wav.getnchannels(), wav.getsampwidth(), wav.getframerate()
            data = wav.readframes(wav.getnframes())
    except (wave.Error, EOFError, ValueError) as error:
        raise ValueError(f"{where}: could not decode the WAV data: {error}") from error
    count = len(data) // (width * channels)
    if count < 1:
        raise ValueError(f"{where}: the WAV data holds no samples")
    data = data[: count * width * channels]
    if width == 1:
        ints = np.frombuffer(data, dtype=np.uint8).astype(np.float64) - 128.0
    elif width == 3:  # (little-endian 24-bit: widened to int32 with the sign kept)
        parts = np.frombuffer(data, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        ints = ((parts[:, 0] | (parts[:, 1] << 8) | (parts[:, 2] << 16)) << 8 >> 8).astype(
            np.float64)
    elif width in (2, 4):
        ints = np.frombuffer(data, dtype=f"<i{width}").astype(np.float64)
    else:
        raise ValueError(f"{where}: {8 * width}-bit WAV samples are not supported; allowed: "
                         "8, 16, 24, 32-bit PCM")
    samples = ints.reshape(count, channels).mean(axis=1) / float(2 ** (8 * width - 1))
    return samples.astype(np.float32), int(rate)


def load_input_audio(spec: Any, where: str = "input_audio") -> tuple[np.ndarray, int]:
    """An OpenAI ``input_audio`` object (``{"data": "<base64>", "format": "wav"}``) as
    ``(samples, sampling rate)`` (:func:`decode_wav`); ValueError naming ``where``."""
    if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
        raise ValueError(f"{where}: expected {{'data': '<base64 WAV>', 'format': 'wav'}}")
    kind = spec.get("format", "wav")
    if kind != "wav":
        raise ValueError(f"{where}.format: unsupported {kind!r}; allowed: 'wav'")
    try:
        raw = base64.b64decode(spec["data"], validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"{where}.data: not valid base64: {error}") from error
    if len(raw) > MAX_AUDIO_BYTES:
        raise ValueError(f"{where}.data: the audio is {len(raw) / 2**20:.1f} MiB; at most "
                         f"{MAX_AUDIO_BYTES >> 20} MiB")
    return decode_wav(raw, f"{where}.data")


def split_chat_media(messages: Sequence[dict[str, Any]], allow_remote: bool = False
                     ) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """``(messages with image parts as {"type": "image"} and input_audio parts as {"type":
    "audio"}, multi_modal_data)``: ``{"image": [images in order]}``, plus ``"audio":
    [(samples, rate) in order]`` when a part is audio (so an image-only input processor
    sees the one key it takes)."""
    out: list[dict[str, Any]] = []
    images: list[Any] = []
    clips: list[tuple[np.ndarray, int]] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": str(part.get("text", ""))})
            elif kind == "image":
                if part.get("image") is None:
                    raise ValueError(f"{where}.image: missing (a PIL image)")
                images.append(part["image"])
                parts.append({"type": "image"})
            elif kind == "image_url":
                spec = part.get("image_url")
                url = spec.get("url") if isinstance(spec, dict) else spec
                if not isinstance(url, str):
                    raise ValueError(f"{where}.image_url: expected {{'url': '...'}}")
                images.append(load_image_url(url, allow_remote, f"{where}.image_url"))
                parts.append({"type": "image"})
            elif kind == "input_audio":
                clips.append(load_input_audio(part.get("input_audio"), f"{where}.input_audio"))
                parts.append({"type": "audio"})
            else:
                raise ValueError(f"{where}.type: unsupported {kind!r}; allowed: 'text', "
                                 "'image', 'image_url', 'input_audio'")
        out.append({**message, "content": parts})
    return out, ({"image": images, "audio": clips} if clips else {"image": images})
