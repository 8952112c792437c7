"""Images in chat messages: content parts to template placeholders plus ``multi_modal_data``.

Chat messages (``LLM.chat``, the OpenAI server) may carry content lists of parts:
``{"type": "text", "text": ...}``, ``{"type": "image", "image": PIL.Image}`` or OpenAI's
``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``.
:func:`split_chat_media` replaces each image part with ``{"type": "image"}``. The family's
chat template renders that as its placeholder (Qwen2.5-VL:
``<|vision_start|><|image_pad|><|vision_end|>``). The images are returned in order, for the
input processor. :func:`load_image_url` decodes ``data:`` URIs; it fetches ``http(s)`` URLs
only when allowed (``--allow-remote-media``), and with a size cap. Every failure is a
``ValueError`` naming the part.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.request
from collections.abc import Sequence
from typing import Any

__all__ = ["MAX_IMAGE_BYTES", "load_image_url", "split_chat_media"]

#: Largest encoded image accepted (a data URI's payload or a fetched body).
MAX_IMAGE_BYTES = 20 << 20
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


def split_chat_media(messages: Sequence[dict[str, Any]], allow_remote: bool = False
                     ) -> tuple[list[dict[str, Any]], list[Any]]:
    """``(messages with image parts as {"type": "image"}, the images in order)``."""
    out: list[dict[str, Any]] = []
    images: list[Any] = []
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
            else:
                raise ValueError(f"{where}.type: unsupported {kind!r}; allowed: 'text', "
                                 "'image', 'image_url'")
        out.append({**message, "content": parts})
    return out, images
