"""Incremental detokenizer: deltas concatenate to the full decode; stop strings.

Every behaviour is checked on both decoding paths: ``DecodeStream`` (what a fast tokenizer gets)
and Python windows (``decode_stream=False``: a slow tokenizer, and the stream's fallback). The
reference is always ``Tokenizer.decode`` of the whole output.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Iterable
from typing import Any

import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RawTokenizer

from mrv2.bench.detokenize import (
    CORPUS,
    SPECIALS,
    TEXT,
    adversarial_cases,
    byte_level_bpe,
    sentencepiece_bpe,
    wrap,
)
from mrv2.engine.detokenizer import _MAX_BYTE_RUN, IncrementalDetokenizer
from mrv2.engine.tokenizer import Tokenizer

MIXED_TEXT = "Paris 東京 😀 naïve 👍🏽 — 🇫🇷 done.\n  x = 1 \u00e9\u0301"


def sentencepiece_llama() -> Tokenizer:
    """Llama-2's decoder chain: Replace, ByteFallback, Fuse, Strip."""
    return sentencepiece_bpe(metaspace=False)


def sentencepiece_metaspace() -> Tokenizer:
    """Newer sentencepiece conversions: ByteFallback, Metaspace."""
    return sentencepiece_bpe(metaspace=True)


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
    return wrap(raw)


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


class SlowTokenizer(Tokenizer):
    """A tokenizer without a Rust backend to stream with (like HF's Python tokenizers)."""

    @property
    def backend(self) -> Any:
        return None


FACTORIES: dict[str, Callable[[], Tokenizer]] = {
    "byte_level_bpe": byte_level_bpe,
    "sentencepiece_llama": sentencepiece_llama,
    "sentencepiece_metaspace": sentencepiece_metaspace,
    "smollm2": smollm2,
    "char_level": char_level,
}
_CACHE: dict[str, Tokenizer] = {}


def _get(name: str) -> Tokenizer:
    if name not in _CACHE:
        _CACHE[name] = FACTORIES[name]()
    return _CACHE[name]


@pytest.fixture(params=sorted(set(FACTORIES) - {"char_level"}))
def tok(request: pytest.FixtureRequest) -> Tokenizer:
    return _get(request.param)


