"""``kimi_k2``, ``qwen3_xml`` and ``deepseek_v32`` beyond the text cases of
test_tool_parsers.py: a Kimi-K2 server whose tokenizer has the section and call markers as
special tokens answers a call, whole and streamed, with the model's ``functions.NAME:IDX`` as
its id; a DeepSeek-V3.2 answer through the reasoning parser (thinking on) and the DSML parser;
each format streamed a character at a time and cut in two anywhere; the CLI's names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, join_tool_calls

from mrv2.contract.params import SamplingParams
from mrv2.engine.outputs import CompletionOutput, RequestOutput
from mrv2.engine.tokenizer import Tokenizer
from mrv2.entrypoints.responses import Stream
from mrv2.entrypoints.tool_calls import ToolCalling, get_tool_parser
from mrv2.entrypoints.tool_parsers_more import (
    DSML,
    DSML_CALLS,
    KIMI_ARGUMENTS,
    KIMI_CALL,
    KIMI_CALL_END,
    KIMI_SECTIONS,
)
from mrv2.entrypoints.tool_stream import ToolCallStream
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "opts": {"type": "object"}}}}}]
KIMI_MARKERS = [KIMI_SECTIONS[0], "<|tool_calls_section_end|>", KIMI_CALL, KIMI_ARGUMENTS,
                KIMI_CALL_END]
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Lyon"})]
DSML_ANSWER = (
    f'Checking.\n\n{DSML_CALLS}\n<{DSML}invoke name="get_weather">\n<{DSML}parameter '
    f'name="city" string="true">Paris</{DSML}parameter>\n<{DSML}parameter name="days" '
    f'string="false">3</{DSML}parameter>\n</{DSML}invoke>\n<{DSML}invoke name="get_weather">'
    f'\n<{DSML}parameter name="city" string="true">Lyon</{DSML}parameter>\n</{DSML}invoke>\n'
    f"</{DSML}function_calls>")
#: parser -> (answer, content)
ANSWERS = {
    "kimi_k2": ("Checking." + KIMI_SECTIONS[0] + KIMI_CALL + "functions.get_weather:0"
                + KIMI_ARGUMENTS + '{"city": "Paris", "days": 3}' + KIMI_CALL_END + KIMI_CALL
                + "functions.get_weather:1" + KIMI_ARGUMENTS + '{"city": "Lyon"}'
                + KIMI_CALL_END + "<|tool_calls_section_end|>", "Checking."),
    "qwen3_xml": ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                  "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
                  "\nand\n<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n"
                  "</parameter>\n</function>\n</tool_call>\nDone.", "Checking.\n\nand\n\nDone."),
    "deepseek_v32": (DSML_ANSWER, "Checking.\n\n"),
}


def _calls(calls: list[Any]) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("parser", sorted(ANSWERS))
def test_a_stream_split_anywhere_gives_the_whole_answer(parser: str) -> None:
    """A character at a time, and in two pieces cut at every place: the content and calls of
    the whole answer, never a part of a marker sent (the content between and after
    ``qwen3_xml``'s calls goes out when the choice ends)."""
    text, content = ANSWERS[parser]
    splits = [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for deltas in splits:
        stream, sent, got = ToolCallStream(parser, TOOLS), "", []
        for i, delta in enumerate(deltas):
            piece, pieces = stream.feed(delta, final=i == len(deltas) - 1)
            sent += piece
            got += [p.as_dict() for p in pieces]
            assert content.startswith(sent), (deltas[:i + 1])
        joined = join_tool_calls(got)
        assert (sent, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                       for c in joined]) == (content, CALLS), deltas
        if parser == "kimi_k2":  # the model's ids, as vLLM keeps them
            assert [c["id"] for c in joined] == ["functions.get_weather:0",
                                                 "functions.get_weather:1"]


class _Body:
    include_usage = False
    continuous_usage = False


def test_a_deepseek_v32_answer_through_the_reasoning_parser() -> None:
    """DeepSeek-V3.2 with thinking on (``--reasoning-parser deepseek_v3`` splits as
    ``deepseek_r1``): the reasoning apart, the content before the block, the calls typed;
    the same message whole and streamed a character (a token) at a time, each call sent by
    pieces (its name, a parameter at a time, the end with its invoke), finishing with
    ``tool_calls``."""
    answer = "The user wants the weather.</think>" + DSML_ANSWER

    def stream() -> Stream:
        return Stream(None, "chatcmpl-x", "m", True, SamplingParams(max_tokens=99),  # type: ignore[arg-type]
                      _Body(), ["r"], [([1], None)], "deepseek_r1",
                      ToolCalling(get_tool_parser("deepseek_v32"), TOOLS))

    choice: dict[str, Any] = {"finish_reason": "stop"}
    message = stream()._parsed_message(answer, choice)
    want = ("The user wants the weather.", "Checking.\n\n")
    assert (message["reasoning_content"], message["content"]) == want
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == CALLS
    assert choice["finish_reason"] == "tool_calls"
    live, got = stream(), {"reasoning_content": "", "content": ""}
    entries: list[dict[str, Any]] = []
    for i, char in enumerate(answer):
        final = i == len(answer) - 1
        out = RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1], finished=final,
                            outputs=[CompletionOutput(0, char, [i], "stop" if final else None)],
                            delta=True)
        for chunk, _ in live._deltas(out):
            delta = chunk["delta"]
            got["reasoning_content"] += delta.get("reasoning_content", "")
            got["content"] += delta["content"]
            assert DSML not in delta["content"]
            if delta.get("tool_calls"):  # (the name, a parameter, the end: with its tag's)
                assert answer[:i + 1].endswith(('">', f"</{DSML}parameter>",
                                                f"</{DSML}invoke>")), answer[:i + 1]
            entries += delta.get("tool_calls", [])
            assert chunk["finish_reason"] == ("tool_calls" if final else None)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
             for c in join_tool_calls(entries)]
    assert (got["reasoning_content"], got["content"], calls) == (*want, CALLS)


