"""Tool calls (``--enable-auto-tool-choice --tool-call-parser hermes``): whole answers and
streams cut anywhere give the same content and calls; the chat route passes tools to the
template and messages with calls back into it; answers carry ``tool_calls`` and finish with
``tool_calls``, streamed or not; without the flags, tools are refused as before; a parser whose
markers are special tokens (glm45) decodes a request with tools keeping them; a mistral server
whose tokenizer has ``[TOOL_CALLS]`` as a special token answers calls, forced ones too (ids
Mistral's template takes). The other formats, text only: test_tool_parsers.py."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, join_tool_calls, spy_add_request

from mrv2.contract.params import SamplingParams
from mrv2.engine.outputs import CompletionOutput, RequestOutput
from mrv2.engine.tokenizer import Tokenizer
from mrv2.entrypoints.responses import Stream
from mrv2.entrypoints.tool_calls import (
    ToolCalling,
    check_tool_call_parser,
    get_tool_parser,
    parse_tool_calls,
)
from mrv2.entrypoints.tool_stream import ToolCallStream
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
HERMES = ToolCalling(get_tool_parser("hermes"))
TEMPLATE = ("{% if tools %}TOOLS {% for t in tools %}{{ t['function']['name'] }} "
            "{% endfor %}{% endif %}{% for m in messages %}{{ m['role'] }}: "
            "{% if m.tool_calls %}{{ m.tool_calls[0]['function']['arguments']['city'] }}"
            "{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}")
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CASES = [  # (text, content, [(name, arguments JSON)])
    ("Let me check.\n" + CALL, "Let me check.\n", [("weather", '{"city": "Paris"}')]),
    (CALL + "\n" + CALL.replace("Paris", "Lyon"), None,
     [("weather", '{"city": "Paris"}'), ("weather", '{"city": "Lyon"}')]),
    ('<tool_call>{"name": "now", "arguments": "{}"}', None, [("now", "{}")]),  # cut at EOS
    # arguments as a string: the JSON it holds, else that string's JSON (never invalid JSON)
    ('<tool_call>{"name": "weather", "arguments": "{\\"city\\":\\"Paris\\"}"}</tool_call>', None,
     [("weather", '{"city": "Paris"}')]),
    ('<tool_call>{"name": "weather", "arguments": "Paris"}</tool_call>', None,
     [("weather", '"Paris"')]),
    ("No tools needed.", "No tools needed.", []),
    ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ("a <tool_c b", "a <tool_c b", []),
    ("", None, []),
]


def _calls(calls: list[Any]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def test_whole_answers() -> None:
    for text, content, calls in CASES:
        got_content, got_calls = parse_tool_calls(text)
        assert (got_content, _calls(got_calls)) == (content, calls), text
        assert all(c.id.startswith("call_") for c in got_calls)


def test_a_stream_cut_anywhere_gives_the_whole_answer() -> None:
    rng = random.Random(0)
    for text, content, calls in CASES:
        for _ in range(40):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 5)))
            deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            stream = ToolCallStream()
            parts = [stream.feed(d, final=i == len(deltas) - 1) for i, d in enumerate(deltas)]
            assert ("".join(c for c, _ in parts) or None) == content, (text, deltas)
            joined = join_tool_calls([p.as_dict() for _, ps in parts for p in ps])
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in joined] == calls


def test_the_parser_name_is_checked() -> None:
    assert check_tool_call_parser("hermes") == "hermes"
    allowed = ("hermes, qwen3_coder, qwen3_xml, glm45, glm47, minimax_m2, deepseek_v3, "
               "deepseek_v31, deepseek_v32, kimi_k2, llama3_json, llama4_json, pythonic, "
               "llama4_pythonic, mistral, openai")
    for name in allowed.split(", "):
        assert check_tool_call_parser(name) == name == get_tool_parser(name).name
    with pytest.raises(ValueError, match=f"tool_call_parser='json': allowed values are "
                       f"{allowed}$"):
        check_tool_call_parser("json")
    with pytest.raises(ValueError, match="allowed values are hermes"):
        get_tool_parser("glm")


class _Body:
    include_usage = False
    continuous_usage = False


def _output(text: str, finished: bool, reason: str | None = None) -> RequestOutput:
    """A delta output (as the server asks for) of ``text``, a token a character."""
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1],
                         outputs=[CompletionOutput(0, text, list(range(len(text))), reason)],
                         finished=finished, delta=True)


def test_streamed_deltas_carry_the_calls_and_their_finish_reason() -> None:
    stream = Stream(None, "chatcmpl-x", "m", True, SamplingParams(max_tokens=99),  # type: ignore[arg-type]
                    _Body(), ["r"], [([1], None)], tools=HERMES)
    text = "Checking.\n" + CALL
    first = [c for c, _ in stream._deltas(_output(text[:14], False))]  # the tag held
    assert first[0]["delta"] == {"content": "Checking.\n"}
    last = [c for c, _ in stream._deltas(_output(text[14:], True, "stop"))]
    delta = last[0]["delta"]
    assert delta["content"] == "" and last[0]["finish_reason"] == "tool_calls"
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in delta["tool_calls"]] == [(0, "weather", {"city": "Paris"})]


def test_the_server_with_tools(tmp_path: Path, model_dir: Path) -> None:
    """The tools reach the template and a message's calls come back into it (arguments as
    the template's dict); the answer without a call is content; without the flags tools are
    refused, naming them; a forced call naming no offered tool is refused
    (test_forced_tool_calls.py has the forced calls)."""
    from conftest import serve

    template, tools = TEMPLATE, TOOLS
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function", "function": {
                        "name": "weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    tok = Tokenizer.from_pretrained(model_dir)
    tok.set_chat_template(template)
    want = tok.render_chat_template(
        [messages[0], {**messages[1], "tool_calls": [{"function": {
            "name": "weather", "arguments": {"city": "Paris"}}}]}, messages[2]],
        True, tools=tools)
    assert want.startswith("TOOLS weather ") and "assistant: Paristool: sunny" in want
    body = {"messages": messages, "tools": tools, "max_tokens": 3, "temperature": 0}
    for served in serve(model_dir, engine_kwargs={"chat_template": template},
                        tool_call_parser="hermes"):
        response = httpx.post(f"{served.url}/v1/chat/completions", headers=AUTH, timeout=60,
                              json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
        assert answer["usage"]["prompt_tokens"] == len(tok.encode(want,
                                                                  add_special_tokens=False))
        assert answer["choices"][0]["message"].get("tool_calls") in (None, [])
        assert answer["choices"][0]["finish_reason"] == "length"
        counted = httpx.post(f"{served.url}/tokenize", headers=AUTH, timeout=60,
                             json={"messages": messages, "tools": tools}).json()
        assert counted["count"] == answer["usage"]["prompt_tokens"]  # the same prompt
        unknown = httpx.post(f"{served.url}/v1/chat/completions", headers=AUTH, timeout=60,
                             json={**body, "tool_choice": {"type": "function",
                                                           "function": {"name": "nope"}}})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "tool_choice"
    for served in serve(model_dir, engine_kwargs={"chat_template": template}):
        refused = httpx.post(f"{served.url}/v1/chat/completions", headers=AUTH, timeout=60,
                             json=body)
        assert refused.status_code == 400
        assert "--enable-auto-tool-choice" in refused.json()["error"]["message"]


@pytest.mark.parametrize("parallel", [True, False])
def test_a_finished_answers_message(parallel: bool) -> None:
    """The whole answer's message: reasoning apart (with a reasoning parser), content before
    the calls, the calls (the first only without parallel_tool_calls), ``tool_calls``."""
    stream = Stream(None, "chatcmpl-x", "m", True, SamplingParams(max_tokens=99),  # type: ignore[arg-type]
                    _Body(), ["r"], [([1], None)], "qwen3", HERMES, parallel)
    text = "<think>use the tool</think>Checking.\n" + CALL + CALL.replace("Paris", "Lyon")
    choice: dict[str, Any] = {"finish_reason": "stop"}
    message = stream._message(text, choice)
    assert message["reasoning_content"] == "use the tool"
    assert message["content"] == "Checking.\n" and choice["finish_reason"] == "tool_calls"
    cities = [json.loads(c["function"]["arguments"])["city"] for c in message["tool_calls"]]
    assert cities == (["Paris", "Lyon"] if parallel else ["Paris"])
    plain: dict[str, Any] = {"finish_reason": "length"}
    assert stream._message("no call", plain) == {"role": "assistant", "content": "no call",
                                                  "reasoning_content": None}
    assert plain["finish_reason"] == "length"


@pytest.mark.parametrize("parser", ["glm45", "hermes"])
def test_a_parser_with_special_tokens_keeps_them(model_dir: Path, parser: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """glm45's tags are special tokens (and hermes' <tool_call> in some Hermes models, vLLM's
    hermes parser keeps them too): a request offering tools (tool_choice not "none") is decoded
    with skip_special_tokens=False, others as asked; answers stream and finish."""
    from conftest import serve

    messages = [{"role": "user", "content": "Weather in Paris?"}]
    body: dict[str, Any] = {"messages": messages, "tools": TOOLS, "max_tokens": 3,
                            "temperature": 0}
    seen: list[bool] = []


    for served in serve(model_dir, engine_kwargs={"chat_template": TEMPLATE},
                        tool_call_parser=parser):
        spy_add_request(monkeypatch, served.engine, lambda p: seen.append(p.skip_special_tokens))
        cases: list[tuple[dict[str, Any], bool]] = [
            ({}, False), ({"stream": True}, False), ({"tool_choice": "none"}, True),
            ({"tools": None}, True), ({"skip_special_tokens": True}, False)]
        for extra, skip in cases:
            response = httpx.post(f"{served.url}/v1/chat/completions", headers=AUTH,
                                  timeout=60, json={**body, **extra})
            assert response.status_code == 200, response.text
            if extra.get("stream"):
                assert response.text.endswith("data: [DONE]\n\n")
            else:
                assert response.json()["choices"][0]["finish_reason"] == "length"
            assert seen.pop() is skip, extra
    if parser != "glm45":
        return
    for served in serve(model_dir, engine_kwargs={"chat_template": TEMPLATE}):
        refused = httpx.post(f"{served.url}/v1/chat/completions", headers=AUTH, timeout=60,
                             json=body)
        assert refused.status_code == 400
        assert "glm45" in refused.json()["error"]["message"]  # the parsers are named


def test_a_glm_answer_through_the_stream() -> None:
    """A glm45 answer, whole and streamed: content before the calls, typed arguments."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer"}}}}}]
    calling = ToolCalling(get_tool_parser("glm45"), tools)
    text = ("Checking.<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
            "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
    choice: dict[str, Any] = {"finish_reason": "stop"}
    stream = Stream(None, "chatcmpl-x", "m", True, SamplingParams(max_tokens=99),  # type: ignore[arg-type]
                    _Body(), ["r"], [([1], None)], tools=calling)
    message = stream._message(text, choice)
    assert message["content"] == "Checking." and choice["finish_reason"] == "tool_calls"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris", "days": 3}
    first = [c for c, _ in stream._deltas(_output(text[:12], False))]  # the tag held
    assert first[0]["delta"] == {"content": "Checking."}
    last = [c for c, _ in stream._deltas(_output(text[12:], True, "stop"))][0]
    assert last["delta"]["content"] == "" and last["finish_reason"] == "tool_calls"
    assert [json.loads(c["function"]["arguments"]) for c in last["delta"]["tool_calls"]] == [
        {"city": "Paris", "days": 3}]


#: Mistral's template's check of an earlier call's id (Mistral Small 3.x's, abridged).
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools|length }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{% if c.id is not string or c.id|length != 9 %}{{ raise_exception('Tool call IDs should "
    "be alphanumeric strings with length 9!') }}{% endif %}[TOOL_CALLS]"
    "{{ c['function']['name'] }}[CALL_ID]{{ c.id }}[ARGS]{{ c['function']['arguments']|tojson }}"
    "{% endfor %}{% elif m['role'] == 'tool' %}[TOOL_RESULTS]{{ m['tool_call_id'] }}"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}{% endif %}{% endfor %}")


def _sse(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_mistral_server_with_special_tokens(tmp_path: Path) -> None:
    """``--tool-call-parser mistral`` with a tokenizer whose ``[TOOL_CALLS]`` and ``[ARGS]``
    are special tokens (as in Mistral's): an answer made of them (forced by a grammar of their
    token ids) is decoded keeping them and comes back as a call, whole and streamed, its id 9
    letters and digits, which Mistral's template takes back in the next turn (it refuses
    ``call_...``); the default decode would have lost the markers."""
    from conftest import serve

    make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(tmp_path, special_tokens=["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"])
    tok = Tokenizer.from_pretrained(tmp_path)
    text = 'Hi[TOOL_CALLS]weather[ARGS]{"city": "Paris"}'
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == 'Hiweather{"city": "Paris"}'
    calls_id, args_id = tok.hf.convert_tokens_to_ids(["[TOOL_CALLS]", "[ARGS]"])
    grammar = (f'start: "Hi" <[{calls_id}]> "weather" <[{args_id}]> '
               + json.dumps('{"city": "Paris"}'))
    question = {"role": "user", "content": "Weather?"}
    body = {"messages": [question], "tools": TOOLS, "max_tokens": 40, "temperature": 0,
            "structured_outputs": {"grammar": grammar}}
    url = "/v1/chat/completions"
    for served in serve(tmp_path, engine_kwargs={"chat_template": MISTRAL_TEMPLATE,
                                                 "max_model_len": 128},
                        tool_call_parser="mistral"):
        answer = httpx.post(served.url + url, headers=AUTH, timeout=60, json=body).json()
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "tool_calls", answer
        assert choice["message"]["content"] == "Hi"
        (call,) = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"]), call
        chunks = _sse(httpx.post(served.url + url, headers=AUTH, timeout=60,
                                 json={**body, "stream": True}).text)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == "Hi"
        pieces = [c for d in deltas for c in d.get("tool_calls") or []]
        (streamed,) = join_tool_calls(pieces)
        assert streamed["function"] == call["function"] and len(pieces) > 2  # (in pieces)
        assert re.fullmatch(r"[A-Za-z0-9]{9}", streamed["id"]), streamed
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # the next turn: the call and its answer go back into Mistral's template
        turn = [question, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
        again = httpx.post(served.url + url, headers=AUTH, timeout=60,
                           json={"messages": turn, "tools": TOOLS, "max_tokens": 2})
        assert again.status_code == 200, again.text
        turn[1] = {**turn[1], "tool_calls": [{**call, "id": "call_0123456789abcdef"}]}
        refused = httpx.post(served.url + url, headers=AUTH, timeout=60,
                             json={"messages": turn, "tools": TOOLS, "max_tokens": 2})
        assert refused.status_code == 400 and "length 9" in refused.text, refused.text


def test_a_mistral_servers_forced_calls_have_mistral_ids(tmp_path: Path) -> None:
    """A forced call (``tool_choice`` named or ``required``: a grammar, not the parser) on a
    ``--tool-call-parser mistral`` server gets the parser's 9-character id, as vLLM gives a
    Mistral model's forced calls (``MistralToolCall``), whole and streamed; Mistral's template
    takes it back in the next turn (it refused the ``call_...`` ids given before). The
    answer is fixed: the grammar and ``allowed_token_ids`` (no whitespace) leave one text."""
    from conftest import serve

    make_tiny_checkpoint(tmp_path, "LlamaForCausalLM", vocab_size=320)
    make_tiny_tokenizer(tmp_path, special_tokens=["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"])
    tok = Tokenizer.from_pretrained(tmp_path)
    tools = [{"type": "function", "function": {"name": "noop", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]
    assert tok.eos_token_id is not None
    allowed = sorted({*tok.encode('[{"name":"noop","parameters":{}}]', add_special_tokens=False),
                      tok.eos_token_id})
    question = {"role": "user", "content": "Go"}
    body = {"messages": [question], "tools": tools, "max_tokens": 60, "temperature": 0,
            "allowed_token_ids": allowed, "parallel_tool_calls": False}
    url = "/v1/chat/completions"
    named = {"type": "function", "function": {"name": "noop"}}
    for served in serve(tmp_path, engine_kwargs={"chat_template": MISTRAL_TEMPLATE,
                                                 "max_model_len": 128},
                        tool_call_parser="mistral"):
        for choice in (named, "required"):
            answer = httpx.post(served.url + url, headers=AUTH, timeout=60,
                                json={**body, "tool_choice": choice}).json()
            (call,) = answer["choices"][0]["message"]["tool_calls"]
            assert call["function"] == {"name": "noop", "arguments": "{}"}, answer
            assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"]), call
            chunks = _sse(httpx.post(served.url + url, headers=AUTH, timeout=60,
                                     json={**body, "tool_choice": choice, "stream": True}).text)
            (streamed,) = join_tool_calls([
                c for chunk in chunks if chunk["choices"]
                for c in chunk["choices"][0]["delta"].get("tool_calls") or []])
            assert streamed["function"] == {"name": "noop", "arguments": "{}"}
            assert re.fullmatch(r"[A-Za-z0-9]{9}", streamed["id"]), streamed
            turn = [question, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": "done"}]
            again = httpx.post(served.url + url, headers=AUTH, timeout=60,
                               json={"messages": turn, "tools": tools, "max_tokens": 2})
            assert again.status_code == 200, again.text
