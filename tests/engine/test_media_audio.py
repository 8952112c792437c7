"""OpenAI ``input_audio`` chat parts (:mod:`mrv2.engine.media`): WAV bytes of every PCM width
decode to the samples written (channels averaged to mono); parts become ``{"type": "audio"}``
for the template and ``(samples, rate)`` clips in ``multi_modal_data["audio"]``, in order;
both ``LLM.chat`` and the server take them (one ``split_chat_media``); bad parts are ValueErrors
naming the part."""

from __future__ import annotations

import base64
import io
import re
import wave
from typing import Any

import numpy as np
import pytest

from mrv2.engine import media
from mrv2.engine.media import decode_wav, split_chat_media


def _wav(ints: np.ndarray, width: int, rate: int) -> bytes:
    """WAV bytes of integer samples ``[frames, channels]`` at ``width`` bytes each."""
    frames, channels = ints.shape
    if width == 1:
        raw = (ints + 128).astype(np.uint8).tobytes()
    elif width == 3:
        raw = ints.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()
    else:
        raw = ints.astype(f"<i{width}").tobytes()
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(width)
        out.setframerate(rate)
        out.writeframes(raw)
    return buffer.getvalue()


@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("channels", [1, 2])
def test_decode_wav_every_width(width: int, channels: int) -> None:
    rng = np.random.default_rng(width * 10 + channels)
    top = 2 ** (8 * width - 1)
    ints = rng.integers(-top, top, size=(50, channels))
    samples, rate = decode_wav(_wav(ints, width, 22050))
    assert rate == 22050 and samples.dtype == np.float32 and samples.shape == (50,)
    np.testing.assert_allclose(samples, ints.mean(axis=1) / top, rtol=1e-6, atol=1e-7)
    assert np.abs(samples).max() <= 1.0


def _part(data: bytes | str, kind: str = "wav") -> dict[str, object]:
    text = data if isinstance(data, str) else base64.b64encode(data).decode()
    return {"type": "input_audio", "input_audio": {"data": text, "format": kind}}


def test_split_chat_media_takes_input_audio() -> None:
    first = _wav(np.arange(-20, 20).reshape(-1, 1) * 100, 2, 16000)
    second = _wav(np.arange(30).reshape(-1, 2) * 1000, 2, 8000)
    messages: list[dict[str, Any]] = [{"role": "user", "content": [
        {"type": "text", "text": "a"}, _part(first), {"type": "text", "text": "b"},
        _part(second)]}, {"role": "assistant", "content": "ok"}]
    out, data = split_chat_media(messages)
    assert out[0]["content"] == [{"type": "text", "text": "a"}, {"type": "audio"},
                                 {"type": "text", "text": "b"}, {"type": "audio"}]
    assert out[1] == messages[1]
    assert data["image"] == [] and [r for _, r in data["audio"]] == [16000, 8000]
    np.testing.assert_allclose(data["audio"][0][0], np.arange(-20, 20) * 100 / 32768)
    np.testing.assert_allclose(data["audio"][1][0], (np.arange(0, 30, 2) + 0.5) * 1000 / 32768)
    # no audio part: the images alone, as before (image-only processors see one key)
    assert split_chat_media([{"role": "user", "content": [{"type": "text", "text": "x"}]}]
                            )[1] == {"image": []}
    with pytest.raises(ValueError, match=re.escape(
            "messages[0].content[1].type: unsupported 'video_url'; allowed: 'text', "
            "'input_text', 'output_text', 'refusal', 'thinking', 'image', 'image_url', "
            "'input_audio'")):
        split_chat_media([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "video_url"}]}])


def test_bad_input_audio_parts_name_the_part(monkeypatch: pytest.MonkeyPatch) -> None:
    good = _wav(np.ones((8, 1), dtype=np.int64), 2, 16000)
    where = re.escape("messages[0].content[0].input_audio")
    cases = [({"type": "input_audio", "input_audio": "x"}, ": expected {'data'"),
             (_part(good, "mp3"), r".format: unsupported 'mp3'; allowed: 'wav'"),
             (_part("not base64!"), ".data: not valid base64"),
             (_part(b"RIFF0000WAVEjunk"), ".data: could not decode the WAV data"),
             (_part(_wav(np.zeros((0, 1), dtype=np.int64), 2, 16000)),
              ".data: the WAV data holds no samples")]
    for part, message in cases:
        with pytest.raises(ValueError, match=where + message):
            split_chat_media([{"role": "user", "content": [part]}])
    monkeypatch.setattr(media, "MAX_AUDIO_BYTES", 16)
    with pytest.raises(ValueError, match=where + r".data: the audio is .* MiB; at most"):
        split_chat_media([{"role": "user", "content": [_part(good)]}])
