"""OpenAI's Responses API (``/v1/responses``) through the official client: a text answer is
the chat route's for the same messages (instructions as the system message, message items
with text parts), whole and streamed as the API's typed events; ``text.format`` holds the
answer to a JSON schema; a cut answer is ``incomplete``; behind ``--reasoning-parser`` the
thinking is a reasoning item; what it cannot honour is refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_util import API_KEY, MODEL, Served

from mrv2.entrypoints.openai_responses import ResponsesRequest

openai = pytest.importorskip("openai")

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def client(server: Served) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def _chat(client: Any, messages: list[dict[str, str]], max_tokens: int) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_completion_tokens=max_tokens)


def test_a_text_answer_is_the_chat_answer(client: Any) -> None:
    chat = _chat(client, [{"role": "user", "content": "Hello world"}], 6)
    response = client.responses.create(model=MODEL, input="Hello world", temperature=0,
                                       max_output_tokens=6)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    if cut:
        assert response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"


def test_instructions_and_message_items(client: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Paris?"}]
    chat = _chat(client, messages, 5)
    response = client.responses.create(
        model=MODEL, instructions="Be brief.", temperature=0, max_output_tokens=5, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Hello!"}]},
            {"role": "user", "content": "Paris?"}])
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_streamed_events_give_the_whole_answer(client: Any) -> None:
    kwargs = {"model": MODEL, "input": "The capital of France", "temperature": 0,
              "max_output_tokens": 8}
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.incomplete" if whole.status == "incomplete"
                         else "response.completed")
    assert events[-1].response.status == whole.status
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind in ("response.output_item.added", "response.content_part.added",
                 "response.output_text.done", "response.content_part.done",
                 "response.output_item.done"):
        assert kinds.count(kind) == 1, kind
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_a_json_schema_format(client: Any) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["a"],
              "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}}
    response = client.responses.create(
        model=MODEL, input="Give a", max_output_tokens=30, temperature=0.9,
        text={"format": {"type": "json_schema", "name": "a", "schema": schema,
                         "strict": True}})
    assert 0 <= json.loads(response.output_text)["a"] <= 9


def test_tools_are_echoed_and_a_cut_message_is_incomplete(server: Served) -> None:
    """The response carries the request's ``tools`` and ``tool_choice`` (``[]`` and ``auto``
    when it gives none); a cut answer's message item is ``incomplete`` like the answer, whole
    and streamed."""
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 1, "temperature": 0}
    for extra, want in (({"tools": tools, "tool_choice": "none"}, (tools, "none")),
                        ({}, ([], "auto"))):
        whole = httpx.post(f"{server.url}/v1/responses", headers=AUTH, timeout=60,
                           json={**body, **extra}).json()
        assert (whole["tools"], whole["tool_choice"]) == want
        assert whole["status"] == "incomplete" and whole["output"][-1]["status"] == "incomplete"
    with httpx.stream("POST", f"{server.url}/v1/responses", headers=AUTH, timeout=60,
                      json={**body, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert events[-1]["type"] == "response.incomplete"
    assert done[-1]["status"] == events[-1]["response"]["output"][-1]["status"] == "incomplete"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                               "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "r"}]}, "input"),
    ({"input": "hello world " * 60}, "input"),  # (the engine's "prompt": this API's input)
    ({"input": [{"type": "function_call_output", "call_id": "c",
                 "output": [{"type": "input_image", "image_url": "data:,"}]}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "reasoning": {"effort": "low", "summary": "brief"}}, "reasoning"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning"),
    ({"input": "x", "include": ["message.output_text.logprob"]}, "include"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),  # (no tools to call)
    ({"input": "x", "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"),
    ({"input": "x", "truncation": "sometimes"}, "truncation"),
    ({"input": "x", "truncation": True}, "truncation"),
])
def test_what_it_cannot_honour_is_refused_by_name(server: Served, body: dict[str, Any],
                                                  param: str) -> None:
    response = httpx.post(f"{server.url}/v1/responses", headers=AUTH, timeout=60,
                          json={"model": MODEL, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert "max_completion_tokens" not in response.json()["error"]["message"]  # (chat's name)


def test_the_thinking_is_a_reasoning_item(model_dir: Path) -> None:
    """deepseek_r1's convention (the prompt opened the block): a random model's text has no
    ``</think>``, so all of it is reasoning, and the message is empty; streamed, the same."""
    from conftest import serve

    for served in serve(model_dir, reasoning_parser="deepseek_r1"):
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0)
        kwargs = {"model": MODEL, "input": "Hello", "temperature": 0, "max_output_tokens": 6}
        whole = client.responses.create(**kwargs)
        reasoning, message = whole.output
        assert reasoning.type == "reasoning" and reasoning.content[0].text
        assert message.type == "message" and whole.output_text == ""
        events = list(client.responses.create(stream=True, **kwargs))
        thought = "".join(e.delta for e in events
                          if e.type == "response.reasoning_text.delta")
        assert thought == reasoning.content[0].text
        assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
        # (all of it reasoning, as its tokens: but a first one held as it may open <think>)
        details = whole.usage.output_tokens_details
        assert whole.usage.output_tokens - 1 <= details.reasoning_tokens <= (
            whole.usage.output_tokens)
        assert events[-1].response.usage.output_tokens_details == details
        # (the reasoning's tokens are not the message's: no logprobs, whole or streamed)
        body = {**kwargs, "top_logprobs": 1}
        whole = httpx.post(f"{served.url}/v1/responses", headers=AUTH, timeout=60, json=body)
        assert whole.json()["output"][-1]["content"][0]["logprobs"] == []
        assert not any(e.get("logprobs") for e in _events(served, body))


TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather",
          "parameters": {"type": "object", "additionalProperties": False,
                         "required": ["city"],
                         "properties": {"city": {"enum": ["Paris", "Rome"]}}}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items()
                                                 if k != "type"}}]


def test_a_forced_function_call_is_a_function_call_item(client: Any) -> None:
    """A named ``tool_choice`` (a structured output, no parser needed): the call comes back
    as a ``function_call`` item whose arguments hold to the tool's parameters, whole and
    streamed (the streamed call's arguments are the final response's). Sampled: a random
    model's greedy JSON pads with whitespace up to any limit, and a sampled one finishes
    within 50 tokens ~93% of the time, so each kind takes the first of up to 8 answers
    that finished (all 8 falling short: ~6e-10)."""
    kwargs = {"model": MODEL, "input": "Weather?", "temperature": 1.0,
              "max_output_tokens": 50, "tools": TOOLS,
              "tool_choice": {"type": "function", "name": "get_weather"}}

    def calls_of(output: Any) -> list[Any]:  # (a call cut by the limit is "incomplete")
        return [i for i in output if i.type == "function_call" and i.status == "completed"]

    response = next((r for r in (client.responses.create(**kwargs) for _ in range(8))
                     if calls_of(r.output)), None)
    assert response is not None, "no answer finished its call"
    (call,) = calls_of(response.output)
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    events = next((e for e in (list(client.responses.create(stream=True, **kwargs))
                               for _ in range(8)) if calls_of(e[-1].response.output)), None)
    assert events is not None, "no streamed answer finished its call"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    (final,) = calls_of(events[-1].response.output)
    assert len(done) == 1 and done[0].arguments == final.arguments
    assert "".join(d.delta for d in deltas) == final.arguments
    assert json.loads(final.arguments)["city"] in ("Paris", "Rome")


def test_a_call_cut_by_the_limit_closes_incomplete() -> None:
    """A streamed call still open when the answer is cut by ``max_output_tokens`` closes
    ``incomplete``, as the response does (its arguments may be half a JSON object: a client
    that runs ``completed`` calls must not run it); a call closed before the cut by the next
    call stays ``completed``."""
    from mrv2.entrypoints.responses_output import OutputItems
    from mrv2.entrypoints.tool_stream import CallDelta

    items = OutputItems("x", lambda kind, **fields: "")
    items.feed([], [], [CallDelta(0, '{"city": "Rome"}', "get_weather", "call_0"),
                        CallDelta(1, '{"city": "Pa', "get_weather", "call_1")])
    output, _ = items.close("incomplete")
    assert [(i["call_id"], i["status"]) for i in output] == [("call_0", "completed"),
                                                            ("call_1", "incomplete")]
    items = OutputItems("y", lambda kind, **fields: "")
    items.feed([], [], [CallDelta(0, '{"city": "Rome"}', "get_weather", "call_0")])
    assert items.close("completed")[0][0]["status"] == "completed"


def test_function_call_items_in_the_input(client: Any) -> None:
    """An earlier call and its output, as input items, are the chat messages of a call and
    its result (the same prompt through the chat template)."""
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_completion_tokens=4, tools=CHAT_TOOLS,
        tool_choice="none", messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    response = client.responses.create(
        model=MODEL, temperature=0, max_output_tokens=4, tools=TOOLS, tool_choice="none",
        input=[{"role": "user", "content": "Weather?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                "arguments": '{"city": "Paris"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content


def _prompt_tokens(client: Any, items: list[dict[str, Any]]) -> int:
    return client.responses.create(model=MODEL, temperature=0, max_output_tokens=1,
                                   tools=TOOLS, tool_choice="none",
                                   input=items).usage.input_tokens


CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
        "arguments": '{"city": "Paris"}'}


def test_a_call_after_an_assistant_message_is_its_turn(client: Any) -> None:
    """A function call item after the assistant's message item (an answer's output sent
    back: its text, then its calls) is that message's ``tool_calls``, one assistant turn, as
    the chat route takes an answer with content and calls (OpenAI's Agents SDK's conversion
    too); not a second assistant message."""
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_completion_tokens=1, tools=CHAT_TOOLS,
        tool_choice="none", messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert _prompt_tokens(client, [
        {"role": "user", "content": "Weather?"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me check."}]},
        CALL, {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]) == chat.usage.prompt_tokens


def test_a_call_output_of_text_parts_is_their_text(client: Any) -> None:
    """A ``function_call_output``'s output may be a list of ``input_text`` parts (the API's
    other form): the tool message is their text, as the string form's, not their JSON."""
    items = [{"role": "user", "content": "Weather?"}, CALL]
    as_text = _prompt_tokens(client, [*items, {"type": "function_call_output",
                                               "call_id": "call_1", "output": "sunny"}])
    assert _prompt_tokens(client, [*items, {
        "type": "function_call_output", "call_id": "call_1",
        "output": [{"type": "input_text", "text": "sunny"}]}]) == as_text


