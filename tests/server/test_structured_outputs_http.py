"""Structured outputs through the OpenAI server: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` / ``guided_*`` fields map onto ``StructuredOutputsParams``; answers
(whole and streamed, completions and chat) match; bad constraints are a 400 naming the field
the request used."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, MODEL, Served, spy_add_request

from mrv2 import StructuredOutputsParams
from mrv2.entrypoints.openai_protocol import ChatCompletionRequest, CompletionRequest

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a"],
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}
MESSAGES = [{"role": "user", "content": "hi"}]
#: vLLM's structural tag (its ``response_format`` type and ``structured_outputs`` field).
TAG = {"type": "structural_tag", "triggers": ["<f="], "structures": [
    {"begin": "<f=a>", "schema": SCHEMA, "end": "</f>"}]}


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


@pytest.mark.parametrize(("fields", "want"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "text", "json_schema": None}}, None),  # (a client's nulls)
    ({"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}},
     StructuredOutputsParams(regex="[a-z]+", disable_any_whitespace=True)),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_regex": "a|b"}, StructuredOutputsParams(regex="a|b")),
    ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
    ({"guided_grammar": 'start: "a"'}, StructuredOutputsParams(grammar='start: "a"')),
    ({"response_format": TAG}, StructuredOutputsParams(structural_tag=TAG)),
    ({"structured_outputs": {"structural_tag": json.dumps(TAG)}},
     StructuredOutputsParams(structural_tag=json.dumps(TAG))),
    # every field of vLLM's StructuredOutputsParams, as a client that dumps it sends them
    ({"structured_outputs": {"json": SCHEMA, "regex": None, "choice": None, "grammar": None,
                             "json_object": None, "disable_any_whitespace": False,
                             "disable_additional_properties": True, "whitespace_pattern": " ?",
                             "structural_tag": None}},
     StructuredOutputsParams(json=SCHEMA, disable_additional_properties=True,
                             whitespace_pattern=" ?")),
    # vLLM's older top-level fields (until 0.12), as its guided_* ones
    ({"structural_tag": json.dumps(TAG)}, StructuredOutputsParams(structural_tag=json.dumps(TAG))),
    ({"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"},
     StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?")),
    ({"response_format": {"type": "json_object"}, "guided_whitespace_pattern": "[ ]?"},
     StructuredOutputsParams(json_object=True, whitespace_pattern="[ ]?")),
    ({"guided_whitespace_pattern": " "}, None),  # (no constraint: nothing to shape)
    ({}, None),
])
def test_the_fields_map_onto_the_params(fields: dict[str, Any],
                                        want: StructuredOutputsParams | None) -> None:
    assert _chat(**fields).sampling_params().structured_outputs == want
    body = CompletionRequest.model_validate({"prompt": "x", **fields})
    assert body.sampling_params().structured_outputs == want


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"response_format": {"type": "xml"}}, "response_format", "expected type text, json_object"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "structured_outputs",
     "unknown backend"),
    ({"structured_outputs": {"structural_tag": "[1]"}}, "structured_outputs",
     "structural_tag is invalid"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "give one of"),
    ({"guided_regex": "a", "guided_whitespace_pattern": ""}, "guided_whitespace_pattern",
     "guided_whitespace_pattern='' is invalid"),
    ({"structural_tag": "[1]"}, "structural_tag", "structural_tag is invalid"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": '{"type": '
                 '"object"}'}}], "tool_choice": "required"}, "tools", "tools is invalid"),
])
def test_bad_fields_name_themselves(fields: dict[str, Any], param: str, message: str) -> None:
    from mrv2.entrypoints.openai_protocol import value_error_param

    body = _chat(**fields)
    with pytest.raises(ValueError, match=message) as info:
        body.sampling_params()
    assert value_error_param(str(info.value), body) == param


def _post(server: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers=AUTH, timeout=60,
                      json={"model": MODEL, **body})


def _streamed_text(server: Served, path: str, body: dict[str, Any]) -> str:
    text = ""
    with httpx.stream("POST", f"{server.url}{path}", headers=AUTH, timeout=60,
                      json={"model": MODEL, "stream": True, **body}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


def test_answers_match_whole_and_streamed(server: Served) -> None:
    choices = ["Paris", "London"]
    r = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 20,
                                               "temperature": 0.9, "guided_choice": choices})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] in choices and choice["finish_reason"] == "stop"
    compact = {"json": SCHEMA, "disable_any_whitespace": True}
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 20, "n": 2,
                                          "structured_outputs": compact})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert 0 <= json.loads(c["text"])["a"] <= 9 and c["finish_reason"] == "stop"
    text = _streamed_text(server, "/v1/completions", {"prompt": "x", "max_tokens": 20,
                                                      "guided_regex": "[0-9]{4}"})
    assert re.fullmatch("[0-9]{4}", text), text
    text = _streamed_text(server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 20,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
            "type": "object", "properties": {"k": {"enum": ["v", "w"]}}, "required": ["k"],
            "additionalProperties": False}}}})
    # (any whitespace may come between JSON tokens, as vLLM's default: the random model may
    # spend max_tokens on it; without it the answer is a prefix of one of two texts)
    compact_text = re.sub(r"\s", "", text)
    assert compact_text and any(want.startswith(compact_text)
                                for want in ('{"k":"v"}', '{"k":"w"}')), text


def test_a_bad_schema_is_a_400_naming_the_field_used(server: Served) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nonsense"}}}
    r = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "response_format": bad})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and "nonsense" in error["message"]
    r = _post(server, "/v1/completions", {"prompt": "x", "guided_regex": "[0-9"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
    assert r.json()["error"]["message"].startswith("guided_regex: ")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        r = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "tools": tools,
                                                   "tool_choice": choice})
        assert r.status_code == 400, r.text  # a forced call's schema is its tools'
        error = r.json()["error"]
        assert error["param"] == "tools" and error["message"].startswith("tools: ")
        assert "uniqueItems" in error["message"]
    for fields, param in (
            ({"response_format": {"type": "structural_tag", "format": {"type": "any_text"}}},
             "response_format"),  # (xgrammar's form of the tag)
            ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs")):
        r = _post(server, "/v1/chat/completions", {"messages": MESSAGES, **fields})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text
    assert _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_vllms_grammar_and_tag_forms_are_served(server: Served) -> None:
    """What a vLLM client sends: an EBNF (GBNF) grammar, a structural tag, the JSON options
    (``disable_additional_properties``, ``whitespace_pattern``) and every unset field as
    null."""
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 20, "n": 2,
                                          "structured_outputs": {
                                              "grammar": 'root ::= "yes" | "no"'}})
    assert r.status_code == 200, r.text
    assert all(c["text"] in ("yes", "no") and c["finish_reason"] == "stop"
               for c in r.json()["choices"]), r.text
    loose = {"type": "object", "required": ["a"],
             "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}
    r = _post(server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 20, "temperature": 0.9, "n": 2,
        "structured_outputs": {"json": loose, "regex": None, "choice": None, "json_object": None,
                               "disable_additional_properties": True,
                               "whitespace_pattern": "[ ]?", "structural_tag": None}})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:  # (closed: nothing but "a"; no newline, at most a space)
        text = c["message"]["content"]
        assert c["finish_reason"] == "stop" and list(json.loads(text)) == ["a"], text
        assert "\n" not in text and "  " not in text, text
    r = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8,
                                               "response_format": TAG})
    assert r.status_code == 200, r.text


def test_a_reasoning_server_holds_only_what_follows_the_thinking_block(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``--reasoning-parser``, a chat request's structured output (its own, or a forced
    tool call's) and a completion request's reach the engine marked with the parser (the
    engine's tests show what the mark does); without a structured output, or without the
    parser, it is not marked."""
    from conftest import serve

    seen: list[str | None] = []


    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20}
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
    cases = [({"guided_choice": ["a", "b"]}, "qwen3"), ({}, None),
             ({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}},
              "qwen3")]
    for parser in ("qwen3", None):
        for served in serve(model_dir, reasoning_parser=parser):
            spy_add_request(monkeypatch, served.engine, lambda p: seen.append(p._reasoning))
            for extra, want in cases:
                r = httpx.post(f"{served.url}/v1/chat/completions", headers=AUTH, timeout=60,
                               json={**body, **extra})
                assert r.status_code == 200, r.text
                assert seen.pop() == (want if parser else None), (parser, extra)
            # a completion's too (vLLM's grammar waits for the end of the reasoning on every
            # request; the prompt, here a raw one, says where the block stands)
            for extra, want in cases[:2]:
                r = httpx.post(f"{served.url}/v1/completions", headers=AUTH, timeout=60,
                               json={"model": MODEL, "prompt": "x", "max_tokens": 20, **extra})
                assert r.status_code == 200, r.text
                assert seen.pop() == (want if parser else None), (parser, extra)
