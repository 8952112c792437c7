"""What the chat template is given of a Responses API conversation
(:mod:`mrv2.entrypoints.responses_context`): an earlier answer's reasoning before its call,
sent back as input items or kept by the store, is rendered back (gpt-oss: the analysis before
the call, as harmony asks), a finished turn's is not; ``truncation: "auto"``'s cuts. The chat
route's assistant messages sent back with ``reasoning`` / ``reasoning_content`` and calls
likewise (gpt-oss)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, MODEL, Served

from mrv2.contract.params import SamplingParams
from mrv2.engine.outputs import CompletionOutput, RequestOutput
from mrv2.engine.tokenizer import Tokenizer
from mrv2.entrypoints.harmony import MARKERS
from mrv2.entrypoints.openai_messages import ChatMessage
from mrv2.entrypoints.openai_responses import ResponsesRequest, ResponsesStream
from mrv2.entrypoints.responses import _Answer
from mrv2.entrypoints.responses_context import (
    current_reasoning,
    harmony_messages,
    truncation_cuts,
)
from mrv2.entrypoints.responses_store import ResponseStore
from mrv2.entrypoints.tool_calls import ToolCalling, get_tool_parser
from mrv2.testing import make_tiny_checkpoint, make_tiny_tokenizer

AUTH = {"Authorization": f"Bearer {API_KEY}"}
#: gpt-oss's chat template's rules, as this test needs them (written for it): a call's
#: analysis from ``thinking`` (else from ``content``; both refused), rendered only when no
#: answer (an assistant message without calls) follows; the first call of a message; a tool's
#: result named after the last call.
HARMONY_TEMPLATE = """
{%- set last = namespace(call=none) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' -%}
    <|start|>developer<|message|>{{ m.content }}<|end|>
  {%- elif m.role == 'assistant' and m.tool_calls -%}
    {%- set later = namespace(answer=false) -%}
    {%- for n in messages[loop.index:] -%}
      {%- if n.role == 'assistant' and not n.tool_calls -%}
        {%- set later.answer = true -%}
      {%- endif -%}
    {%- endfor -%}
    {%- if m.content and m.thinking -%}
      {{ raise_exception('Cannot pass both content and thinking with tool calls') }}
    {%- endif -%}
    {%- set analysis = m.thinking or m.content -%}
    {%- if analysis and not later.answer -%}
      <|start|>assistant<|channel|>analysis<|message|>{{ analysis }}<|end|>
    {%- endif -%}
    {%- set call = m.tool_calls[0].function -%}
    <|start|>assistant to=functions.{{ call.name }}<|channel|>commentary json<|message|>
    {{- call.arguments | tojson }}<|call|>
    {%- set last.call = call.name -%}
  {%- elif m.role == 'assistant' -%}
    <|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
  {%- elif m.role == 'tool' -%}
    <|start|>functions.{{ last.call }} to=assistant<|channel|>commentary<|message|>
    {{- m.content | tojson }}<|end|>
  {%- else -%}
    <|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}
"""
TOOLS = [{"type": "function", "name": "get_weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
THOUGHT = "Need the weather."
REASONING = {"type": "reasoning", "id": "rs_1", "summary": [],
             "content": [{"type": "reasoning_text", "text": THOUGHT}]}
CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city": "Paris"}'}
OUTPUT = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
ANALYSIS = "<|start|>assistant<|channel|>analysis<|message|>"
#: The reasoning rendered back: the analysis right before its call.
BEFORE_THE_CALL = (ANALYSIS + THOUGHT + "<|end|><|start|>assistant to=functions.get_weather"
                   "<|channel|>commentary json<|message|>")


def _harmony_tokenizer(path: Path) -> Tokenizer:
    make_tiny_tokenizer(path, special_tokens=MARKERS, chat_template=HARMONY_TEMPLATE)
    return Tokenizer.from_pretrained(path)


def _prompt(tok: Tokenizer, body: ResponsesRequest,
            previous: list[dict[str, Any]] | None = None, harmony: bool = True) -> str:
    chat = body.as_chat(previous, harmony)
    return tok.apply_chat_template([m.as_dict() for m in chat.messages], True,
                                   tokenize=False, tools=chat.tools)


@pytest.fixture(scope="module")
def harmony_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("harmony")
    make_tiny_checkpoint(path, "LlamaForCausalLM", vocab_size=336,  # (the markers' ids too)
                         max_position_embeddings=512)
    _harmony_tokenizer(path)
    return path


def test_reasoning_before_a_call_is_rendered_back(harmony_dir: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss's answer sent back as input (``input += response.output``, the API's way to
    go on after a call): its reasoning item is the analysis before its call in the prompt of
    the follow-up, as harmony asks (vLLM's too), not dropped; with a preamble (a message item
    of the assistant's) before the call too, both are, the template's analysis; a finished
    turn's (an answer after the call) is not rendered."""
    from conftest import serve

    for served in serve(harmony_dir, {"max_model_len": 512}, reasoning_parser="openai_gptoss",
                        tool_call_parser="openai"):
        _check_follow_ups(served, monkeypatch)


