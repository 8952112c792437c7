"""Structured outputs after a thinking block whose end tag the tokenizer spells with several
tokens (Olmo 3's plain-text ``</think>``, Hunyuan-A13B's ``</think>\\n<answer>\\n``): the tag
is found in the output's text however the model splits it, and the grammar holds from the
next token; a token that would carry text past the tag is not allowed; drafts and beam
search's replay see the same. And Step-3.5's newline after ``</think>``, free of the grammar.

The tiny byte-level tokenizer spells ``</think>`` one character a token, and also has the
plain (not special) tokens ``</th``, ``ink>`` and ``k>{``: a second split of the tag, and a
token that would go on past it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from test_structured_outputs import CASES, CHOICES

from mrv2 import LLM, SamplingParams, StructuredOutputsParams
from mrv2.engine.structured_outputs import Guide, StructuredOutputs, fill_bitmasks
from mrv2.entrypoints.reasoning import grammar_mark, split_reasoning
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

PIECES = ["</th", "ink>", "k>{"]


@pytest.fixture(scope="module")
def spelled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    path = make_tiny_checkpoint(tmp_path_factory.mktemp("spelled"), "LlamaForCausalLM",
                                vocab_size=320)
    make_tiny_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.add_tokens(PIECES)  # plain tokens, not special ones
    tok.save_pretrained(str(path))
    return path


def _so(path: Path) -> tuple[StructuredOutputs, object]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    return StructuredOutputs(tok, 320, [tok.eos_token_id]), tok


def _ids(tok: object, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]


def _allowed(guide: Guide, words: int) -> np.ndarray:
    row = np.empty((1, words), dtype=np.int32)
    fill_bitmasks([guide], row)
    return np.unpackbits(row[0].view(np.uint8), bitorder="little").astype(bool)


def test_the_end_tag_is_found_however_it_is_split(spelled: Path) -> None:
    """Olmo 3's mark (``deepseek_r1``'s, its tags text here): after a prompt that opened the
    block, every token is free until the output spells ``</think>`` (one character a token, or
    ``</th`` + ``ink>``, or with text before it in the same token), then the grammar holds;
    ``k>{`` (the tag's end and more) is not allowed while the tail is ``</thin``."""
    so, tok = _so(spelled)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=CHOICES),
                            _reasoning=grammar_mark("olmo3"))
    lt, paris = _ids(tok, "k>{")[0], _ids(tok, "Paris")[0]
    chars = [_ids(tok, c)[0] for c in "</think>"]
    for spelling in (chars, [_ids(tok, "Hm")[0], *_ids(tok, "</th"), *_ids(tok, "ink>")],
                     _ids(tok, "Hm, a</think>")):
        guide = so.guide(params, _ids(tok, "Hi <think>"))
        for token in spelling:
            assert guide.phase == "reasoning" and _allowed(guide, so.words)[paris]
            assert not guide.advance(token)
        assert guide.phase == "grammar", spelling
        allowed = _allowed(guide, so.words)
        assert allowed[paris] and not allowed[chars[0]] and not allowed[lt]
    guide = so.guide(params, _ids(tok, "Hi <think>"))
    for token in _ids(tok, "</thin"):
        guide.advance(token)
    allowed = _allowed(guide, so.words)
    assert not allowed[lt] and allowed[chars[-2]] and allowed[paris]
    assert allowed.sum() == 319  # only the token that would go past the tag
    # a prompt that closed the block: held from the first token
    guide = so.guide(params, _ids(tok, "Hi <think>x</think>"))
    assert guide.phase == "grammar" and not _allowed(guide, so.words)[chars[0]]


def test_text_tag_bans_only_the_tokens_that_go_past_it() -> None:
    """:class:`TextTag` over a made-up vocabulary: a token that holds the whole tag and more
    is banned whatever the tail; one that finishes the tag and goes on is banned only after
    a tail that begins the tag; one that finishes it exactly is not."""
    from mrv2.engine.think_tags import TextTag

    vocab = [b"", b"<", b"a", b">", b"<a>", b"a>", b"a>x", b"x<a>y", b"<a>z", b"q"]
    tag = TextTag(b"<a>", vocab, 1)

    def banned(tail: bytes) -> set[int]:
        row = np.full(1, -1, dtype=np.int32).view(np.uint32)
        tag.restrict(tail, row)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")
        return {i for i in range(len(vocab)) if not bits[i]}

    assert banned(b"") == banned(b"qq") == {7, 8}
    assert banned(b"q<") == {6, 7, 8}  # "a>x" would go past the tag
    assert banned(b"<a") == {7, 8}  # only ">" follows: nothing goes past it
    assert tag.feed(b"q<", 5) == (b"", True) and tag.feed(b"", 4) == (b"", True)
    assert tag.feed(b"q<", 9) == (b"<q", False)  # the tail keeps len(tag) - 1 bytes


