"""``tool_choice`` ``"required"`` or named, as vLLM does it: a structured output (the tool's
parameters, or a list of ``{"name", "parameters"}``) read back as ``tool_calls``; with or
without ``--tool-call-parser``; refused with another structured output or a name no tool has.

The tiny model has random weights and JSON allows any whitespace between tokens (vLLM's
default), so an answer may run out of ``max_tokens``: then it is content, and that content
without whitespace is a prefix of a valid answer. Either way the mask held."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, MODEL, join_tool_calls

from mrv2.entrypoints.tool_calls import forced_tool_choice

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PICK = {"type": "object", "additionalProperties": False, "required": ["n"],
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
TOOLS = [{"type": "function", "function": {"name": "pick", "parameters": PICK}},
         {"type": "function", "function": {"name": "noop"}}]
NAMED = {"type": "function", "function": {"name": "pick"}}


def test_the_schemas_and_readers() -> None:
    parser, schema = forced_tool_choice(NAMED, TOOLS)
    assert schema == PICK
    content, calls = parser.parse('{"n": 3}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("pick", {"n": 3})]
    assert parser.parse('{"n": ') == ('{"n": ', [])  # cut off: content
    parser, schema = forced_tool_choice("required", TOOLS, parallel_tool_calls=False)
    assert schema["type"] == "array" and schema["maxItems"] == 1
    assert [i["properties"]["name"] for i in schema["items"]["anyOf"]] == [
        {"enum": ["pick"]}, {"enum": ["noop"]}]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}
    _, calls = parser.parse('[{"name": "pick", "parameters": {"n": 1}}, '
                            '{"name": "noop", "parameters": {}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("pick", {"n": 1}),
                                                                    ("noop", {})]
    for bad, message in (({"type": "function", "function": {"name": "x"}}, "which tools lacks"),
                         ({"type": "tool"}, "tool_choice=.* is invalid")):
        with pytest.raises(ValueError, match=message):
            forced_tool_choice(bad, TOOLS)


def test_forced_calls_take_the_servers_call_ids() -> None:
    """A forced call's id: ``call_`` and 24 hex digits, or the server's parser's (mistral's 9
    letters and digits, which Mistral's templates require: vLLM's ``MistralToolCall``)."""
    from mrv2.entrypoints.tool_calls import get_tool_parser

    mistral = get_tool_parser("mistral").call_id
    for choice, text in ((NAMED, '{"n": 3}'), ("required", '[{"name": "noop", "parameters": {}}]')):
        (call,) = forced_tool_choice(choice, TOOLS)[0].parse(text)[1]
        assert re.fullmatch(r"call_[0-9a-f]{24}", call.id), call
        (call,) = forced_tool_choice(choice, TOOLS, call_id=mistral)[0].parse(text)[1]
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id), call


def test_kimi_k2s_forced_calls_take_kimis_ids() -> None:
    """A ``kimi_k2`` server's forced calls get Kimi's ids, ``functions.NAME:IDX`` (vLLM's
    ``make_tool_call_id``), IDX counting the conversation's earlier calls, then this answer's;
    a whole and a streamed answer alike. The other parsers' forced ids are as they were, and
    a ``kimi_k2`` answer's own calls keep the model's ids."""
    from mrv2.entrypoints.tool_calls import get_tool_parser
    from mrv2.entrypoints.tool_stream import ToolCallStream

    kimi = get_tool_parser("kimi_k2").forced_id
    required = '[{"name": "pick", "parameters": {"n": 1}}, {"name": "noop", "parameters": {}}]'
    for choice, text, ids in ((NAMED, '{"n": 3}', ["functions.pick:3"]),
                              ("required", required, ["functions.pick:3", "functions.noop:4"])):
        parser, _ = forced_tool_choice(choice, TOOLS, call_id=kimi, earlier=3)
        assert [c.id for c in parser.parse(text)[1]] == ids
        stream, entries = ToolCallStream(parser, TOOLS), []
        for i, char in enumerate(text):
            entries += [p.as_dict() for p in stream.feed(char, final=i == len(text) - 1)[1]]
        assert [c["id"] for c in join_tool_calls(entries)] == ids
        _, (first, *_) = forced_tool_choice(choice, TOOLS, call_id=kimi)[0].parse(text)
        assert first.id == ids[0].replace(":3", ":0")  # (no earlier calls)
    for name in ("hermes", "mistral", "deepseek_v31"):
        assert get_tool_parser(name).forced_id is None
    _, (call,) = get_tool_parser("kimi_k2").parse(
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.pick:7'
        '<|tool_call_argument_begin|>{"n": 1}<|tool_call_end|>')
    assert call.id == "functions.pick:7"


def test_the_kimi_k2_servers_forced_ids_count_the_conversations_calls(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chat route counts the calls of the messages' assistant ``tool_calls`` (the Responses
    API: its ``function_call`` input items) and gives a ``kimi_k2`` server's forced calls ids
    from there; the answers' calls (whole and streamed) have those ids."""
    from conftest import serve
    from mrv2.engine.tokenizer import Tokenizer
    from mrv2.entrypoints import completion_routes

    made: list[Any] = []

    def spy(*args: Any, **kwargs: Any) -> Any:  # (the route's reader, kept)
        result = forced_tool_choice(*args, **kwargs)
        made.append(result[0])
        return result

    monkeypatch.setattr(completion_routes, "forced_tool_choice", spy)

    def call(name: str, index: int) -> dict[str, Any]:
        return {"id": f"functions.{name}:{index}", "type": "function",
                "function": {"name": name, "arguments": "{}"}}

    messages = [{"role": "user", "content": "go"},
                {"role": "assistant", "content": None,
                 "tool_calls": [call("noop", 0), call("noop", 1)]},
                {"role": "tool", "tool_call_id": "functions.noop:0", "content": "a"},
                {"role": "tool", "tool_call_id": "functions.noop:1", "content": "b"},
                {"role": "assistant", "content": "", "tool_calls": [call("noop", 2)]},
                {"role": "tool", "tool_call_id": "functions.noop:2", "content": "c"},
                {"role": "assistant", "content": "ok", "tool_calls": []},
                {"role": "user", "content": "pick"}]
    tok = Tokenizer.from_pretrained(model_dir)
    spaces = {str(i): -100 for i in range(tok.vocab_size) if any(
        c.isspace() for c in tok.decode([i], False))}
    closed = {"type": "object", "additionalProperties": False, "properties": {}}
    tools = [TOOLS[0], {"type": "function", "function": {"name": "noop", "parameters": closed}}]
    # (a finite language, whitespace banned: every answer is a whole call within max_tokens)
    body = {"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 60,
            "temperature": 0, "logit_bias": spaces, "parallel_tool_calls": False}
    for served in serve(model_dir, {"max_model_len": 256}, tool_call_parser="kimi_k2"):
        url = f"{served.url}/v1/chat/completions"
        for choice, stream in ((NAMED, False), ("required", False), (NAMED, True)):
            r = httpx.post(url, headers=AUTH, timeout=60,
                           json={**body, "tool_choice": choice, "stream": stream})
            assert r.status_code == 200, r.text
            if stream:
                entries = [e for line in r.text.splitlines()
                           if line.startswith("data: {") for c in json.loads(line[6:])[
                               "choices"] for e in c["delta"].get("tool_calls") or []]
                calls = join_tool_calls(entries)
            else:
                calls = r.json()["choices"][0]["message"].get("tool_calls") or []
            (only,) = calls
            assert only["id"] == f"functions.{only['function']['name']}:3", only
            assert made[-1].earlier == 3 and made[-1].make_id("noop", 1) == "functions.noop:4"
        r = httpx.post(f"{served.url}/v1/responses", headers=AUTH, timeout=60, json={
            "model": MODEL, "tool_choice": "required", "max_output_tokens": 3, "input": [
                {"role": "user", "content": "go"},
                {"type": "function_call", "call_id": "functions.noop:0", "name": "noop",
                 "arguments": "{}"},
                {"type": "function_call_output", "call_id": "functions.noop:0", "output": "a"}],
            "tools": [{"type": "function", "name": "pick", "parameters": PICK}]})
        assert r.status_code == 200, r.text
        assert made[-1].earlier == 1 and made[-1].make_id("pick", 0) == "functions.pick:1"


