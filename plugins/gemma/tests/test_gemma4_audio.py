"""Gemma 4 with audio (``Gemma4ForConditionalGeneration`` with an ``audio_config``): the audio
encoder (:class:`~mrv2_gemma.gemma4_audio.Gemma4AudioEncoder`) against HF's
``get_audio_features`` (clips of different lengths padded into one HF batch, clipped linears
whose bounds bite, chunked attention with left and right context, the older checkpoint
layout); through the engine, greedy tokens equal HF ``generate``'s with ``input_features`` /
``input_features_mask`` from HF's own feature extractor over all of a prompt's clips (two
clips in one prompt, a clip beside an image, a clip at another sampling rate resampled,
chunked prefill ending steps inside a clip), the encoder cache on a second round, every
prompt position's log-probability; bad audio (and a bad video) refused naming the field; the OpenAI
server's ``input_audio`` parts. Plus the resampler and the feature extractor's lookup."""

from __future__ import annotations

import base64
import io
import json
import re
import wave
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.model_loader import iter_safetensors
from mrv2.testing import random_image
from mrv2_gemma.audio_inputs import audio_clips, load_feature_extractor, resample
from mrv2_gemma.gemma4_audio import AUDIO_CHECKPOINT_PREFIXES, Gemma4AudioEncoder, audio_tokens
from mrv2_gemma.testing import AUDIO_RATE as RATE
from mrv2_gemma.testing import GEMMA4_AUDIO as AUDIO
from mrv2_gemma.testing import GEMMA4_TEXT as TEXT
from mrv2_gemma.testing import TinyGemma4Audio as Tiny
from mrv2_gemma.testing import audio_noise, check_audio_against_hf

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    return Tiny(tmp_path_factory.mktemp("gemma4_audio"))


@pytest.fixture(scope="module")
def llm(tiny: Tiny) -> LLM:
    return LLM(str(tiny.path), device="cpu", dtype="float32", block_size=4,
               max_num_batched_tokens=80, limit_mm_per_prompt=2)


def test_prefixes_and_token_count(tiny: Tiny) -> None:
    assert set(AUDIO_CHECKPOINT_PREFIXES) == {
        "model.audio_tower.", "audio_tower.", "model.embed_audio.", "embed_audio."}
    for seconds in (0.01, 0.0101, 0.05, 0.23, 1.0):  # HF's count: the valid-frame mask's
        mask = tiny.extractor([audio_noise(seconds, 0)])["input_features_mask"][0]
        assert audio_tokens(int(mask.sum())) == int(mask[::2][::2].sum())


@pytest.mark.parametrize("layout", ["saved", "no_model_prefix"])
def test_encoder_matches_hf(tiny: Tiny, layout: str) -> None:
    """Every parameter and buffer loaded (from the saved files, or named without ``model.``);
    each clip alone gives its valid rows of HF's batched ``get_audio_features`` (fp32)."""
    weights = iter_safetensors(tiny.path)
    if layout == "no_model_prefix":
        weights = ((name.removeprefix("model."), tensor) for name, tensor in weights)
    encoder = Gemma4AudioEncoder(tiny.hf.config).eval()
    loaded = encoder.load_weights(weights)
    assert loaded == set(encoder.state_dict())
    clips = [audio_noise(s, i) for i, s in enumerate((0.23, 0.41, 0.07))]
    batch = tiny.extractor(clips, return_tensors="pt")
    with torch.no_grad():
        ref = tiny.hf.model.get_audio_features(batch["input_features"],
                                               batch["input_features_mask"], return_dict=True)
        for n, clip in enumerate(clips):
            one = tiny.extractor([clip], return_tensors="pt")
            frames = int(one["input_features_mask"][0].sum())
            mine = encoder(one["input_features"][0, :frames])
            want = ref.pooler_output[n][ref.attention_mask[n]]
            assert mine.shape == want.shape == (audio_tokens(frames), TEXT["hidden_size"])
            torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-5 * want.abs().max())
        assert len({int(m.sum()) for m in ref.attention_mask}) == 3  # (3 lengths: padding)
        with pytest.raises(ValueError, match=r"input_features \(5, 20\)"):
            encoder(torch.randn(5, 20))