@pytest.fixture(params=[True, False], ids=["stream", "window"])
def decode_stream(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def _detok(
    tok: Tokenizer, decode_stream: bool, prompt: list[int] | None = None, skip: bool = True,
    **kwargs: Any,
) -> IncrementalDetokenizer:
    det = IncrementalDetokenizer(tok, prompt or [], skip, decode_stream=decode_stream, **kwargs)
    # A fast tokenizer streams through DecodeStream unless told not to.
    assert (det._stream is not None) == (decode_stream and tok.backend is not None)
    return det


def _feed_chunks(
    det: IncrementalDetokenizer, ids: list[int], rng: random.Random
) -> list[str]:
    """Feed ``ids`` in random chunks (1 to 5 ids a call), then flush; return the deltas."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 1, 2, 3, 5])
        deltas.append(det.add_tokens(ids[i : i + n]))
        i += n
    deltas.append(det.flush())
    return deltas


def _assert_exact(deltas: list[str], det: IncrementalDetokenizer, full: str, case: Any) -> None:
    assert "".join(deltas) == det.output_text == full, case
    if "\ufffd" not in full:  # a U+FFFD in a delta is never one of an incomplete character
        assert not any("\ufffd" in d for d in deltas), (case, deltas)


def test_text_roundtrip_multibyte(tok: Tokenizer, decode_stream: bool) -> None:
    ids = tok.encode(MIXED_TEXT * 2, add_special_tokens=False)
    det = _detok(tok, decode_stream)
    deltas = _feed_chunks(det, ids, random.Random(0))
    # A final run of byte-fallback tokens is only released by flush (the request's end).
    _assert_exact(deltas, det, tok.decode(ids), ids)
    assert "\ufffd" not in det.output_text
    assert det.flush() == ""
    assert det.output_token_ids == ids


def test_token_by_token_never_emits_partial_chars(tok: Tokenizer, decode_stream: bool) -> None:
    ids = tok.encode("😀🇫🇷東京👍🏽", add_special_tokens=False)
    det = _detok(tok, decode_stream)
    for i in ids:
        assert "\ufffd" not in det.add_tokens([i])
    assert "\ufffd" not in det.flush()
    assert det.output_text == tok.decode(ids)


def test_adversarial_ids_match_full_decode(tok: Tokenizer, decode_stream: bool) -> None:
    """Random ids, byte-fallback-heavy ids, text cut mid-character, special tokens in between
    (``skip_special_tokens`` both ways): the deltas join to the decode, fed in any chunks."""
    rng = random.Random(1234)
    for ids, skip in adversarial_cases(tok, 400, seed=7):
        det = _detok(tok, decode_stream, skip=skip)
        deltas = _feed_chunks(det, ids, rng)
        _assert_exact(deltas, det, tok.decode(ids, skip_special_tokens=skip), (ids, skip))


@pytest.mark.parametrize("skip", [True, False])
def test_byte_fallback_minimal_cases(decode_stream: bool, skip: bool) -> None:
    """What raw DecodeStream gets wrong: a later stray byte turns the run into U+FFFDs.

    ``<0x4D><0xCF>`` decodes to two U+FFFD (DecodeStream emits "M"); ``<0x6A><0xEC>a`` to
    U+FFFD U+FFFD "a" (DecodeStream raises "Invalid prefix"); a lone ``<0x89>`` to U+FFFD
    (DecodeStream never emits it).
    """
    tok = _get("sentencepiece_llama")
    vocab = tok.hf.get_vocab()
    eos = tok.eos_token_id
    assert eos is not None

    def byte(b: int) -> int:
        return int(vocab[f"<0x{b:02X}>"])

    a = tok.encode("a", add_special_tokens=False)
    for ids in ([byte(0x4D), byte(0xCF)], [byte(0x6A), byte(0xEC), *a], [byte(0x89)],
                [byte(0x6A), eos, byte(0xEC), *a], [*a, byte(0xE6), byte(0x9D), byte(0xB1)]):
        det = _detok(tok, decode_stream, skip=skip)
        deltas = [det.add_tokens([i]) for i in ids] + [det.flush()]
        _assert_exact(deltas, det, tok.decode(ids, skip_special_tokens=skip), ids)


def test_special_tokens_skipped_or_kept(tok: Tokenizer, decode_stream: bool) -> None:
    eos = tok.eos_token_id
    assert eos is not None
    ids = tok.encode("Hello world", add_special_tokens=False) + [eos]
    kept = _detok(tok, decode_stream, skip=False)
    kept.add_tokens(ids)
    assert kept.output_text == tok.decode(ids, skip_special_tokens=False)
    assert kept.output_text.endswith(tok.convert_ids_to_tokens([eos])[0])
    skipped = _detok(tok, decode_stream)
    skipped.add_tokens(ids)
    assert skipped.output_text == tok.decode(ids[:-1])


def wordpiece() -> Tokenizer:
    """BERT's decoder: WordPiece joins tokens with spaces, added tokens included."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for word in ("hello", "world", "##s"):
        vocab[word] = len(vocab)
    raw = RawTokenizer(models.WordPiece(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece()
    raw.add_special_tokens(SPECIALS)
    return wrap(raw)


@pytest.mark.parametrize("prompt", [[], [3]])
def test_no_spaces_between_special_tokens(decode_stream: bool, prompt: list[int]) -> None:
    """vLLM's fast detokenizer with ``spaces_between_special_tokens=False`` and special tokens
    kept: an added token right after an added token comes as its bare text (the prompt's
    last token does not count); with the default, or skipping them, it is the decode."""
    tok = wordpiece()
    ids = [4, 3, 2, 5, 1, 2, 2]  # hello <|end|> </s> world <s> </s> </s>
    full = tok.decode(ids, skip_special_tokens=False)
    assert full == "hello <|end|> </s> world <s> </s> </s>"
    det = _detok(tok, decode_stream, prompt, skip=False, spaces_between_special_tokens=False)
    deltas = [det.add_tokens([i]) for i in ids[:3]] + [det.add_tokens(ids[3:]), det.flush()]
    assert "".join(deltas) == det.output_text == "hello <|end|></s> world <s></s></s>"
    for skip, spaces in ((False, True), (True, False)):
        det = _detok(tok, decode_stream, prompt, skip=skip, spaces_between_special_tokens=spaces)
        det.add_tokens(ids)
        det.flush()
        assert det.output_text == tok.decode(ids, skip_special_tokens=skip)
    for other in (byte_level_bpe(), sentencepiece_llama()):  # no space there to drop
        ids = other.encode("hello", add_special_tokens=False) + [3, 2, 1, 3]
        det = _detok(other, decode_stream, skip=False, spaces_between_special_tokens=False)
        det.add_tokens(ids)
        assert det.output_text == other.decode(ids, skip_special_tokens=False)


def test_prompt_context_keeps_leading_space(decode_stream: bool) -> None:
    tok = _get("sentencepiece_llama")
    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    full = tok.encode("The capital of France is Paris", add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    output = full[len(prompt) :]
    plain = _detok(tok, decode_stream, prompt)
    plain.add_tokens(output)
    assert plain.output_text == tok.decode(output) == "Paris"
    context = _detok(tok, decode_stream, prompt, use_prompt_context=True)
    context.add_tokens(output)
    assert context.output_text == " Paris"
    assert context.output_token_ids == output
    # A prompt ending in a byte-fallback run (Llama-2's "\n" is <0x0A>): the run is no
    # context (the output could continue it), the tokens before it are, so "Paris" keeps its
    # space, as in the decode of prompt + output.
    ending = prompt + tok.encode("가", add_special_tokens=False)
    assert ending[-1] in tok.byte_fallback_ids
    assert tok.decode(ending + output).endswith("가 Paris")
    det = _detok(tok, decode_stream, ending, use_prompt_context=True)
    det.add_tokens(output)
    assert det.output_text == " Paris" and det.output_token_ids == output
    # The output going on with bytes: they decode after the context, the prompt's run apart.
    more = [int(tok.hf.get_vocab()[f"<0x{b:02X}>"]) for b in "나".encode()]
    det = _detok(tok, decode_stream, ending, use_prompt_context=True)
    assert det.add_tokens(more + output) == "나 Paris"
    # Nothing but a byte run near the end of the prompt: no context.
    det = _detok(tok, decode_stream, more * 50, use_prompt_context=True)
    det.add_tokens(output)
    assert det.output_text == "Paris"


def test_flush_releases_incomplete_character(decode_stream: bool) -> None:
    tok = _get("byte_level_bpe")
    ids = tok.encode("ok 🎉", add_special_tokens=False)  # not in CORPUS: several tokens
    det = _detok(tok, decode_stream)
    for n in range(1, len(ids)):
        det.add_tokens(ids[n - 1 : n])
    partial = tok.decode(ids[:-1])  # the emoji's last byte is missing
    assert partial.endswith("\ufffd") and det.output_text.startswith("ok")
    assert "\ufffd" not in det.output_text
    assert det.output_text + det.flush() == partial == det.output_text


def _feed_until_stop(
    tok: Tokenizer, text: str, stop: list[str], include: bool = False, decode_stream: bool = True
) -> tuple[IncrementalDetokenizer, str | None, int]:
    det = _detok(tok, decode_stream)
    ids = tok.encode(text, add_special_tokens=False)
    for n, i in enumerate(ids):
        det.add_tokens([i])
        matched = det.check_stop(stop, include)
        if matched is not None:
            return det, matched, n + 1
    return det, None, len(ids)


def test_stop_string_across_tokens(decode_stream: bool) -> None:
    tok = _get("char_level")
    det, matched, n = _feed_until_stop(
        tok, "Hello world! STOP and more", ["STOP"], decode_stream=decode_stream
    )
    assert matched == "STOP" and det.stop_reason == "STOP" and det.stopped
    assert det.output_text == "Hello world! "
    assert n == len("Hello world! STOP")  # found on the token that completed it
    # Frozen afterwards.
    assert det.add_tokens(tok.encode("xyz", add_special_tokens=False)) == ""
    assert det.output_text == "Hello world! "
    assert det.check_stop(["STOP"]) == "STOP"
    assert det.flush() == ""


def test_stop_string_included() -> None:
    tok = _get("char_level")
    det, matched, _ = _feed_until_stop(tok, "Hello END world", ["END", "zzz"], include=True)
    assert matched == "END" and det.output_text == "Hello END"


def test_stop_earliest_of_several() -> None:
    tok = _get("char_level")
    det = IncrementalDetokenizer(tok, [])
    det.add_tokens(tok.encode("abc hello STOP END", add_special_tokens=False))
    # Checked in one go: the earliest match wins, not the first listed.
    assert det.check_stop(["END", "hello", "STOP"]) == "hello"
    assert det.output_text == "abc "


def test_stop_in_multi_token_delta_with_real_tokenizer(tok: Tokenizer, decode_stream: bool) -> None:
    ids = tok.encode("The capital of France is Paris. Tokyo is 東京.", add_special_tokens=False)
    det = _detok(tok, decode_stream)
    rng = random.Random(7)
    i, matched = 0, None
    while i < len(ids) and matched is None:
        n = rng.choice([1, 2, 3])
        det.add_tokens(ids[i : i + n])
        i += n
        matched = det.check_stop(["京", "is Par"])
    assert matched == "is Par"
    assert det.output_text == "The capital of France "


def test_stop_strings_agree_across_paths(tok: Tokenizer) -> None:
    """Stop strings drawn from the text itself, one token at a time as the engine feeds: both
    paths stop on the same token with the same text, at the first occurrence in the decode."""
    rng = random.Random(3)
    ids = tok.encode(TEXT, add_special_tokens=False)
    full = tok.decode(ids)
    for _ in range(20):
        stops = []
        for _ in range(rng.randrange(1, 4)):
            begin = rng.randrange(len(full) - 1)
            stops.append(full[begin : begin + rng.randrange(1, 6)])
        include = rng.random() < 0.5
        results = []
        for decode_stream in (True, False):
            det = _detok(tok, decode_stream)
            fed = 0
            while fed < len(ids) and not det.stopped:
                det.add_tokens([ids[fed]])
                det.check_stop(stops, include)
                fed += 1
            results.append((fed, det.stop_reason, det.output_text))
        assert results[0] == results[1], stops
        _, matched, text = results[0]
        assert matched is not None  # every stop string occurs in the text
        start = len(text) - len(matched) if include else len(text)
        assert full.startswith(text) and full[start:].startswith(matched)
        assert not any(s in full[:start] for s in stops)  # none occurs wholly before it


def _stop_reference(tok: Tokenizer, context: list[int], out: list[int], stops: list[str],
                    include: bool, min_tokens: int) -> tuple[int, str, str | None]:
    """vLLM's stop rule on the decode: the first token k > min_tokens whose text (the decode
    of the output so far, after ``context``) holds a stop string ending past the text of the
    first min_tokens tokens (a character still incomplete there is not in it); the earliest
    such match is cut. Returns (tokens fed, text, stop string)."""
    base = tok.decode(context)

    def text(k: int) -> str:
        return tok.decode(context + out[:k])[len(base) :]

    boundary = len(text(min_tokens).rstrip("\ufffd")) if min_tokens else 0
    for k in range(min_tokens + 1, len(out) + 1):
        found = [(text(k).find(s, max(0, boundary - len(s) + 1)), s) for s in stops]
        hits = sorted((i, n, s) for n, (i, s) in enumerate(found) if i != -1)
        if hits:
            index, _, stop = hits[0]
            return k, text(k)[: index + (len(stop) if include else 0)], stop
    return len(out), text(len(out)), None


@pytest.mark.parametrize("name", ["byte_level_bpe", "sentencepiece_llama", "char_level"])
def test_stop_strings_match_the_reference(name: str) -> None:
    """Random text (CJK, emoji, byte-fallback runs), random stop strings taken from it,
    min_tokens and include_stop_str_in_output, fed as the engine feeds (one token a call, a
    prompt as context, text streamed every 1-3 tokens with the hold-back): where it stops,
    its text and stop string are the reference's, and the streamed deltas add up to it."""
    tok = _get(name)
    rng = random.Random(17)
    pieces = ["Hello", " world", " 東京", " 😀", "\n", " STOP", " naïve", "가나", ", ", "the"]
    for _ in range(60):
        prompt = tok.encode(rng.choice(["Hi there", "The capital is", ""]),
                            add_special_tokens=False)
        out = tok.encode("".join(rng.choice(pieces) for _ in range(rng.randrange(1, 12))),
                         add_special_tokens=False)
        full = tok.decode(out)
        if not full:  # (char_level has no CJK: <unk>)
            continue
        starts = [rng.randrange(len(full)) for _ in range(rng.randrange(1, 4))]
        stops = [full[b : b + rng.randrange(1, 6)] for b in starts] + ["not in the text"]
        include, min_tokens = rng.random() < 0.5, rng.choice([0, 0, 1, 2, 4])
        hold = 0 if include else max(map(len, stops)) - 1
        for decode_stream in (True, False):
            det = _detok(tok, decode_stream, prompt, use_prompt_context=True)
            streamed, fed = [], 0
            for fed, i in enumerate(out, 1):
                det.add_tokens([i])
                if fed == min_tokens:
                    det.skip_stop_check()
                if fed > min_tokens and det.check_stop(stops, include) is not None:
                    break
                if rng.random() < 0.5:
                    streamed.append(det.stream_delta(holdback=hold))
            det.flush()
            streamed.append(det.stream_delta(finished=True))
            context = det._ids[: det._num_context]
            case = (prompt, out, stops, include, min_tokens, decode_stream)
            assert (fed, det.output_text, det.stop_reason) == _stop_reference(
                tok, context, out, stops, include, min_tokens), case
            assert "".join(streamed) == det.output_text, case


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_in_a_held_byte_run(decode_stream: bool, include: bool) -> None:
    """A stop string whose text is still held (a byte run waits for the token that ends it)
    stops the request on the token that completes it, as vLLM's: the run is never cut short
    of it, and its text never reaches the output unless included."""
    tok = _get("sentencepiece_llama")
    newline = int(tok.hf.get_vocab()["<0x0A>"])
    det = _detok(tok, decode_stream)
    det.add_tokens(tok.encode("Hi", add_special_tokens=False))
    assert det.check_stop(["\n"], include) is None
    det.add_tokens([newline])
    assert det.check_stop(["\n"], include) == "\n"
    assert det.output_text == ("Hi\n" if include else "Hi")
    assert det.flush() == "" and det.stream_delta(finished=True) == det.output_text


def test_stop_strings_in_a_held_multibyte_run(decode_stream: bool) -> None:
    """A held run mid-character decodes to U+FFFDs (ByteFallback), which the check skips
    decoding: "다" stops on the byte that completes it, not before; a stop string holding
    U+FFFD still finds the U+FFFDs of a run that stays invalid (a stray byte)."""
    tok = _get("sentencepiece_llama")
    vocab = tok.hf.get_vocab()
    run = [int(vocab[f"<0x{b:02X}>"]) for b in "가나다라".encode()]
    det = _detok(tok, decode_stream)
    det.add_tokens(tok.encode("Hi", add_special_tokens=False))
    found = []
    for i in run:
        det.add_tokens([i])
        found.append(det.check_stop(["다", "xyz"]))
        if found[-1]:
            break
    assert found == [None] * 8 + ["다"] and det.output_text == "Hi가나"
    stray = [int(vocab["<0xE4>"]), *run[:2]]
    det = _detok(tok, decode_stream)
    det.add_tokens(tok.encode("Hi", add_special_tokens=False))
    for i in stray:
        det.add_tokens([i])
        if det.check_stop(["\ufffd\ufffd\ufffd"], True):
            break
    assert det.stop_reason == "\ufffd\ufffd\ufffd" and det.output_text == "Hi" + "\ufffd" * 3


def test_stop_search_region_is_bounded() -> None:
    """Only the last delta and len(stop) - 1 characters before it are searched."""
    tok = _get("char_level")
    det = IncrementalDetokenizer(tok, [])
    det.add_tokens(tok.encode("aaa END bbb", add_special_tokens=False))
    det.add_tokens(tok.encode(" ccc", add_special_tokens=False))
    assert det.check_stop(["END"]) is None  # "END" lies before the searched region
    det.add_tokens(tok.encode("EN", add_special_tokens=False))
    assert det.check_stop(["END"]) is None
    det.add_tokens(tok.encode("D!", add_special_tokens=False))  # completes "END" across deltas
    assert det.check_stop(["END"]) == "END"
    assert det.output_text == "aaa END bbb ccc"


def test_a_short_stop_string_is_not_matched_in_text_before_the_new_text() -> None:
    """vLLM's search, per stop string: a match ends in the new text. A longer stop string in
    the list must not widen the search of a short one into text of unchecked tokens (under
    min_tokens): "o" of "fo" (token 2, under min_tokens=2) is not a match, "o" of token 3
    is, and the text is cut there, not at the earlier "o"."""
    tok = _get("char_level")
    for decode_stream in (True, False):
        det = _detok(tok, decode_stream)
        ids = tok.encode("foo bar", add_special_tokens=False)
        det.add_tokens(ids[:1])
        det.add_tokens(ids[1:2])
        det.skip_stop_check()  # min_tokens=2: "fo" is out, unchecked
        det.add_tokens(ids[2:3])
        assert det.check_stop(["o", "a long one"]) == "o"
        assert det.output_text == "fo"


def _feed_after_min_tokens(
    tok: Tokenizer, ids: list[int], min_tokens: int, stops: list[str], include: bool = False,
    decode_stream: bool = True,
) -> tuple[IncrementalDetokenizer, list[str | None]]:
    """Feed ``ids`` one at a time as the engine does under ``min_tokens``: no check up to it
    (``skip_stop_check`` on its last token), a check after each later token, until a match."""
    det = _detok(tok, decode_stream)
    found: list[str | None] = []
    for n, i in enumerate(ids, 1):
        det.add_tokens([i])
        if n == min_tokens:
            det.skip_stop_check()
        elif n > min_tokens:
            found.append(det.check_stop(stops, include))
            if found[-1] is not None:
                break
    return det, found


@pytest.mark.parametrize("include", [False, True])
def test_min_tokens_boundary_for_stop_strings(include: bool) -> None:
    """A stop string that ends in the text of the first min_tokens tokens does not count (as
    vLLM's), even where a longer stop string would reach back over it; one that begins there
    and ends later does."""
    tok = _get("char_level")
    ids = tok.encode("abxab", add_special_tokens=False)
    det, found = _feed_after_min_tokens(tok, ids, 2, ["ab", "b", "xa", "a long stop"], include)
    assert found == [None, "xa"]  # "xa" begins in checked text and ends in token 4's
    assert det.output_text == ("abxa" if include else "ab")
    det, found = _feed_after_min_tokens(tok, ids, 2, ["b", "a long stop"], include)
    assert found == [None, None, "b"]  # the "b" of "ab" under min_tokens is no match
    assert det.output_text == ("abxab" if include else "abxa")


def test_min_tokens_boundary_after_an_incomplete_character() -> None:
    """min_tokens ends on the first byte-level token of "가" (three tokens): the character is
    not complete yet (held as U+FFFD), so the token that completes it is after the boundary
    and "가" stops the request there."""
    tok = _get("byte_level_bpe")
    ids = tok.encode("가", add_special_tokens=False)
    assert len(ids) == 3
    for decode_stream in (True, False):
        det, found = _feed_after_min_tokens(tok, ids, 1, ["가"], decode_stream=decode_stream)
        assert found == [None, "가"] and det.output_text == ""


def test_stop_not_checked_on_empty_delta() -> None:
    tok = _get("byte_level_bpe")
    det = IncrementalDetokenizer(tok, [])
    det.add_tokens(tok.encode("say STOP", add_special_tokens=False))
    assert det.add_tokens([tok.all_special_ids[0]]) == ""  # a skipped special token
    assert det.check_stop(["STOP"]) is None


def test_stream_delta_holds_back_partial_stop() -> None:
    tok = _get("char_level")
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


def test_empty_inputs(tok: Tokenizer, decode_stream: bool) -> None:
    det = _detok(tok, decode_stream)
    assert det.add_tokens([]) == ""
    assert det.check_stop([]) is None
    assert det.check_stop(["", "x"]) is None
    assert det.flush() == "" and det.output_text == "" and det.stream_delta(True) == ""


def test_cost_is_independent_of_output_length(
    decode_stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each add_tokens call decodes a bounded window, not all the output; the stream path calls
    no Python decode at all."""
    tok = byte_level_bpe()
    decoded_lengths: list[int] = []
    real_decode = tok.decode

    def counting_decode(ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        decoded_lengths.append(len(ids))
        return real_decode(ids, skip_special_tokens)

    monkeypatch.setattr(tok, "decode", counting_decode)
    ids = tok.encode(MIXED_TEXT * 40, add_special_tokens=False)
    det = _detok(tok, decode_stream)
    windows = []
    for i in ids:
        det.add_tokens([i])
        windows.append(len(det._ids) - det._prefix_offset)
    assert len(ids) > 300
    assert max(windows) <= 8
    assert max(decoded_lengths, default=0) <= 8
    assert bool(decoded_lengths) == (not decode_stream)
    assert det.output_text == real_decode(ids)


def test_byte_fallback_run_held_until_it_ends(decode_stream: bool) -> None:
    tok = _get("sentencepiece_llama")
    text = "가나다라마바사아자차카타"  # not in CORPUS: 3 byte-fallback tokens per character
    ids = tok.encode(text + " is", add_special_tokens=False)
    assert sum(i in tok.byte_fallback_ids for i in ids) >= 36
    det = _detok(tok, decode_stream)
    emitted_in_run = []
    for i in ids:
        emitted_in_run.append(det.add_tokens([i]))
    # Held while the run is short, released once it passes the cap, exact at the end.
    assert not any(emitted_in_run[:30]) and any(emitted_in_run[:36])
    assert det.output_text + det.flush() == tok.decode(ids)
    assert "\ufffd" not in det.output_text


def test_byte_run_turned_invalid_past_the_cap() -> None:
    """Past the cap a run streams; a stray byte after it changes the decode of text already
    out (inexact by design). DecodeStream raises there: the stream path then carries on with
    windows, giving what the window path gives, and nothing raises."""
    tok = _get("sentencepiece_llama")
    vocab = tok.hf.get_vocab()
    run = [int(vocab[f"<0x{b:02X}>"]) for b in "가나다라마바사아자차카타파하".encode()]
    assert len(run) > _MAX_BYTE_RUN
    ids = run + [int(vocab["<0x80>"])] + tok.encode(" is", add_special_tokens=False)
    outs = []
    for decode_stream in (True, False):
        det = _detok(tok, decode_stream)
        deltas = [det.add_tokens([i]) for i in ids]
        assert det._stream is None  # DecodeStream raised: this request decodes windows now
        outs.append(deltas + [det.flush()])
    assert outs[0] == outs[1]
    assert "".join(outs[0]).startswith("가나다라마바사아자차카")  # valid so far: exact
    assert tok.decode(ids).startswith("\ufffd" * len(run))  # the whole run is invalid


def test_slow_tokenizer_decodes_windows() -> None:
    tok = SlowTokenizer(_get("sentencepiece_metaspace").hf)
    ids = tok.encode(MIXED_TEXT, add_special_tokens=False)
    det = _detok(tok, decode_stream=True)  # asked for, but there is no backend: windows
    _assert_exact(_feed_chunks(det, ids, random.Random(1)), det, tok.decode(ids), ids)


def test_bench_detokenize_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from mrv2.entrypoints.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "detokenize", "--tokens", "32", "--repeats", "1", "--cases", "12"]
    )
    assert isinstance(args, argparse.Namespace)
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for backend in ("window", "DecodeStream", "mrv2"):
        assert f" {backend} " in out
    rows = [line.split() for line in out.splitlines() if " mrv2 " in line and "/12" in line]
    assert len(rows) == 2 and all("12/12" in row for row in rows)  # mrv2 exact on both