def test_the_cli_takes_the_names() -> None:
    from mrv2.entrypoints.cli import build_parser

    for name in ("kimi_k2", "qwen3_xml", "deepseek_v32"):
        args = build_parser().parse_args(["serve", "m", "--enable-auto-tool-choice",
                                          "--tool-call-parser", name])
        assert args.tool_call_parser == name == get_tool_parser(name).name
    assert not get_tool_parser("qwen3_xml").special_tokens  # (qwen3_coder's tokenizer)


def _sse(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_kimi_k2_server_with_special_tokens(tmp_path: Path) -> None:
    """``--tool-call-parser kimi_k2`` with a tokenizer whose section and call markers are
    special tokens (as Kimi-K2's): an answer made of them (forced by a grammar of their token
    ids) is decoded keeping them and comes back as a call, whole and streamed, its id the
    model's ``functions.get_weather:0``; the default decode would have lost the markers."""
    from conftest import serve

    make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(tmp_path, special_tokens=KIMI_MARKERS)
    tok = Tokenizer.from_pretrained(tmp_path)
    section, end, call, arguments, call_end = tok.hf.convert_tokens_to_ids(KIMI_MARKERS)
    grammar = (f'start: "Hi" <[{section}]> <[{call}]> "functions.get_weather:0" '
               f'<[{arguments}]> {json.dumps(json.dumps({"city": "Paris"}))} <[{call_end}]> '
               f"<[{end}]>")
    text = ANSWERS["kimi_k2"][0]
    assert KIMI_CALL not in tok.decode(tok.encode(text, add_special_tokens=False))
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS,
            "max_tokens": 60, "temperature": 0, "structured_outputs": {"grammar": grammar}}
    url = "/v1/chat/completions"
    for served in serve(tmp_path, engine_kwargs={"max_model_len": 128},
                        tool_call_parser="kimi_k2"):
        answer = httpx.post(served.url + url, headers=AUTH, timeout=60, json=body).json()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls", answer
        assert choice["message"]["content"] == "Hi"
        (got,) = choice["message"]["tool_calls"]
        assert got == {"id": "functions.get_weather:0", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}
        chunks = _sse(httpx.post(served.url + url, headers=AUTH, timeout=60,
                                 json={**body, "stream": True}).text)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == "Hi"
        pieces = [c for d in deltas for c in d.get("tool_calls") or []]
        (streamed,) = join_tool_calls(pieces)  # (its arguments in pieces)
        assert (streamed["id"], streamed["function"]) == (got["id"], got["function"])
        assert len(pieces) > 2
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