def test_encoder_refuses_configs() -> None:
    for field, value, message in [("hidden_act", "tanh", "hidden_act"),
                                  ("subsampling_conv_channels", [2, 8], "channel counts"),
                                  ("num_attention_heads", 3, "hidden_size 32")]:
        bad = transformers.Gemma4Config(text_config=TEXT, vision_config=None,
                                        audio_config={**AUDIO, field: value})
        with pytest.raises(ValueError, match=message):
            Gemma4AudioEncoder(bad)


def test_greedy_tokens_match_hf_with_audio(tiny: Tiny, llm: LLM,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from mrv2.contract import encoder_cache

    parts: list[tuple[int, int]] = []  # (rows a step computes of an item, the item's length)
    rows_of = encoder_cache.placeholder_rows

    def counted(batch: Any, index: int, offset: int, length: int) -> Any:
        rows, within = rows_of(batch, index, offset, length)
        if len(rows):
            parts.append((len(rows), length))
        return rows, within

    monkeypatch.setattr(encoder_cache, "placeholder_rows", counted)
    a, b = audio_noise(0.23, 1), audio_noise(3.3, 2)  # (b: more tokens than a step computes)
    slow = audio_noise(0.3, 3, rate=22050)  # (resampled to 16 kHz)
    image = random_image(32, 32, seed=4)
    au, im = tiny.audio, tiny.image
    prompts: list[tuple[list[int], dict[str, Any], list[np.ndarray]]] = [
        ([5, 17, au, 42, 9], {"audio": (a, RATE)}, [a]),
        ([au, 64, 8, au, 50, 7], {"audio": [(b, RATE), (a, RATE)]}, [b, a]),
        ([im, 33, au, 12], {"image": [image], "audio": [(slow, 22050)]},
         [resample(slow, 22050, RATE)]),
        ([3, 4, 5, 6] * 3, {}, [])]
    # (encoder runs: clips a, b, the resampled one and the image)
    expanded = check_audio_against_hf(llm, tiny, prompts, encoder_runs=4, logprobs_of=1)
    lengths = []
    for ids, items in expanded:
        for item in (i for i in items if i.kind == "audio"):
            assert ids[item.offset - 1] == tiny.boa and ids[item.offset + item.length] == tiny.eoa
            assert ids[item.offset: item.offset + item.length] == [tiny.audio] * item.length
            assert not item.bidirectional and item.content_hash.startswith("audio:")
            lengths.append(item.length)
    assert [i.kind for i in expanded[2][1]] == ["image", "audio"]
    assert len(set(lengths)) == 3  # (three clip lengths)
    assert any(0 < n < length for n, length in parts)  # a step computed part of an item
    # the clip given as a torch tensor, or bare at 16 kHz, is the same item
    processor = llm.engine.input_processor
    assert processor is not None
    ids, items = processor.process([5, 17, au, 42, 9], {"audio": torch.from_numpy(a)})
    assert (ids, items[0].content_hash) == (expanded[0][0], expanded[0][1][0].content_hash)


def test_audio_refused_naming_the_field(tiny: Tiny, llm: LLM, tmp_path: Path) -> None:
    processor = llm.engine.input_processor
    assert processor is not None
    clip, au = audio_noise(0.1, 5), tiny.audio
    cases: list[tuple[dict[str, Any], str]] = [
        ({"audio": (clip, "16k")}, "the sampling rate must be a positive integer"),
        ({"audio": [(clip, 0)]}, "the sampling rate must be a positive integer"),
        ({"audio": [(clip, 16000.5)]}, "the sampling rate must be a positive integer"),
        ({"audio": [(clip, True)]}, "the sampling rate must be a positive integer"),
        ({"audio": [(clip.tolist(), RATE)]}, "samples must be a 1-D float"),
        ({"audio": (np.stack([clip, clip]), RATE)}, "non-empty 1-D float array"),
        ({"audio": ((clip * 1000).astype(np.int16), RATE)}, "non-empty 1-D float array"),
        ({"audio": (np.full(4, np.nan, np.float32), RATE)}, "finite"),
        ({"audio": [(clip, RATE), (clip, RATE)]}, "2 clips but the prompt has 1 audio"),
        ({"audio": [(clip, RATE)] * 3}, "3 clips; at most 2 per prompt"),
        ({"audio": (clip[:160], RATE)}, "too short; at least 161 samples"),
        ({"video": [clip]}, r"multi_modal_data\.video\[0\]: a numpy clip must be "),
        ({"speech": [clip]}, r"unsupported keys \['speech'\]; allowed: 'image', 'audio', "
                             r"'video'"),
    ]
    for data, message in cases:
        with pytest.raises(ValueError, match=message):
            processor.process([5, au, 9], data)
    ids, items = processor.process([5, au, 9], {"audio": (clip[:161], RATE)})
    assert [i.length for i in items] == [1]
    with pytest.raises(ValueError, match=re.escape("multi_modal_data.audio[0]")):
        llm.generate([{"prompt_token_ids": [5, au], "multi_modal_data": {"audio": (clip, "x")}}],
                     GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    # a checkpoint without the extractor's settings, or with a mel count the tower can't take
    from mrv2_gemma.gemma4_inputs import Gemma4InputProcessor

    wide = json.loads(tiny.extractor.to_json_string()) | {"feature_size": 64}
    for files, message in [({}, "no audio feature extractor in"),
                           ({"processor_config.json": {"feature_extractor": wide}},
                            "the feature extractor's feature_size 64 does not fit "
                            "audio_config.subsampling_conv_"
                            r"channels\[0\] 32 \(mel bins 29 .. 32\)")]:
        for name, body in files.items():
            (tmp_path / name).write_text(json.dumps(body))
        other = Gemma4InputProcessor(str(tmp_path), tiny.hf.config, None, llm.engine.config)
        with pytest.raises(ValueError, match="multi_modal_data.audio: " + message):
            other.process([5, au, 9], {"audio": (clip, RATE)})


def _wav(samples: np.ndarray, rate: int, channels: int = 1) -> str:
    """Base64 of 16-bit PCM WAV bytes (``samples`` repeated over the channels)."""
    pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(np.repeat(pcm, channels).tobytes())
    return base64.b64encode(buffer.getvalue()).decode()


def test_openai_chat_takes_input_audio(tiny: Tiny, llm: LLM) -> None:
    """``mrv2 serve``'s chat endpoint and ``LLM.chat`` with OpenAI ``input_audio`` parts (a
    stereo WAV at 22.05 kHz and a mono one at 16 kHz): the reply is ``generate``'s on the
    template's ids with the decoded clips; a bad part is a 400 naming the messages."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from mrv2.entrypoints.server import create_app
    from mrv2.testing import serve_in_thread

    first, second = audio_noise(0.2, 6, rate=22050), audio_noise(0.15, 7)
    content = [{"type": "text", "text": "Hello "},
               {"type": "input_audio", "input_audio": {"data": _wav(first, 22050, 2),
                                                       "format": "wav"}},
               {"type": "text", "text": " world"},
               {"type": "input_audio", "input_audio": {"data": _wav(second, RATE),
                                                       "format": "wav"}}]
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "Hello "}, {"type": "audio"}, {"type": "text", "text": " world"},
        {"type": "audio"}]}])
    assert ids.count(tiny.audio) == 2
    pcm = [np.round(c * 32767).astype(np.float32) / 32768 for c in (first, second)]
    data = {"audio": [(pcm[0], 22050), (pcm[1], RATE)]}
    want = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": data}], GREEDY,
                        use_tqdm=False)
    text = "<|user|>Hello <|audio|> world<|audio|></s><|assistant|>"  # (a text prompt too)
    assert tokenizer.encode(text) == ids
    assert llm.generate([{"prompt": text, "multi_modal_data": data}], GREEDY, use_tqdm=False
                        )[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    chat = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
    assert chat[0].outputs[0].token_ids == want[0].outputs[0].token_ids  # LLM.chat alike
    for url in serve_in_thread(create_app(llm.engine, served_model_name="tiny")):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": content}], max_tokens=6,
            temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].message.content == want[0].outputs[0].text
        assert out.usage.prompt_tokens == len(want[0].prompt_token_ids)
        for spec, message in [({"data": "AAAA", "format": "wav"}, "could not decode the WAV"),
                              ({"data": _wav(second, RATE), "format": "mp3"},
                               "unsupported 'mp3'; allowed: 'wav'")]:
            with pytest.raises(openai.BadRequestError, match=message) as caught:
                client.chat.completions.create(
                    model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
                        {"type": "input_audio", "input_audio": spec}]}])
            assert caught.value.status_code == 400


def test_resample_is_band_limited() -> None:
    """Tones below the new Nyquist come through (interior samples within 3e-3 of the tone
    sampled at the new rate, both ways); a tone above it is filtered out; the same rate is
    the identity; lengths are ``ceil(n * up / down)``."""
    for rate, target in [(44100, 16000), (48000, 16000), (8000, 16000), (22050, 16000)]:
        t = np.arange(rate // 2) / rate
        tone = lambda s: np.sin(2 * np.pi * 440 * s) + 0.5 * np.sin(2 * np.pi * 2500 * s + 0.3)
        out = resample(tone(t), rate, target)
        assert out.dtype == np.float32 and len(out) == -(-len(t) * target // rate)
        inner = slice(100, len(out) - 100)
        assert np.abs(out - tone(np.arange(len(out)) / target))[inner].max() < 3e-3
        if target < rate:
            high = resample(np.sin(2 * np.pi * 12000 * t), rate, target)[inner]
            assert np.sqrt(np.mean(high ** 2)) < 2e-3
    same = audio_noise(0.1, 8)
    assert np.array_equal(resample(same, RATE, RATE), same)


def test_audio_clips_forms() -> None:
    clip = audio_noise(0.05, 9)
    assert [r for _, r in audio_clips((clip, 8000))] == [8000]
    assert [r for _, r in audio_clips([(clip, 8000.0), clip])] == [8000, None]
    assert [r for _, r in audio_clips((clip, clip))] == [None, None]  # (two bare clips)
    assert audio_clips(None) == [] and audio_clips([]) == []
    (half, _), = audio_clips(torch.from_numpy(clip).to(torch.bfloat16))
    assert half.dtype == np.float32
    with pytest.raises(ValueError, match=re.escape("multi_modal_data.audio[0]: a clip is")):
        audio_clips([(clip, RATE, 1)])


def test_feature_extractor_lookup(tmp_path: Path) -> None:
    """``processor_config.json``'s section first, then a ``preprocessor_config.json`` of the
    type; none, or an image processor's file alone, is a FileNotFoundError; another type a
    ValueError."""
    name = "Gemma4AudioFeatureExtractor"
    with pytest.raises(FileNotFoundError, match="no audio feature extractor"):
        load_feature_extractor(tmp_path, name)
    transformers.Gemma4ImageProcessorPil().save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no audio feature extractor"):
        load_feature_extractor(tmp_path, name)
    flat = transformers.Gemma4AudioFeatureExtractor(feature_size=40)
    (tmp_path / "preprocessor_config.json").write_text(flat.to_json_string())
    assert load_feature_extractor(tmp_path, name).feature_size == 40
    nested = {"feature_extractor": {**json.loads(flat.to_json_string()), "feature_size": 48}}
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    assert load_feature_extractor(tmp_path, name).feature_size == 48
    nested["feature_extractor"]["feature_extractor_type"] = "WhisperFeatureExtractor"
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    with pytest.raises(ValueError, match="'WhisperFeatureExtractor'"):
        load_feature_extractor(tmp_path, name)


def test_a_clip_at_a_tiny_rate_is_resampled_only_as_far_as_the_extractor_reads(tiny: Tiny
                                                                                ) -> None:
    """A clip declared at 1 Hz (a WAV header's rate, say) grows 16000-fold when resampled:
    only the extractor's 30 s are computed, and ``limit`` gives the full output's first
    samples."""
    from mrv2_gemma.gemma4_inputs import MAX_AUDIO_SAMPLES, Gemma4InputProcessor

    clip = audio_noise(0.1, 9)
    assert np.array_equal(resample(clip, 4000, RATE, limit=700), resample(clip, 4000, RATE)[:700])
    lengths: list[int] = []

    class Counted:
        sampling_rate = tiny.extractor.sampling_rate

        def __call__(self, clips: list[np.ndarray], **kwargs: Any) -> Any:
            lengths.append(len(clips[0]))
            return tiny.extractor(clips, **kwargs)

    stub: Any = SimpleNamespace(require_audio=Counted)
    features = Gemma4InputProcessor.audio_features(stub, 0, audio_noise(0.5, 9), 1)
    assert lengths == [MAX_AUDIO_SAMPLES] and len(features) > 0
