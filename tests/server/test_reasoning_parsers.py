"""The reasoning parsers of the families beside Qwen3 / DeepSeek-R1 / MiniMax-M2 / gpt-oss
(vLLM's names and rules): ``deepseek_v3`` / ``glm45`` / ``glm47`` / ``exaone4`` /
``nemotron_v3`` (resolved per request by the template's thinking switches), ``ernie45``,
``seed_oss``, ``mistral`` (Magistral's ``[THINK]``), ``gemma4`` and ``granite`` (text markers):
whole outputs (reasoning, none, cut off) and the same outputs streamed cut anywhere; what a
structured output is marked with, which decode keeping special tokens, the CLI's names."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, spy_add_request
from test_reasoning import _chat, _streamed

from mrv2.entrypoints.reasoning import (
    IDENTITY,
    REASONING_PARSERS,
    ReasoningStream,
    check_reasoning_parser,
    grammar_mark,
    harmony_format,
    keeps_special_tokens,
    request_parser,
    split_reasoning,
    structured_refusal,
)
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

AUTH = {"Authorization": f"Bearer {API_KEY}"}

#: parser -> [(output, (reasoning, content))]
CASES: dict[str, list[tuple[str, tuple[str | None, str | None]]]] = {
    "ernie45": [
        ("abc\n</think>\n\n<response>\ndef\n</response>\n", ("abc\n", "\ndef\n")),
        ("abc\n</think>\ndef", ("abc\n", "def")),
        ("<think>abc</think>def", ("abc", "def")),
        ("still thinking when cut", ("still thinking when cut", None)),
        ("abc</think>\n\n<response>\ncut in the answer", ("abc", "\ncut in the answer")),
        ("a</think><response>x</response>y</response>\n", ("a", "x</response>y")),
        ("a</think>plain <response> inside", ("a", "plain <response> inside")),
        ("a</think>\n\n", ("a", None)),
        ("a</think><respons", ("a", "<respons")),
        ("", (None, None)),
    ],
    "seed_oss": [
        ("<seed:think>plan</seed:think>answer", ("plan", "answer")),
        ("plan</seed:think>answer", ("plan", "answer")),
        ("cut while thinking", ("cut while thinking", None)),
        ("<seed:think>a</think>b</seed:thin", ("a</think>b</seed:thin", None)),
        ("</seed:think>only the answer", (None, "only the answer")),
        ("", (None, None)),
    ],
    "mistral": [
        ("[THINK]plan[/THINK]answer", ("plan", "answer")),
        ("[THINK]cut while thinking", ("cut while thinking", None)),
        ("no thinking at all", (None, "no thinking at all")),
        ("before[THINK]plan[/THINK]after", ("plan", "beforeafter")),
        ("before[THINK]plan", ("plan", "before")),
        ("stray[/THINK]end", (None, "strayend")),
        ("a[/THINK]b[/THINK]c", (None, "ab[/THINK]c")),
        ("[THINK]a[/THINK]b[THINK]c[/THINK]", ("a", "b[THINK]c[/THINK]")),
        ("x [THIN and [/THI", (None, "x [THIN and [/THI")),
        ("", (None, None)),
    ],
    "gemma4": [
        ("<|channel>thought\nplan<channel|>answer", ("plan", "answer")),
        ("<|channel>plan<channel|>answer", ("plan", "answer")),
        ("<|channel>thought\ncut while thinking", ("cut while thinking", None)),
        ("<|channel>thought", ("thought", None)),
        ("<|channel>thought\n", (None, None)),
        ("just the answer", (None, "just the answer")),
        ("  <|channel>thought\na<channel|>b", ("a", "b")),
        ("answer<|channel>x<channel|>", (None, "answer<|channel>x<channel|>")),
        ("", (None, None)),
    ],
    "granite": [
        ("Here is my thought process: plan Here is my response: answer",
         (" plan ", " answer")),
        ("Here's my thought process:\nplan\nHere's my response:\nanswer",
         ("\nplan\n", "\nanswer")),
        ("Here is my thought process: plan Here's my response: answer",
         (" plan ", " answer")),
        ("Here is my thought process: cut while thinking", (" cut while thinking", None)),
        ("Here is my response without thinking", (None, "Here is my response without thinking")),
        ("The answer, no thinking.", (None, "The answer, no thinking.")),
        ("Here is my thought process: Here it is: my response is x Here is my response:",
         (" Here it is: my response is x ", None)),
        ("Here is my", (None, "Here is my")),
        ("", (None, None)),
    ],
    # the switched parsers with no chat_template_kwargs (their defaults)
    "deepseek_v3": [("plan</think>answer", (None, "plan</think>answer")),
                    ("<think>a</think>b", (None, "<think>a</think>b"))],
    "glm45": [("plan</think>answer", ("plan", "answer")),
              ("<think>a</think>b", ("a", "b")), ("cut while thinking", ("cut while thinking",
                                                                         None))],
    "exaone4": [("plan</think>answer", (None, "plan</think>answer"))],
    "nemotron_v3": [("plan</think>answer", ("plan", "answer"))],
    IDENTITY: [("a</think>b", (None, "a</think>b")), ("", (None, None))],
}
PAIRS = [(kind, text, want) for kind, cases in CASES.items() for text, want in cases]


@pytest.mark.parametrize(("kind", "text", "want"), PAIRS)
def test_whole_outputs(kind: str, text: str, want: tuple[str | None, str | None]) -> None:
    assert split_reasoning(kind, text) == want


@pytest.mark.parametrize(("kind", "text", "want"), PAIRS)
def test_a_stream_cut_anywhere_gives_the_whole_outputs_split(
        kind: str, text: str, want: tuple[str | None, str | None]) -> None:
    """A character at a time, in two pieces cut at every place, and in random cuts (empty
    deltas included): the same split, and no tag of the parser reaches the client where the
    whole output's parts hold none."""
    rng = random.Random(hash((kind, text)) % 1000)
    splits = [list(text) or [""]] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(30):
        cuts = sorted(rng.choices(range(len(text) + 1), k=5))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    tags = ["[THINK]", "[/THINK]", "<|channel>", "<channel|>", "<seed:think>",
            "</seed:think>", "Here is my response:", "<response>"]
    hidden = [t for t in tags if t not in "".join(p or "" for p in want)]
    for deltas in splits:
        stream = ReasoningStream(kind)
        parts = [stream.feed(d, final=i == len(deltas) - 1) for i, d in enumerate(deltas)]
        got = ("".join(r for r, _ in parts) or None), ("".join(c for _, c in parts) or None)
        assert got == want, deltas
        assert not any(t in r + c for t in hidden for r, c in parts), (deltas, parts)


