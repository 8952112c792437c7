"""Incremental detokenizer: deltas concatenate to the full decode; stop strings."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as RawTokenizer
from transformers import PreTrainedTokenizerFast

from mrv2.engine.detokenizer import IncrementalDetokenizer
from mrv2.engine.tokenizer import Tokenizer

CORPUS = [
    "The capital of France is Paris. The capital of Japan is Tokyo.",
    "Hello world, hello tokenizer! Stop here: STOP and END.",
    "naïve café — 東京 は 日本 の 首都 です 😀 🇫🇷 👍🏽",
    "def f(x):\n    return x + 1  # two  spaces\n\n",
]
SPECIALS = ["<unk>", "<s>", "</s>", "<|end|>"]
MIXED_TEXT = "Paris 東京 😀 naïve 👍🏽 — 🇫🇷 done.\n  x = 1 \u00e9\u0301"


def _wrap(raw: RawTokenizer) -> Tokenizer:
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|end|>"],
    )
    return Tokenizer(hf)


def byte_level_bpe() -> Tokenizer:
    """GPT-2 style: byte-level BPE, characters split over several tokens."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        show_progress=False,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(CORPUS, trainer)
    return _wrap(raw)


def _sentencepiece_bpe(metaspace: bool) -> RawTokenizer:
    """Llama style: "▁" word markers, <0xNN> byte-fallback tokens, a stripped leading space."""
    trained = RawTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, limit_alphabet=60, show_progress=False)
    trained.train_from_iterator(CORPUS, trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for tok in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(tok, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    raw = RawTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    raw.add_special_tokens(SPECIALS)
    if metaspace:
        raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        raw.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")]
        )
    else:
        raw.normalizer = normalizers.Sequence(
            [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
        )
        raw.decoder = decoders.Sequence(
            [
                decoders.Replace("\u2581", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    return raw


def sentencepiece_llama() -> Tokenizer:
    return _wrap(_sentencepiece_bpe(metaspace=False))


def sentencepiece_metaspace() -> Tokenizer:
    return _wrap(_sentencepiece_bpe(metaspace=True))


def char_level() -> Tokenizer:
    """One token per character: stop strings always span several tokens."""
    chars = sorted(
        set("".join(CORPUS)) | set("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    )
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.add_special_tokens(SPECIALS)
    return _wrap(raw)


def smollm2() -> Tokenizer:
    """The real SmolLM2 tokenizer: the converted default model, else straight from the GGUF."""
    from mrv2.model_loader import default_model

    model_dir = default_model.default_model_dir()
    if default_model.is_complete(model_dir):
        return Tokenizer(model_dir)
    try:
        gguf = default_model.find_default_gguf()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 tokenizer unavailable: {e}")
    return Tokenizer(default_model.load_gguf_tokenizer(gguf))


FACTORIES: dict[str, Callable[[], Tokenizer]] = {
    "byte_level_bpe": byte_level_bpe,
    "sentencepiece_llama": sentencepiece_llama,
    "sentencepiece_metaspace": sentencepiece_metaspace,
    "smollm2": smollm2,
}
_CACHE: dict[str, Tokenizer] = {}


@pytest.fixture(params=sorted(FACTORIES))
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    name = request.param
    if name not in _CACHE:
        _CACHE[name] = FACTORIES[name]()
    return _CACHE[name]


def _stream(
    tok: Tokenizer, ids: list[int], rng: random.Random, skip: bool = True
) -> tuple[IncrementalDetokenizer, list[str]]:
    det = IncrementalDetokenizer(tok, [1, 2, 3], skip_special_tokens=skip)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 1, 2, 3, 5])
        deltas.append(det.add_tokens(ids[i : i + n]))
        i += n
    return det, deltas


def test_text_roundtrip_multibyte(tok: Tokenizer) -> None:
    ids = tok.encode(MIXED_TEXT * 2, add_special_tokens=False)
    det, deltas = _stream(tok, ids, random.Random(0))
    # A final run of byte-fallback tokens is only released by flush (the request's end).
    deltas.append(det.flush())
    assert "".join(deltas) == det.output_text == tok.decode(ids)
    assert "\ufffd" not in det.output_text
    assert det.flush() == ""
    assert det.output_token_ids == ids


def test_token_by_token_never_emits_partial_chars(tok: Tokenizer) -> None:
    ids = tok.encode("😀🇫🇷東京👍🏽", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [])
    for i in ids:
        assert "\ufffd" not in det.add_tokens([i])
    assert "\ufffd" not in det.flush()
    assert det.output_text == tok.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_full_decode(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(1234 + skip)
    specials = tok.all_special_ids
    for _ in range(150):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        for _ in range(rng.randrange(3)):  # sprinkle special tokens in
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        det, deltas = _stream(tok, ids, rng, skip)
        tail = det.flush()
        full = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) + tail == det.output_text == full, ids


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    eos = tok.eos_token_id
    assert eos is not None
    ids = tok.encode("Hello world", add_special_tokens=False) + [eos]
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    kept.add_tokens(ids)
    assert kept.output_text == tok.decode(ids, skip_special_tokens=False)
    assert kept.output_text.endswith(tok.convert_ids_to_tokens([eos])[0])
    skipped = IncrementalDetokenizer(tok, [])
    skipped.add_tokens(ids)
    assert skipped.output_text == tok.decode(ids[:-1])


def test_prompt_context_keeps_leading_space() -> None:
    tok = sentencepiece_llama()
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    full = tok.encode("The capital of France is Paris", add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    output = full[len(prompt) :]
    plain = IncrementalDetokenizer(tok, prompt)
    plain.add_tokens(output)
    assert plain.output_text == tok.decode(output) == "Paris"
    context = IncrementalDetokenizer(tok, prompt, use_prompt_context=True)
    context.add_tokens(output)
    assert context.output_text == " Paris"
    assert context.output_token_ids == output


def test_flush_releases_incomplete_character() -> None:
    tok = byte_level_bpe()
    ids = tok.encode("ok 🎉", add_special_tokens=False)  # not in CORPUS: several tokens
    det = IncrementalDetokenizer(tok, [])
    for n in range(1, len(ids)):
        det.add_tokens(ids[n - 1 : n])
    partial = tok.decode(ids[:-1])  # the emoji's last byte is missing
    assert partial.endswith("\ufffd") and det.output_text.startswith("ok")
    assert "\ufffd" not in det.output_text
    assert det.output_text + det.flush() == partial == det.output_text


def _feed_until_stop(
    tok: Tokenizer, text: str, stop: list[str], include: bool = False
) -> tuple[IncrementalDetokenizer, str | None, int]:
    det = IncrementalDetokenizer(tok, [])
    ids = tok.encode(text, add_special_tokens=False)
    for n, i in enumerate(ids):
        det.add_tokens([i])
        matched = det.check_stop(stop, include)
        if matched is not None:
            return det, matched, n + 1
    return det, None, len(ids)


def test_stop_string_across_tokens() -> None:
    tok = char_level()
    det, matched, n = _feed_until_stop(tok, "Hello world! STOP and more", ["STOP"])
    assert matched == "STOP" and det.stop_reason == "STOP" and det.stopped
    assert det.output_text == "Hello world! "
    assert n == len("Hello world! STOP")  # found on the token that completed it
    # Frozen afterwards.
    assert det.add_tokens(tok.encode("xyz", add_special_tokens=False)) == ""
    assert det.output_text == "Hello world! "
    assert det.check_stop(["STOP"]) == "STOP"


def test_stop_string_included() -> None:
    tok = char_level()
    det, matched, _ = _feed_until_stop(tok, "Hello END world", ["END", "zzz"], include=True)
    assert matched == "END" and det.output_text == "Hello END"


def test_stop_earliest_of_several() -> None:
    tok = char_level()
    det = IncrementalDetokenizer(tok, [])
    det.add_tokens(tok.encode("abc hello STOP END", add_special_tokens=False))
    # Checked in one go: the earliest match wins, not the first listed.
    assert det.check_stop(["END", "hello", "STOP"]) == "hello"
    assert det.output_text == "abc "


def test_stop_in_multi_token_delta_with_real_tokenizer(tok: Tokenizer) -> None:
    ids = tok.encode("The capital of France is Paris. Tokyo is 東京.", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [])
    rng = random.Random(7)
    i, matched = 0, None
    while i < len(ids) and matched is None:
        n = rng.choice([1, 2, 3])
        det.add_tokens(ids[i : i + n])
        i += n
        matched = det.check_stop(["京", "is Par"])
    assert matched == "is Par"
    assert det.output_text == "The capital of France "


def test_stop_search_region_is_bounded() -> None:
    """Only the last delta and len(stop) - 1 characters before it are searched."""
    tok = char_level()
    det = IncrementalDetokenizer(tok, [])
    det.add_tokens(tok.encode("aaa END bbb", add_special_tokens=False))
    det.add_tokens(tok.encode(" ccc", add_special_tokens=False))
    assert det.check_stop(["END"]) is None  # "END" lies before the searched region
    det.add_tokens(tok.encode("EN", add_special_tokens=False))
    assert det.check_stop(["END"]) is None
    det.add_tokens(tok.encode("D!", add_special_tokens=False))  # completes "END" across deltas
    assert det.check_stop(["END"]) == "END"
    assert det.output_text == "aaa END bbb ccc"


def test_stop_not_checked_on_empty_delta() -> None:
    tok = byte_level_bpe()
    det = IncrementalDetokenizer(tok, [])
    det.add_tokens(tok.encode("say STOP", add_special_tokens=False))
    assert det.add_tokens([tok.all_special_ids[0]]) == ""  # a skipped special token
    assert det.check_stop(["STOP"]) is None


def test_stream_delta_holds_back_partial_stop() -> None:
    tok = char_level()
    det = IncrementalDetokenizer(tok, [])
    stop = ["STOP"]
    hold = max(map(len, stop)) - 1
    streamed = []
    for i in tok.encode("Hello STOP there", add_special_tokens=False):
        det.add_tokens([i])
        if det.check_stop(stop) is not None:
            streamed.append(det.stream_delta(finished=True))
            break
        streamed.append(det.stream_delta(holdback=hold))
    assert "".join(streamed) == "Hello "
    assert not any("S" in s for s in streamed)


def test_empty_inputs(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, [])
    assert det.add_tokens([]) == ""
    assert det.check_stop([]) is None
    assert det.check_stop(["", "x"]) is None
    assert det.flush() == "" and det.output_text == "" and det.stream_delta(True) == ""


def test_cost_is_independent_of_output_length() -> None:
    """Each add_tokens call decodes a bounded window, not all the output."""
    tok = byte_level_bpe()
    decoded_lengths: list[int] = []
    real_decode = tok.decode

    def counting_decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        decoded_lengths.append(len(ids))
        return real_decode(ids, skip_special_tokens)

    tok.decode = counting_decode  # type: ignore[method-assign]
    ids = tok.encode(MIXED_TEXT * 40, add_special_tokens=False)
    det = IncrementalDetokenizer(tok, [])
    for i in ids:
        det.add_tokens([i])
    assert len(ids) > 300
    assert max(decoded_lengths) <= 8
    assert det.output_text == real_decode(ids)


def test_byte_fallback_run_held_until_it_ends() -> None:
    tok = sentencepiece_llama()
    text = "가나다라마바사아자차카타"  # not in CORPUS: 3 byte-fallback tokens per character
    ids = tok.encode(text + " is", add_special_tokens=False)
    assert sum(i in tok.byte_fallback_ids for i in ids) >= 36
    det = IncrementalDetokenizer(tok, [])
    emitted_in_run = []
    for i in ids:
        emitted_in_run.append(det.add_tokens([i]))
    # Held while the run is short, released once it passes the cap, exact at the end.
    assert not any(emitted_in_run[:30]) and any(emitted_in_run[:36])
    assert det.output_text + det.flush() == tok.decode(ids)
    assert "\ufffd" not in det.output_text