def test_reasoning_items_sent_back_are_taken(client: Any) -> None:
    """An answer's output sent back as input (``input += response.output``, how the API's
    guides continue after a call) holds its reasoning item: taken, not refused, as the
    reasoning of its call (test_responses_context.py), which this template renders not."""
    items = [{"role": "user", "content": "Weather?"}, CALL,
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": "Call the tool."}]}
    assert _prompt_tokens(client, [items[0], reasoning, *items[1:]]) == _prompt_tokens(
        client, items)


def _post(server: Served, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/responses", headers=AUTH, timeout=60,
                      json={"model": MODEL, "temperature": 0, **body})


def test_truncation_auto_drops_the_first_items(server: Served) -> None:
    """``truncation: "auto"``: a conversation too long for the context (64 tokens here) loses
    its first items, whole, until the prompt leaves room for ``max_output_tokens``: the
    prompt is the instructions' and the fewest last items' that fit (OpenAI's "dropping
    items from the beginning of the conversation"), whole and streamed; ``disabled``, the
    default (null too), refuses it naming ``input``. The response echoes the setting."""
    items = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Hello world {i}"}
             for i in range(9)]
    tok = server.engine.tokenizer
    assert tok is not None

    def size(drop: int) -> int:
        return len(tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                            *items[drop:]], True))

    body = {"input": items, "instructions": "Be brief.", "max_output_tokens": 4}
    want = next(k for k in range(len(items)) if size(k) <= 64 - 4)
    assert want >= 2 and size(want) < 60  # (not all cut, nor to the last token)
    answer = _post(server, {**body, "truncation": "auto"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["input_tokens"] == size(want)
    assert answer.json()["truncation"] == "auto"
    events = _events(server, {"model": MODEL, **body, "truncation": "auto"})
    assert events[-1]["response"]["usage"]["input_tokens"] == size(want)
    for extra in ({}, {"truncation": None}, {"truncation": "disabled"}):
        refused = _post(server, {**body, **extra})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"
    assert _post(server, {"input": "Hi", "truncation": None,
                          "max_output_tokens": 1}).json()["truncation"] == "disabled"


def test_what_truncation_cannot_fit_is_refused_by_name(server: Served) -> None:
    """``truncation: "auto"`` never cuts the last item: one too long for the context alone is
    refused naming ``input`` (and the truncation); where ``max_output_tokens`` leaves even it
    no room, the 400 names ``max_output_tokens``."""
    long = _post(server, {"input": [{"role": "user", "content": "Hi"},
                                    {"role": "user", "content": "hello world " * 30}],
                          "truncation": "auto"})
    assert long.status_code == 400 and long.json()["error"]["param"] == "input"
    assert 'truncation "auto"' in long.json()["error"]["message"]
    greedy = _post(server, {"input": [{"role": "user", "content": "hello world " * 5}] * 3,
                            "truncation": "auto", "max_output_tokens": 60})
    assert greedy.status_code == 400, greedy.text
    assert greedy.json()["error"]["param"] == "max_output_tokens"


def test_a_continuation_leaves_the_stored_conversation_as_it_was() -> None:
    """A continuation whose input opens with a call (onto the stored answer's assistant
    message) changes its own copy of the conversation, not the stored one: the same
    continuation twice is the same prompt, and the earlier response's record stays."""
    from mrv2.entrypoints.responses_store import ResponseStore

    store = ResponseStore()
    call = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    store.put({"id": "resp_0"}, [{"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "", "tool_calls": [call]}])
    previous = store.get("resp_0")
    assert previous is not None
    body = ResponsesRequest(input=[CALL, {"type": "function_call_output", "call_id": "call_1",
                                          "output": "sunny"}])
    first = [m.model_dump(exclude_none=True) for m in body.as_chat(previous.messages).messages]
    assert first == body.conversation(previous.messages)  # (the server's second reading)
    assert [c["id"] for c in first[1]["tool_calls"]] == ["call_0", "call_1"]
    assert previous.messages[1]["tool_calls"] == [call]


def test_stored_responses_continue_the_conversation(model_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``MRV2_ENABLE_RESPONSES_API_STORE=1``: ``previous_response_id`` continues from a
    stored answer (whole or streamed) as the chat route continues the same messages (the
    continuation's own instructions, not the first's); ``GET`` / ``DELETE`` read and forget
    a response; ``store: false`` keeps nothing."""
    from conftest import serve

    monkeypatch.setenv("MRV2_ENABLE_RESPONSES_API_STORE", "1")
    for served in serve(model_dir):
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0)
        common = {"model": MODEL, "temperature": 0, "max_output_tokens": 5}
        first = client.responses.create(input="Hi", instructions="Be long.", **common)
        assert first.store
        events = client.responses.create(previous_response_id=first.id, input="Paris?",
                                         instructions="Be brief.", stream=True, **common)
        second = [e for e in events if e.type in ("response.completed",
                                                  "response.incomplete")][0].response
        third = client.responses.create(previous_response_id=second.id, input="Why?",
                                        **common)
        chat = _chat(client, [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "Paris?"}], 5)
        assert second.output_text == chat.choices[0].message.content
        assert second.previous_response_id == first.id
        alone = _chat(client, [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "Paris?"}], 5)
        assert alone.choices[0].message.content != second.output_text  # the history counted
        chat = _chat(client, [{"role": "user", "content": "Hi"},
                              {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "Paris?"},
                              {"role": "assistant", "content": second.output_text},
                              {"role": "user", "content": "Why?"}], 5)
        assert third.output_text == chat.choices[0].message.content
        got = client.responses.retrieve(second.id)
        assert got.id == second.id and got.output_text == second.output_text
        client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.create(previous_response_id=first.id, input="x", **common)
        kept_not = client.responses.create(input="Hi", store=False, **common)
        assert not kept_not.store
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(kept_not.id)


def test_the_store_keeps_the_newest(monkeypatch: pytest.MonkeyPatch) -> None:
    from mrv2.entrypoints.responses_store import ResponseStore, store_from_env

    store = ResponseStore(2)
    for i in range(3):
        store.put({"id": f"resp_{i}"}, [])
    assert store.get("resp_0") is None and store.get("resp_2") is not None
    assert store_from_env() is None
    monkeypatch.setenv("MRV2_ENABLE_RESPONSES_API_STORE", "1")
    monkeypatch.setenv("MRV2_RESPONSES_API_STORE_SIZE", "many")
    with pytest.raises(ValueError, match="MRV2_RESPONSES_API_STORE_SIZE"):
        store_from_env()


@pytest.mark.parametrize("reasoning", [{"summary": "auto"}, {"effort": "low", "summary": "auto"},
                                       {"effort": "minimal", "summary": "detailed"},
                                       {"generate_summary": "concise"}])
def test_a_reasoning_summary_is_taken_and_ignored(server: Served,
                                                  reasoning: dict[str, Any]) -> None:
    """vLLM takes OpenAI's ``reasoning`` object whole (Codex CLI sends ``summary: "auto"``):
    its effort is the template's, a summary is not written."""
    response = httpx.post(f"{server.url}/v1/responses", headers=AUTH, timeout=60, json={
        "model": MODEL, "input": "x", "max_output_tokens": 1, "reasoning": reasoning})
    assert response.status_code == 200, response.text
    assert "reasoning" not in [item["type"] for item in response.json()["output"]]


def test_null_flags_are_their_defaults(server: Served) -> None:
    """``stream``, ``store``, ``background`` and ``parallel_tool_calls`` are ``boolean or
    null`` in the API: ``null`` is the default (a whole answer, stored where the store is
    on, not in the background, parallel calls), not a 400."""
    response = httpx.post(f"{server.url}/v1/responses", headers=AUTH, timeout=60, json={
        "model": MODEL, "input": "Hi", "max_output_tokens": 2, "stream": None, "store": None,
        "background": None, "parallel_tool_calls": None})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "response" and body["parallel_tool_calls"] is True


def _events(server: Served, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{server.url}/v1/responses", headers=AUTH, timeout=60,
                      json={**body, "stream": True}) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("ask", [{"top_logprobs": 2},
                                 {"include": ["message.output_text.logprobs"]}])
def test_the_message_text_has_logprobs(server: Served, ask: dict[str, Any]) -> None:
    """``top_logprobs`` or ``include: ["message.output_text.logprobs"]``: the output_text
    part carries the chat route's logprobs of the message's tokens (an end-of-sequence token,
    which shows no text, left out), the streamed deltas each theirs."""
    k = ask.get("top_logprobs", 0)
    chat = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hello world"}],
        "temperature": 0, "max_completion_tokens": 6, "logprobs": True,
        "top_logprobs": k}).json()["choices"][0]["logprobs"]["content"]
    body = {"model": MODEL, "input": "Hello world", "temperature": 0, "max_output_tokens": 6,
            **ask}
    whole = httpx.post(f"{server.url}/v1/responses", headers=AUTH, timeout=60, json=body)
    assert whole.status_code == 200, whole.text
    part = whole.json()["output"][-1]["content"][0]
    assert part["logprobs"] and part["logprobs"] == chat[:len(part["logprobs"])]
    assert len(part["logprobs"]) >= len(chat) - 1
    assert all(len(lp["top_logprobs"]) == k for lp in part["logprobs"])
    events = _events(server, body)
    streamed = [lp for e in events if e["type"] == "response.output_text.delta"
                for lp in e["logprobs"]]
    assert streamed == part["logprobs"]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["logprobs"] == part["logprobs"]
    assert events[-1]["response"]["output"][-1]["content"][0]["logprobs"] == streamed


def test_the_api_s_include_values_are_taken(server: Served) -> None:
    """``include`` values of the API that ask for what this server's answers never hold
    (built-in tools' results, encrypted reasoning: the reasoning item is in plain text) are
    taken, as OpenAI's and vLLM's take them (Codex CLI sends ``reasoning.encrypted_content``
    on every request); one that is no value of the API is a 400 naming the values."""
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2,
            "include": ["reasoning.encrypted_content", "file_search_call.results",
                        "message.input_image.image_url"]}
    response = httpx.post(f"{server.url}/v1/responses", headers=AUTH, timeout=60, json=body)
    assert response.status_code == 200, response.text
    response = httpx.post(f"{server.url}/v1/responses", headers=AUTH, timeout=60,
                          json={**body, "include": ["usage"]})
    assert response.status_code == 400, response.text
    assert "message.output_text.logprobs" in response.json()["error"]["message"]


def test_no_logprobs_unless_asked(server: Served) -> None:
    body = {"model": MODEL, "input": "Hello world", "temperature": 0, "max_output_tokens": 3}
    whole = httpx.post(f"{server.url}/v1/responses", headers=AUTH, timeout=60, json=body)
    assert whole.json()["output"][-1]["content"][0]["logprobs"] == []
    assert all(e["logprobs"] == [] for e in _events(server, body)
               if e["type"] == "response.output_text.delta")


@pytest.mark.parametrize("k", [-1, 21])
def test_an_out_of_range_top_logprobs_is_refused(server: Served, k: int) -> None:
    response = httpx.post(f"{server.url}/v1/responses", headers=AUTH, timeout=60,
                          json={"model": MODEL, "input": "x", "top_logprobs": k})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "top_logprobs"


def test_top_logprobs_is_bounded_by_the_engines_max_logprobs(model_dir: Path) -> None:
    """``top_logprobs`` past 20 is taken up to ``--max-logprobs`` (vLLM's Responses protocol
    sets no bound of its own: the engine's max_logprobs does, as for chat); past it, a 400
    naming the field. (It was refused past 20 whatever the engine allowed.)"""
    from conftest import serve

    body = {"model": MODEL, "input": "Hello world", "temperature": 0, "max_output_tokens": 3}
    for served in serve(model_dir, engine_kwargs={"max_logprobs": 30}):
        response = httpx.post(f"{served.url}/v1/responses", headers=AUTH, timeout=60,
                              json={**body, "top_logprobs": 25})
        assert response.status_code == 200, response.text
        logprobs = response.json()["output"][-1]["content"][0]["logprobs"]
        assert logprobs and all(len(lp["top_logprobs"]) == 25 for lp in logprobs)
        refused = httpx.post(f"{served.url}/v1/responses", headers=AUTH, timeout=60,
                             json={**body, "top_logprobs": 31})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "top_logprobs"


def test_reasoning_and_tags_are_not_in_the_message_logprobs() -> None:
    """The rule of ``AnswerSplit``: a token's logprob goes with its delta's message text; a delta
    showing none past the reasoning (a character's first byte) holds its tokens for the next;
    the reasoning's tokens (its end tag's too) and those held at the end are in none."""
    from mrv2.engine.outputs import Logprob
    from mrv2.entrypoints.responses_output import AnswerSplit

    deltas = [("<think>", 1), ("hm", 2), ("</think>", 3), ("", 4), ("Hi", 5), (" you", 6),
              ("", 7)]
    split = AnswerSplit("qwen3", None, True, 0)
    got = []
    for i, (text, token) in enumerate(deltas):
        lp = {token: Logprob(-float(token), 1, f"t{token}")}
        runs, calls, logprobs = split.feed(text, [token], [lp], i == len(deltas) - 1)
        got.append((runs, [x["token"] for x in logprobs]))
    assert got == [([], []), ([("reasoning", "hm")], []), ([], []), ([], []),
                   ([("content", "Hi")], ["t4", "t5"]), ([("content", " you")], ["t6"]),
                   ([], [])]


def test_message_text_parts_are_joined_by_lines_and_a_refusal_part_is_text() -> None:
    """A message's text parts are its content a line each (vLLM's chat_utils joins them with
    "\\n"; they ran together), empty ones dropped; an assistant's output sent back holds
    ``refusal`` parts (the API's ``ResponseOutputRefusal``): read as their text, as vLLM's
    chat_utils reads them (they were refused); a call output's text parts a line each too."""
    body = ResponsesRequest(input=[
        {"role": "system", "content": [{"type": "input_text", "text": "Be brief."},
                                       {"type": "input_text", "text": "Be kind."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                     {"type": "input_text", "text": ""},
                                     {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "One.", "annotations": []},
                     {"type": "output_text", "text": "Two.", "annotations": []}]},
        CALL, {"type": "function_call_output", "call_id": "call_1",
               "output": [{"type": "input_text", "text": "sunny"},
                          {"type": "input_text", "text": "warm"}]}])
    messages = body.conversation()
    assert [m["content"] for m in messages] == [
        "Be brief.\nBe kind.", "Hi\nthere", "I can't help with that.", "One.\nTwo.",
        "sunny\nwarm"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "assistant",
                                             "tool"]
    assert body.as_chat().messages[2].as_dict()["content"] == "I can't help with that."