def test_a_stream_sends_what_cannot_be_a_tag_at_once() -> None:
    """Reasoning and content go out as they come; only what may begin a marker waits."""
    stream = ReasoningStream("mistral")
    assert stream.feed("[THINK]pla") == ("pla", "")
    assert stream.feed("n[/THI") == ("n", "")
    assert stream.feed("NK]ok") == ("", "ok")
    granite = ReasoningStream("granite")
    assert granite.feed("Here's my thought") == ("", "")
    assert granite.feed(" process: a b Here") == (" a b ", "")
    assert granite.feed(" is my response: x") == ("", " x")
    assert granite.state == "content"
    ernie = ReasoningStream("ernie45")
    assert ernie.feed("a</think>\n\n<resp") == ("a", "")
    assert ernie.feed("onse>\nx</response>") == ("", "\nx")
    assert ernie.feed("\n", final=True) == ("", "")


@pytest.mark.parametrize(("kind", "kwargs", "want"), [
    ("deepseek_v3", None, IDENTITY),
    ("deepseek_v3", {"thinking": True}, "deepseek_r1"),
    ("deepseek_v3", {"enable_thinking": True}, "deepseek_r1"),
    ("deepseek_v3", {"thinking": False}, IDENTITY),
    ("glm45", None, "deepseek_r1"),
    ("glm47", {"other": 1}, "deepseek_r1"),
    ("holo2", {"enable_thinking": None}, "deepseek_r1"),
    ("holo2", {"thinking": False}, IDENTITY),
    ("glm45", {"enable_thinking": False}, IDENTITY),
    ("glm45", {"thinking": False, "enable_thinking": True}, "deepseek_r1"),
    ("exaone4", None, IDENTITY),
    ("exaone4", {"thinking": True}, IDENTITY),
    ("exaone4", {"enable_thinking": True}, "deepseek_r1"),
    ("nemotron_v3", None, "deepseek_r1"),
    ("nemotron_v3", {"enable_thinking": True}, "deepseek_r1"),
    ("nemotron_v3", {"enable_thinking": False}, "qwen3"),
    ("qwen3", {"enable_thinking": False}, "qwen3"),
    ("granite", {"thinking": True}, "granite"),
    (None, {"thinking": True}, None),
])
def test_the_template_switches_choose_the_requests_parser(
        kind: str | None, kwargs: dict[str, Any] | None, want: str | None) -> None:
    assert request_parser(kind, kwargs) == want


