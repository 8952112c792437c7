"""Images and audio in chat messages: content parts to template placeholders plus
``multi_modal_data``.

Chat messages (``LLM.chat``, the OpenAI server) may carry content lists of parts:
``{"type": "text", "text": ...}``, ``{"type": "image", "image": PIL.Image}`` or OpenAI's
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``. Text comes as
vLLM's chat_utils reads it (:func:`part_text`): ``text``, ``input_text`` and ``output_text``
parts (their ``text``), ``refusal`` (its ``refusal``) and ``thinking`` (its ``thinking``); an
empty one is dropped. :func:`split_chat_media` replaces each image part with
``{"type": "image"}``. The family's chat template renders that as its placeholder (Qwen2.5-VL:
``<|vision_start|><|image_pad|><|vision_end|>``). The images are returned in order, for the
input processor. :func:`load_image_url` decodes ``data:`` URIs; it fetches ``http(s)`` URLs
only when allowed (``--allow-remote-media``), and reads ``file://`` URLs of files under
``--allowed-local-media-path`` only, with a size cap and a deadline on the whole
fetch, following at most a few redirects, to ``http(s)`` only. A decoded image is turned
upright by its EXIF orientation, as HF's ``load_image`` does. A prompt's parts past
``--limit-mm-per-prompt`` are refused before anything is decoded or fetched. Every failure
is a ``ValueError`` naming the part.

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
import http.client
import io
import time
import urllib.error
import urllib.parse
import urllib.request
import wave
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MAX_AUDIO_BYTES", "MAX_IMAGE_BYTES", "TEXT_PARTS", "decode_wav", "joined_text",
           "load_image_url", "load_input_audio", "part_text", "split_chat_media"]

#: The content parts read as text (vLLM's chat_utils) -> the key holding their text.
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text",
              "refusal": "refusal", "thinking": "thinking"}


def part_text(part: Any) -> str | None:
    """The text of a content part that is text (:data:`TEXT_PARTS`; a part without a
    ``type`` is a ``text`` one), "" where it holds none (null: vLLM skips it); None for a
    part that is not text (an image)."""
    kind = part.get("type", "text") if isinstance(part, dict) else None
    if kind not in TEXT_PARTS:
        return None
    value = part.get(TEXT_PARTS[kind])
    return "" if value is None else str(value)


def joined_text(parts: Sequence[Any]) -> str:
    """A message's content parts as one text, as vLLM's chat_utils joins them: the text
    parts' texts (:func:`part_text`) a line each, empty ones dropped, other parts left out."""
    return "\n".join(text for text in map(part_text, parts) if text)


#: Largest encoded image accepted (a data URI's payload or a fetched body).
MAX_IMAGE_BYTES = 20 << 20
#: Largest decoded audio accepted (an ``input_audio`` part's WAV data).
MAX_AUDIO_BYTES = 20 << 20
#: Seconds a fetch of a remote image may take in all (its redirects and body included).
_FETCH_TIMEOUT_S = 10.0
#: Redirects a fetch follows at most.
_MAX_REDIRECTS = 5


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Follows no redirect (:func:`_fetch` checks each one and follows it itself): a 3xx
    answer raises ``HTTPError``, its body unread."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def _decode(raw: bytes, where: str) -> Any:
    if len(raw) > MAX_IMAGE_BYTES:
        raise ValueError(f"{where}: the image is {len(raw) / 2**20:.1f} MiB; at most "
                         f"{MAX_IMAGE_BYTES >> 20} MiB")
    try:
        from PIL import Image, ImageOps
    except ImportError as error:
        raise ValueError(f"{where}: images need pillow (pip install pillow)") from error
    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
        return ImageOps.exif_transpose(image).convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise ValueError(f"{where}: could not decode the image: {error}") from error


def load_image_url(url: str, allow_remote: bool = False, where: str = "image_url",
                   local_root: str | None = None) -> Any:
    """A PIL image from a ``data:`` URI, from an ``http(s)`` URL when ``allow_remote``, or
    from a ``file://`` URL of a file under the directory ``local_root``
    (``--allowed-local-media-path``) when given."""
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
        return _decode(_fetch(url, where), where)
    if url.startswith("file:"):
        if local_root is None:
            raise ValueError(f"{where}: file:// URLs are not read (start with "
                             "--allowed-local-media-path DIR to allow the files under DIR)")
        return _decode(_read_local(url, local_root, where), where)
    raise ValueError(f"{where}: unsupported URL {url[:40]!r}; allowed: data: URIs"
                     + (", http(s)" if allow_remote else "")
                     + (f", file:// under {local_root}" if local_root is not None else ""))