def test_drafts_forks_and_replays_across_a_spelled_tag(spelled: Path) -> None:
    """Drafts that finish the tag get the grammar's masks after it (and the guide is rolled
    back, its text tail too); a fork goes on from its own copy; beam search's replay of a
    prefix that wrote the tag leaves the guide in the grammar."""
    so, tok = _so(spelled)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=CHOICES),
                            _reasoning=grammar_mark("olmo3"))
    prompt = _ids(tok, "Hi <think>")
    paris = _ids(tok, "Paris")
    guide = so.guide(params, prompt)
    guide.advance(_ids(tok, "</th")[0])
    drafts = [_ids(tok, "ink>")[0], paris[0]]
    out = np.full((3, so.words), 7, dtype=np.int32)
    guide.draft_masks(drafts, out)
    free = np.full(so.words, -1, dtype=np.int32)
    assert (out[0] == free).all() and not (out[1] == free).all()
    assert guide.phase == "reasoning" and guide.text == b"</th" and guide.consumed == 1
    twin = guide.fork()
    twin.advance(drafts[0])
    assert twin.phase == "grammar" and guide.phase == "reasoning"
    assert (_allowed(twin, so.words) == np.unpackbits(
        out[1].view(np.uint8), bitorder="little").astype(bool)).all()
    written = _ids(tok, "Hm</think>")
    replay = so.guide(dataclasses.replace(params, _grammar_prefix=len(written)),
                      prompt + written)
    assert replay.phase == "grammar" and replay.consumed == 0
    assert _allowed(replay, so.words)[paris[0]]


def test_hunyuans_answer_tag_is_found_in_the_text(spelled: Path) -> None:
    """``hunyuan_a13b``: a prompt that opened ``<think>\\n``: free until
    ``</think>\\n<answer>\\n`` (with or without the newline before it), then held; a prompt
    that closed it, or none (the model cannot open a block of several tokens beside the
    grammar's first token): held from the first token."""
    so, tok = _so(spelled)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=CHOICES),
                            _reasoning=grammar_mark("hunyuan_a13b"))
    paris = _ids(tok, "Paris")[0]
    for text in ("Hm\n</think>\n<answer>\n", "</think>\n<answer>\n"):
        guide = so.guide(params, _ids(tok, "Hi<think>\n"))
        for token in _ids(tok, text[:-1]):
            guide.advance(token)
        assert guide.phase == "reasoning"  # "</think>\n<answer>" is not the whole tag
        guide.advance(_ids(tok, "\n")[0])
        assert guide.phase == "grammar" and _allowed(guide, so.words)[paris]
    for prompt in ("Hi<think>\n\n</think>\n<answer>\n", "Hi"):
        guide = so.guide(params, _ids(tok, prompt))
        assert guide.phase == "grammar", prompt


def test_a_json_answer_after_a_spelled_block(spelled: Path) -> None:
    """End to end under ``olmo3``: the model thinks (a token biased +80, then ``</th`` +70 and
    ``ink>`` +60 in turn: bad words forbid each after the one before it), then the grammar
    holds: the reasoning is the block, the content is the schema's JSON. (Before, the grammar
    held from the first token: no ``</think>`` was ever written, and the whole answer was
    reasoning.)"""
    llm = LLM(str(spelled), device="cpu", dtype="float32", block_size=4)
    tok = llm.get_tokenizer()
    think, end1, end2 = _ids(tok, "Paris")[0], *(_ids(tok, p)[0] for p in PIECES[:2])
    params = SamplingParams(temperature=0.0, max_tokens=40,
                            logit_bias={think: 80.0, end1: 70.0, end2: 60.0},
                            bad_words=["PaPa", "</thPa", "</th</th"],
                            structured_outputs=CASES["json"][0],
                            _reasoning=grammar_mark("olmo3"))
    out = llm.generate({"prompt_token_ids": _ids(tok, "Hi <think>")}, params,
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:3] == [think, end1, end2] and out.finish_reason == "stop"
    reasoning, content = split_reasoning("olmo3", out.text)
    assert reasoning == tok.decode([think]) and content is not None
    assert CASES["json"][1](content)  # the schema's JSON


def test_step3p5_may_write_its_newline_before_the_grammar(tmp_path: Path) -> None:
    """``step3p5``: after ``</think>`` the first token may be the newline the model writes
    there (biased, so taken; its parser drops it), not held to the grammar; then the grammar
    holds (no second newline). The content is the answer."""
    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(path, special_tokens=["<think>", "</think>"])
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4)
    tok = llm.get_tokenizer()
    start, end, newline = (_ids(tok, t)[0] for t in ("<think>", "</think>", "\n"))
    params = SamplingParams(temperature=0.0, max_tokens=30,
                            logit_bias={end: 100.0, newline: 50.0},
                            structured_outputs=StructuredOutputsParams(choice=CHOICES),
                            _reasoning=grammar_mark("step3p5"))
    out = llm.generate({"prompt_token_ids": [5, 6, start]}, params,
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:2] == [end, newline] and newline not in out.token_ids[2:]
    text = tok.decode(out.token_ids, skip_special_tokens=False)  # (Step-3.5's tags are text)
    assert split_reasoning("step3p5", text)[1] in CHOICES