def _prompts_of(served: Served, monkeypatch: pytest.MonkeyPatch, path: str,
                body: Callable[[list[dict[str, Any]]], dict[str, Any]]
                ) -> Callable[[list[dict[str, Any]]], str]:
    """A call of route ``path`` with ``body(items)`` (answered 200): the prompt the engine
    got for it, decoded with its special tokens."""
    prompts: list[str] = []
    add, tok = served.engine.add_request, served.engine.tokenizer
    assert tok is not None

    def spy(ids: list[int], *args: Any, **kwargs: Any) -> Any:
        prompts.append(tok.decode(ids, skip_special_tokens=False))
        return add(ids, *args, **kwargs)

    monkeypatch.setattr(served.engine, "add_request", spy)

    def follow_up(items: list[dict[str, Any]]) -> str:
        response = httpx.post(f"{served.url}{path}", headers=AUTH, timeout=60,
                              json=body(items))
        assert response.status_code == 200, response.text
        return prompts.pop()

    return follow_up


def _check_follow_ups(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    follow_up = _prompts_of(served, monkeypatch, "/v1/responses", lambda items: {
        "model": MODEL, "tools": TOOLS, "temperature": 0, "max_output_tokens": 1,
        "input": items})
    user = {"role": "user", "content": "Weather?"}
    assert BEFORE_THE_CALL in follow_up([user, REASONING, CALL, OUTPUT])
    preamble = {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "Checking."}]}
    assert (ANALYSIS + THOUGHT + "\nChecking.<|end|><|start|>assistant to=functions."
            in follow_up([user, REASONING, preamble, CALL, OUTPUT]))
    answer = {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Sunny."}]}
    done = follow_up([user, REASONING, CALL, OUTPUT, REASONING, answer,
                      {"role": "user", "content": "And Rome?"}])
    assert THOUGHT not in done and "<|channel|>final<|message|>Sunny." in done


CHAT_CALL = {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def test_a_chat_calls_reasoning_is_rendered_back(harmony_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss through /v1/chat/completions (vLLM's harmony chat route): an assistant message
    sent back with its ``reasoning_content`` (or ``reasoning``) and ``tool_calls`` is the
    analysis before the call in the follow-up's prompt (its preamble content after it: the
    template refuses a call with both); a finished turn's is not rendered."""
    from conftest import serve

    for served in serve(harmony_dir, {"max_model_len": 512}, reasoning_parser="openai_gptoss"):
        _check_chat_follow_ups(served, monkeypatch)


def _check_chat_follow_ups(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    follow_up = _prompts_of(served, monkeypatch, "/v1/chat/completions", lambda messages: {
        "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 1})
    user = {"role": "user", "content": "Weather?"}
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    call = {"role": "assistant", "content": None, "reasoning_content": THOUGHT,
            "tool_calls": [CHAT_CALL]}
    assert BEFORE_THE_CALL in follow_up([user, call, tool])
    preamble = {"role": "assistant", "content": "Checking.", "reasoning": THOUGHT,
                "tool_calls": [CHAT_CALL]}
    assert (ANALYSIS + THOUGHT + "\nChecking.<|end|><|start|>assistant to=functions."
            in follow_up([user, preamble, tool]))
    answer = {"role": "assistant", "content": "Sunny.", "reasoning": "It is sunny."}
    done = follow_up([user, call, tool, answer, {"role": "user", "content": "Rome?"}])
    assert THOUGHT not in done and "<|channel|>final<|message|>Sunny." in done


def test_harmony_messages_keep_what_needs_no_change() -> None:
    """Only the assistant calls with reasoning (and the finished turns' reasoning) change;
    other messages are the ones sent (content parts kept); twice is once; the calls' analysis
    is the reasoning of the turn under way only."""
    parts = ChatMessage(role="user", content=[{"type": "text", "text": "Weather?"}])
    call = ChatMessage.model_validate({"role": "assistant", "content": "",
                                       "reasoning_content": "r1", "tool_calls": [CHAT_CALL]})
    tool = ChatMessage.model_validate({"role": "tool", "content": "sunny",
                                       "tool_call_id": "call_1"})
    answer = ChatMessage.model_validate({"role": "assistant", "content": "Sunny.",
                                         "reasoning": "r2"})
    again = ChatMessage.model_validate({"role": "assistant", "content": "Checking.",
                                        "reasoning": "r3", "tool_calls": [CHAT_CALL]})
    messages = [parts, call, tool, answer, parts, again]
    got = harmony_messages(messages)
    assert got[0] is parts and got[2] is tool and got[4] is parts
    dicts = [m.as_dict() for m in got]
    assert [d.get("thinking") for d in dicts] == [None] * 5 + ["r3\nChecking."]
    assert not any(k in d for d in dicts for k in ("reasoning", "reasoning_content"))
    assert dicts[5]["content"] == "" and dicts[1]["content"] == ""
    assert [m.as_dict() for m in harmony_messages(got)] == dicts
    broken = ChatMessage.model_validate({"role": "assistant", "content": "", "reasoning": "r",
                                         "tool_calls": ["x"]})
    assert harmony_messages([broken])[0] is broken  # (the rendering's 400 names it)


class _Body:
    include_usage = False
    continuous_usage = False


def _stream(store: ResponseStore, conversation: list[dict[str, Any]]) -> ResponsesStream:
    """A gpt-oss answer's stream (both harmony parsers), kept in ``store`` after
    ``conversation``."""
    return ResponsesStream(None, "resp", "m", True, SamplingParams(max_tokens=99), _Body(),
                           ["r"], [([1], None)], "openai_gptoss",
                           ToolCalling(get_tool_parser("openai")),
                           request=ResponsesRequest(input="hi"), store=store,
                           conversation=conversation)


def _answer(text: str, store: ResponseStore, conversation: list[dict[str, Any]]) -> str:
    """Store gpt-oss's answer ``text`` (whole) after ``conversation``; its response's id."""
    stream = _stream(store, conversation)
    stream.answers = {"r": {0: _Answer()}}
    stream.answers["r"][0].add(CompletionOutput(0, text, [0] * len(text), "stop"))
    return str(stream._whole()["id"])


def test_a_stored_call_keeps_its_reasoning(tmp_path: Path) -> None:
    """``previous_response_id`` after an answer that called a tool: the store keeps the
    answer's reasoning, and the follow-up's prompt has it as the analysis before the call;
    after the final answer (the turn finished) it has none of the turn's reasoning."""
    tok, store = _harmony_tokenizer(tmp_path), ResponseStore()
    user = [{"role": "user", "content": "Weather?"}]
    called = _answer("<|channel|>analysis<|message|>" + THOUGHT + "<|end|><|start|>assistant"
                     "<|channel|>commentary to=functions.get_weather <|constrain|>json"
                     '<|message|>{"city": "Paris"}', store, user)
    record = store.get(called)
    assert record is not None and record.messages[-1]["reasoning"] == THOUGHT
    call_id = record.response["output"][-1]["call_id"]
    body = ResponsesRequest(previous_response_id=called, tools=TOOLS, input=[
        {"type": "function_call_output", "call_id": call_id, "output": "sunny"}])
    assert BEFORE_THE_CALL in _prompt(tok, body, record.messages)
    conversation = body.conversation(record.messages)
    answered = _answer("<|channel|>analysis<|message|>It is sunny.<|end|><|start|>assistant"
                       "<|channel|>final<|message|>Sunny.", store, conversation)
    record = store.get(answered)
    assert record is not None
    last = _prompt(tok, ResponsesRequest(input="And Rome?", tools=TOOLS), record.messages)
    assert THOUGHT not in last and "It is sunny." not in last and "Sunny." in last


def test_other_templates_are_given_the_reasoning_as_reasoning_content() -> None:
    """Without harmony, an earlier call's reasoning is its assistant message's ``reasoning``
    (``reasoning_content`` too: Qwen3's template renders it in the turn under way), not
    ``thinking``; a finished turn's is left out; one with no assistant message after it (the
    user speaks next) is dropped."""
    user = {"role": "user", "content": "Weather?"}
    chat = ResponsesRequest(input=[user, REASONING, CALL, OUTPUT]).as_chat()
    call = chat.messages[1].as_dict()
    assert call["reasoning"] == call["reasoning_content"] == THOUGHT
    assert "thinking" not in call and call["tool_calls"]
    answer = {"type": "message", "role": "assistant", "content": "Sunny."}
    chat = ResponsesRequest(input=[user, REASONING, CALL, OUTPUT, answer, REASONING,
                                   {"role": "user", "content": "And Rome?"}]).as_chat()
    assert not any("reasoning" in m.as_dict() for m in chat.messages)
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool", "assistant", "user"]


def test_current_reasoning_and_cuts() -> None:
    """Reasoning is kept after the last answer only; ``truncation: "auto"`` may drop the
    first messages after the system ones, never leaving a tool's result first nor dropping
    the last message."""
    call = {"role": "assistant", "content": "", "reasoning": "r1",
            "tool_calls": [{"id": "c", "type": "function",
                            "function": {"name": "f", "arguments": "{}"}}]}
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "s"}, {"role": "user", "content": "u"}, call,
        {"role": "tool", "tool_call_id": "c", "content": "x"},
        {"role": "assistant", "content": "a", "reasoning": "r2"},
        {"role": "user", "content": "v"}, {**call, "reasoning": "r3"}]
    kept = current_reasoning(messages)
    assert [m.get("reasoning") for m in kept] == [None] * 6 + ["r3"]
    assert messages[2]["reasoning"] == "r1"  # (copies)
    assert truncation_cuts(messages) == [0, 1, 3, 4, 5]
    assert truncation_cuts(messages[:2]) == [0]


def test_a_truncated_request_keeps_its_instructions_and_system_messages() -> None:
    body = ResponsesRequest(instructions="Be brief.", input=[
        {"role": "developer", "content": "Rules."}, {"role": "user", "content": "one"},
        {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"}])
    assert body.truncation_cuts() == [0, 1, 2]
    chat = body.as_chat(drop=2)
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."), ("system", "Rules."), ("user", "three")]


def test_streamed_and_whole_answers_are_stored_alike() -> None:
    """The stored conversation of a streamed answer holds its reasoning as the whole one's."""
    text = ("<|channel|>analysis<|message|>" + THOUGHT + "<|end|><|start|>assistant"
            "<|channel|>commentary to=functions.get_weather <|constrain|>json"
            '<|message|>{"city": "Paris"}')
    store = ResponseStore()
    user = [{"role": "user", "content": "Weather?"}]
    stream = _stream(store, user)

    async def run() -> None:
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        for i, c in enumerate(text):
            last = i == len(text) - 1
            sink.put_nowait(RequestOutput(
                request_id="r", prompt=None, prompt_token_ids=[1],
                outputs=[CompletionOutput(0, c, [0], "stop" if last else None)],
                finished=last, delta=True))
        async for _ in stream.events(sink):
            pass

    asyncio.run(run())
    (record,) = store._items.values()
    assert record.messages[-1]["reasoning"] == THOUGHT
    assert record.messages[-1]["tool_calls"][0]["function"]["name"] == "get_weather"