def _read_local(url: str, local_root: str, where: str) -> bytes:
    """The bytes of the file a ``file://`` ``url`` names, at most ``MAX_IMAGE_BYTES + 1`` of
    them; ValueError naming ``where`` unless it is a file under ``local_root`` (links
    resolved first: a link out of it is refused)."""
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"{where}: a file:// URL names a file of this host, got {url[:80]!r}")
    path = Path(urllib.parse.unquote(parts.path)).resolve()
    if not path.is_relative_to(local_root):
        raise ValueError(f"{where}: {str(path)!r} is not under the allowed local media path "
                         f"{local_root!r} (--allowed-local-media-path)")
    try:
        with path.open("rb") as file:
            return file.read(MAX_IMAGE_BYTES + 1)
    except OSError as error:
        raise ValueError(f"{where}: could not read {str(path)!r}: {error.strerror}") from None


def _fetch(url: str, where: str) -> bytes:
    """The body at an ``http(s)`` ``url``, at most ``MAX_IMAGE_BYTES + 1`` bytes of it, within
    ``_FETCH_TIMEOUT_S`` in all; at most ``_MAX_REDIRECTS`` redirects followed, each to an
    ``http(s)`` URL. ValueError naming ``where`` otherwise."""
    deadline = time.monotonic() + _FETCH_TIMEOUT_S
    for _ in range(_MAX_REDIRECTS + 1):
        if urllib.parse.urlsplit(url).scheme.lower() not in ("http", "https"):
            raise ValueError(f"{where}: redirected to {url[:80]!r}; only http(s) URLs are "
                             "fetched")
        try:
            response = _OPENER.open(url, timeout=max(deadline - time.monotonic(), 0.001))
        except urllib.error.HTTPError as error:
            location = error.headers.get("Location") if 300 <= error.code < 400 else None
            error.close()
            if location is None:
                raise ValueError(f"{where}: could not fetch {url!r}: {error}") from error
            url = urllib.parse.urljoin(url, location)
            continue
        except (OSError, ValueError, http.client.HTTPException) as error:
            raise ValueError(f"{where}: could not fetch {url!r}: {error}") from error
        chunks: list[bytes] = []
        size = 0
        with response:
            try:
                while size <= MAX_IMAGE_BYTES:
                    if time.monotonic() > deadline:
                        raise ValueError(f"{where}: fetching {url!r} took more than "
                                         f"{_FETCH_TIMEOUT_S:g} s")
                    chunk = response.read1(1 << 16)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    size += len(chunk)
            except (OSError, http.client.HTTPException) as error:
                raise ValueError(f"{where}: could not fetch {url!r}: {error}") from error
        return b"".join(chunks)
    raise ValueError(f"{where}: more than {_MAX_REDIRECTS} redirects; the last to {url[:80]!r}")


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


def split_chat_media(messages: Sequence[dict[str, Any]], allow_remote: bool = False,
                     limit: int | None = None, local_root: str | None = None
                     ) -> tuple[list[dict[str, Any]], dict[str, list[Any]]]:
    """``(messages with image parts as {"type": "image"} and input_audio parts as {"type":
    "audio"}, multi_modal_data)``: ``{"image": [images in order]}``, plus ``"audio":
    [(samples, rate) in order]`` when a part is audio (so an image-only input processor
    sees the one key it takes). ``local_root`` (``--allowed-local-media-path``): image URLs
    may be ``file://`` ones of files under it. ``limit`` (``--limit-mm-per-prompt``): a
    ValueError naming the first image or audio part past that many of its kind, before it
    is decoded or fetched. Without an image or audio part, a message's text parts become
    one string, a line each."""
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
            count = (len(images) if kind in ("image", "image_url") else
                     len(clips) if kind == "input_audio" else 0)
            if limit is not None and count >= limit:
                noun = "audio clips" if kind == "input_audio" else "images"
                raise ValueError(f"{where}: more than {limit} {noun}; at most {limit} per "
                                 "prompt (--limit-mm-per-prompt)")
            if (text := part_text(part)) is not None:
                if text:  # (an empty text part is dropped, as vLLM drops it)
                    parts.append({"type": "text", "text": text})
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
                images.append(load_image_url(url, allow_remote, f"{where}.image_url",
                                             local_root))
                parts.append({"type": "image"})
            elif kind == "input_audio":
                clips.append(load_input_audio(part.get("input_audio"), f"{where}.input_audio"))
                parts.append({"type": "audio"})
            else:
                raise ValueError(f"{where}.type: unsupported {kind!r}; allowed: "
                                 f"{', '.join(map(repr, TEXT_PARTS))}, 'image', 'image_url', "
                                 "'input_audio'")
        out.append({**message, "content": parts})
    if not images and not clips:  # text parts only: a line each, as vLLM (and the server's
        # chat route) render them for a template that inserts the content as a string
        out = [{**m, "content": joined_text(m["content"])}
               if isinstance(m.get("content"), list) else m for m in out]
    return out, ({"image": images, "audio": clips} if clips else {"image": images})
