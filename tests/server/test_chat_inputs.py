"""Chat request inputs read as vLLM reads them: ``input_text``, ``output_text``, ``refusal``
and ``thinking`` content parts are text (empty ones dropped); an assistant's tool call whose
``arguments`` are not JSON reaches the template with {}; ``top_logprobs: 0`` without
``logprobs`` is taken."""

from __future__ import annotations

from typing import Any

import httpx
from server_util import API_KEY, MODEL, Served

from mrv2.engine.media import split_chat_media
from mrv2.engine.tokenizer import Tokenizer, template_call
from mrv2.entrypoints.openai_messages import ChatMessage

AUTH = {"Authorization": f"Bearer {API_KEY}"}

#: One part of each kind vLLM's chat_utils reads as text, and empty ones it drops.
PARTS = [{"type": "input_text", "text": "one"}, {"type": "text", "text": ""},
         {"type": "output_text", "text": "two"}, {"type": "refusal", "refusal": "three"},
         {"type": "text", "text": None}, {"type": "thinking", "thinking": "four"}]


def _post(server: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", headers=AUTH, timeout=60, json=body)


def test_text_like_parts_are_text() -> None:
    message = ChatMessage.model_validate({"role": "user", "content": PARTS})
    assert not message.has_media
    assert message.as_dict()["content"] == "one\ntwo\nthree\nfour"
    image = [{"type": "image", "image": object()}, *PARTS]
    out, data = split_chat_media([{"role": "user", "content": image}])
    assert out[0]["content"] == [{"type": "image"}] + [
        {"type": "text", "text": t} for t in ("one", "two", "three", "four")]
    assert len(data["image"]) == 1


def test_text_like_parts_reach_the_template(server: Served) -> None:
    tok = Tokenizer.from_pretrained(server.model_dir)
    joined = tok.apply_chat_template([{"role": "user", "content": "one\ntwo\nthree\nfour"}])
    messages = [{"role": "user", "content": PARTS}]
    got = _post(server, "/tokenize", {"messages": messages})
    assert got.status_code == 200, got.text
    assert got.json()["tokens"] == joined
    chat = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                  "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(joined)


def test_tool_call_arguments_not_json_are_an_empty_object(server: Served) -> None:
    """vLLM's ``_postprocess_messages``: arguments that are not JSON text (or are null, or
    neither an object nor a list) are {}; JSON text is parsed."""
    for arguments in ("{not json", "", "  ", None, 5):
        call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
        assert template_call(call)["function"]["arguments"] == {}, arguments
    call = {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert template_call(call)["function"]["arguments"] == {"a": 1}
    bad = {"id": "c1", "type": "function",
           "function": {"name": "f", "arguments": "{'city': 'Paris'"}}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [bad]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    chat = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                  "max_tokens": 1})
    assert chat.status_code == 200, chat.text


def test_tool_call_arguments_of_json_text_that_is_no_object_are_an_empty_object() -> None:
    """JSON text that decodes to null, a number, a string or a boolean is {} as those values
    sent as such are (vLLM's ``_postprocess_messages``; a template indexes the arguments):
    it reached the template as None, 42...; JSON text of an object or a list is parsed."""
    for arguments in ("null", "42", '"x"', "true"):
        call = {"type": "function", "function": {"name": "f", "arguments": arguments}}
        assert template_call(call)["function"]["arguments"] == {}, arguments
    call = {"type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}
    assert template_call(call)["function"]["arguments"] == [1, 2]


def test_top_logprobs_zero_without_logprobs_is_taken(server: Served) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    for extra in ({"top_logprobs": 0}, {"top_logprobs": 0, "logprobs": False}):
        chat = _post(server, "/v1/chat/completions", {**body, **extra})
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["logprobs"] is None
    refused = _post(server, "/v1/chat/completions", {**body, "top_logprobs": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"