def test_required_keeps_the_tools_refs_working() -> None:
    """Tools whose parameters refer to their own ``$defs`` (pydantic's schemas): ``required``'s
    one schema holds them at its root, where ``#/$defs/...`` points (vLLM's way), and it
    compiles; two tools that give one name different schemas are refused, naming the field."""
    import llguidance

    def tool(name: str, unit: list[str]) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "required": ["unit"], "$defs": {"Unit": {"enum": unit}},
            "properties": {"unit": {"$ref": "#/$defs/Unit"}}}}}

    tools = [tool("a", ["c", "f"]), tool("b", ["c", "f"])]
    _, schema = forced_tool_choice("required", tools)
    assert schema["$defs"] == {"Unit": {"enum": ["c", "f"]}}
    assert all("$defs" not in item["properties"]["parameters"]
               for item in schema["items"]["anyOf"])
    assert "$defs" in tools[0]["function"]["parameters"]  # the request's tools untouched
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    assert llguidance.LLMatcher.validate_grammar(grammar, None) == ""
    with pytest.raises(ValueError, match=r"tool_choice='required' is invalid: .*\$defs.Unit"):
        forced_tool_choice("required", [tool("a", ["c"]), tool("b", ["f"])])


class _Body:
    include_usage = False
    continuous_usage = False