def test_nemotron_v3_without_thinking_reads_an_answer_as_content() -> None:
    """vLLM's: with ``enable_thinking: false`` an output with no ``</think>`` is content."""
    kind = request_parser("nemotron_v3", {"enable_thinking": False})
    assert kind is not None
    assert split_reasoning(kind, "the answer") == (None, "the answer")
    assert split_reasoning("nemotron_v3", "the answer") == ("the answer", None)


def test_marks_special_tokens_and_refusals() -> None:
    """The engine's conventions: Magistral's and Gemma 4's blocks are opened by the model
    (their own tags), Seed-OSS's as DeepSeek-R1's with its tags, ERNIE's as R1's; the
    switched parsers by their default (a chat request resolves them first); Granite's text
    markers get no mark, and a request turning its thinking on is refused a structured
    output."""
    marks = {"mistral": "mistral", "gemma4": "gemma4", "seed_oss": "seed_oss",
             "ernie45": "deepseek_r1", "glm45": "deepseek_r1", "glm47": "deepseek_r1",
             "nemotron_v3": "deepseek_r1", "deepseek_v3": None, "exaone4": None,
             "granite": None, IDENTITY: None, "qwen3": "qwen3", "openai_gptoss": "openai_gptoss"}
    for kind, mark in marks.items():
        assert grammar_mark(kind) == mark, kind
    assert grammar_mark(request_parser("deepseek_v3", {"thinking": True})) == "deepseek_r1"
    assert [k for k in REASONING_PARSERS if keeps_special_tokens(k)] == [
        "openai_gptoss", "mistral", "gemma4"]
    assert [k for k in REASONING_PARSERS if harmony_format(k)] == ["openai_gptoss"]
    assert structured_refusal("granite", {"thinking": True})
    assert structured_refusal("granite", None) is None
    assert structured_refusal("granite", {"thinking": False}) is None
    assert structured_refusal("mistral", {"thinking": True}) is None


NEW = ("deepseek_v3", "glm45", "glm47", "exaone4", "nemotron_v3", "ernie45", "seed_oss",
       "mistral", "gemma4", "granite", "holo2")


def test_the_names(capsys: pytest.CaptureFixture[str]) -> None:
    from mrv2.entrypoints.cli import build_parser

    for name in NEW:
        assert check_reasoning_parser(name) == name
        args = build_parser().parse_args(["serve", "m", "--reasoning-parser", name])
        assert args.reasoning_parser == name
    with pytest.raises(ValueError, match="allowed values are .*mistral, gemma4, granite, holo2"):
        check_reasoning_parser("magistral")
    with pytest.raises(ValueError):
        check_reasoning_parser(IDENTITY)  # (what a request resolves to, not a name to serve)