def test_a_named_choice_finishes_with_stop() -> None:
    """OpenAI's and vLLM's finish reasons of a whole answer with a forced call: a named
    ``tool_choice``'s keeps the engine's (``stop``), ``required``'s is ``tool_calls``."""
    from mrv2.contract.params import SamplingParams
    from mrv2.entrypoints.responses import Stream
    from mrv2.entrypoints.tool_calls import ToolCalling

    for choice, text, finish in ((NAMED, '{"n": 3}', "stop"),
                                 ("required", '[{"name": "pick", "parameters": {"n": 3}}]',
                                  "tool_calls")):
        parser, _ = forced_tool_choice(choice, TOOLS)
        stream = Stream(None, "chatcmpl-x", "m", True, SamplingParams(max_tokens=9),  # type: ignore[arg-type]
                        _Body(), ["r"], [([1], None)], tools=ToolCalling(parser, TOOLS))
        out: dict[str, Any] = {"finish_reason": "stop"}
        message = stream._message(text, out)
        assert [c["function"]["name"] for c in message["tool_calls"]] == ["pick"]
        assert out["finish_reason"] == finish, choice


def _check_named(message: dict[str, Any], finish: str, called: str = "stop") -> None:
    """A named choice's answer; ``called``: its finish reason with the call (a whole answer's
    ``stop``, a stream's ``tool_calls``, as vLLM's)."""
    if message.get("tool_calls"):
        (call,) = message["tool_calls"]
        assert call["function"]["name"] == "pick" and finish == called
        assert 0 <= json.loads(call["function"]["arguments"])["n"] <= 9
    else:  # ran out of max_tokens inside the JSON
        compact = re.sub(r"\s", "", message["content"])
        assert finish == "length" and re.fullmatch(r"(\{(\"(n(\"(:([0-9]\}?)?)?)?)?)?)?", compact)


@pytest.mark.parametrize("parser", [None, "hermes"])
def test_forced_calls_through_the_server(model_dir: Path, parser: str | None) -> None:
    from conftest import serve

    body = {"model": MODEL, "messages": [{"role": "user", "content": "pick"}], "tools": TOOLS,
            "max_tokens": 40, "temperature": 0.9, "seed": 1}
    for served in serve(model_dir, tool_call_parser=parser):
        url = f"{served.url}/v1/chat/completions"
        for seed in range(3):
            r = httpx.post(url, headers=AUTH, timeout=60,
                           json={**body, "seed": seed, "tool_choice": NAMED})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            _check_named(choice["message"], choice["finish_reason"])
        r = httpx.post(url, headers=AUTH, timeout=60, json={**body, "tool_choice": "required"})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["message"].get("tool_calls"):
            assert {c["function"]["name"] for c in choice["message"]["tool_calls"]} <= {
                "pick", "noop"}
        else:
            assert choice["finish_reason"] == "length"
            assert re.sub(r"\s", "", choice["message"]["content"]).startswith("[")
        streamed, calls, finish = "", [], None
        with httpx.stream("POST", url, headers=AUTH, timeout=60,
                          json={**body, "tool_choice": NAMED, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    c = json.loads(line[6:])["choices"][0]
                    streamed += c["delta"].get("content") or ""
                    calls += c["delta"].get("tool_calls") or []
                    finish = c["finish_reason"] or finish
        assert finish is not None
        joined = join_tool_calls(calls)  # (the arguments stream in pieces)
        if finish == "length" and joined:  # cut off after the call began: it stands as sent
            _check_named({"content": streamed + joined[0]["function"]["arguments"]}, finish)
        else:
            _check_named({"content": streamed, "tool_calls": joined}, finish, "tool_calls")
        empty = httpx.post(url, headers=AUTH, timeout=60,
                           json={**body, "tools": [], "tool_choice": "required"})
        assert empty.status_code == 200, empty.text  # (no tools to force: a plain answer)
        assert not empty.json()["choices"][0]["message"].get("tool_calls")
        both = httpx.post(url, headers=AUTH, timeout=60, json={
            **body, "tool_choice": NAMED, "response_format": {"type": "json_object"}})
        assert both.status_code == 400 and both.json()["error"]["param"] == "tool_choice"


def test_required_with_no_tools_is_none() -> None:
    """``tool_choice: "required"`` with an empty ``tools`` list is a plain answer (OpenAI's and
    vLLM's), not a 400; without ``tools`` at all, or named, it is refused."""
    from mrv2.entrypoints.openai_protocol import ChatCompletionRequest

    messages = [{"role": "user", "content": "hi"}]
    body = ChatCompletionRequest.model_validate(
        {"messages": messages, "tools": [], "tool_choice": "required"})
    assert body.sampling_params().structured_outputs is None
    assert body.structured_source() is None
    for bad in ({"tool_choice": "required"}, {"tools": [], "tool_choice": NAMED}):
        with pytest.raises(ValueError, match="a forced call needs tools"):
            ChatCompletionRequest.model_validate({"messages": messages, **bad}).sampling_params()