def test_the_server_resolves_each_requests_parser(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind the server: ``deepseek_v3`` splits a chat answer only where the request's
    ``chat_template_kwargs`` turn thinking on (a random model writes no ``</think>``: all
    reasoning), streamed and not, its structured outputs marked as R1's then and not
    otherwise; ``mistral`` decodes keeping special tokens and marks its own; ``granite``
    refuses a structured output with thinking on and holds one from the first token
    without."""
    from conftest import serve

    path = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(path, special_tokens=["<think>", "</think>", "[THINK]", "[/THINK]"])
    seen: list[tuple[bool, str | None]] = []


    body: dict[str, Any] = {"messages": [{"role": "user", "content": "Hello world!"}],
                            "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    think = {"chat_template_kwargs": {"thinking": True}}
    choice = {"guided_choice": ["Paris", "London"]}
    for served in serve(path, reasoning_parser="deepseek_v3"):
        spy_add_request(monkeypatch, served.engine,
                        lambda p: seen.append((p.skip_special_tokens, p._reasoning)))
        plain = _chat(served, body)["choices"][0]["message"]
        assert plain["content"] and plain["reasoning_content"] is None
        thought = _chat(served, {**body, **think})["choices"][0]["message"]
        assert thought["content"] is None and thought["reasoning_content"] == plain["content"]
        assert _streamed(served, {**body, **think}) == (plain["content"], "")
        assert _streamed(served, body) == ("", plain["content"])
        seen.clear()
        for extra, mark in (({}, None), (think, "deepseek_r1")):
            _chat(served, {**body, **choice, **extra})
            assert seen.pop() == (True, mark)
    for served in serve(path, reasoning_parser="mistral"):
        spy_add_request(monkeypatch, served.engine,
                        lambda p: seen.append((p.skip_special_tokens, p._reasoning)))
        _chat(served, body)
        assert seen.pop() == (False, None)
        _chat(served, {**body, **choice})
        assert seen.pop() == (False, "mistral")
    for served in serve(path, reasoning_parser="granite"):
        spy_add_request(monkeypatch, served.engine,
                        lambda p: seen.append((p.skip_special_tokens, p._reasoning)))
        r = httpx.post(f"{served.url}/v1/chat/completions", headers=AUTH, timeout=60,
                       json={**body, **choice, **think})
        assert r.status_code == 400 and "granite" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "chat_template_kwargs"
        message = _chat(served, {**body, **choice})["choices"][0]["message"]
        assert message["content"] in ("Paris", "London") and seen.pop() == (True, None)


@pytest.mark.parametrize(("kind", "deltas"), [
    ("mistral", ["[THINK]", "hm", "[/THINK]", "Hi"]),
    ("gemma4", ["<|channel>", "thought\n", "hm", "<channel|>", "Hi"]),
    ("granite", ["Here is my thought process:", "hm", "Here is my response:", "Hi"]),
    ("ernie45", ["hm", "</think>", "\n\n", "<response>", "Hi", "</response>"]),
])
def test_the_responses_api_counts_the_reasoning_tokens(kind: str, deltas: list[str]) -> None:
    """The Responses API's split (reasoning items, ``reasoning_tokens``) reads each parser's
    stream: the block's tokens, its markers included, are reasoning; the answer's are not."""
    from mrv2.entrypoints.responses_output import AnswerSplit

    split = AnswerSplit(kind, None, True, None)
    runs = []
    for i, text in enumerate(deltas):
        runs += split.feed(text, [i], None, i == len(deltas) - 1)[0]
    assert runs == [("reasoning", "hm"), ("content", "Hi")]
    assert split.reasoning_tokens == deltas.index("hm") + 2
