"""A Responses API request's input items as the chat route's messages, and its tools,
``tool_choice`` and ``text.format`` as the chat request's fields
(:meth:`mrv2.entrypoints.openai_responses.ResponsesRequest.as_chat`).

Items: messages (text, ``input_text`` / ``output_text`` / ``refusal`` parts, ``input_image``
parts as the chat route's ``image_url`` ones), a model's ``function_call`` (the
``tool_calls`` of the assistant message before it: one turn), its ``function_call_output`` (a
``tool`` message) and ``reasoning`` items (the ``reasoning`` of the assistant message after
them); others are refused by name.
"""

from __future__ import annotations

import json
from typing import Any

from mrv2.engine.media import TEXT_PARTS, joined_text, part_text

__all__ = ["add_items", "chat_call", "chat_response_format", "chat_tool", "chat_tool_choice",
           "reasoning_text"]

#: The content parts read as text (vLLM's chat_utils': ``refusal`` ones too, as an
#: assistant's output sent back may hold).
_TEXT_PARTS = tuple(TEXT_PARTS)


def _kind(item: Any) -> str:
    return item.get("type", "message") if isinstance(item, dict) else type(item).__name__


def add_items(messages: list[dict[str, Any]], items: list[Any]) -> None:
    """Input items onto the chat messages (:func:`_add_item`); a reasoning item (an earlier
    answer's, sent back as the API asks) is the ``reasoning`` of the assistant message the
    next item makes or adds to (a message of the assistant's, a function call; several
    joined by newlines), dropped where another role's message comes first."""
    thoughts: list[str] = []
    for item in items:
        if _kind(item) == "reasoning":
            text = reasoning_text(item)
            if text:
                thoughts.append(text)
            continue
        _add_item(messages, item)
        last = messages[-1]
        if thoughts and last["role"] == "assistant" and _kind(item) in ("message",
                                                                         "function_call"):
            earlier = [last["reasoning"]] if last.get("reasoning") else []
            messages[-1] = {**last, "reasoning": "\n".join(earlier + thoughts)}  # (a copy)
        thoughts = []


def reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its ``reasoning_text`` parts' (else, as vLLM's, its summary's:
    another server's item), joined by newlines; encrypted content is not read."""
    for key in ("content", "summary"):
        parts = item.get(key)
        texts = [p["text"] for p in parts if isinstance(p, dict) and isinstance(
            p.get("text"), str) and p["text"]] if isinstance(parts, list) else []
        if texts:
            return "\n".join(texts)
    return ""


def chat_call(item: dict[str, Any]) -> dict[str, Any]:
    """A ``function_call`` item as a chat message's tool call."""
    return {"id": str(item.get("call_id", "")), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments")}}


def _add_item(messages: list[dict[str, Any]], item: Any) -> None:
    """An input item (not reasoning: :func:`add_items`) onto the chat messages: a message, a
    function call of the model's (onto the assistant message before it, the same turn: its
    ``tool_calls``), a function call's output (a ``tool`` message)."""
    kind = _kind(item)
    if kind == "function_call":
        call = chat_call(item)
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # (a copy: it may be stored)
            messages[-1] = {**last, "tool_calls": [*last.get("tool_calls", []), call]}
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        return
    if kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                         "content": _call_output(item.get("output"))})
        return
    messages.append(_message(item))


def _call_output(output: Any) -> str:
    """A ``function_call_output``'s output as the tool message's text: a string, or the text
    of a list of text parts."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        if not all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS for p in output):
            raise ValueError("SamplingParams.input is invalid: a function_call_output's "
                             "output must be a string or a list of input_text parts")
        return joined_text(output)
    return json.dumps(output)


def chat_tool(tool: Any) -> dict[str, Any]:
    """A Responses API function tool (flat) as a chat one (``{"function": {...}}``)."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
            tool.get("name"), str):
        raise ValueError(f"SamplingParams.tools is invalid: {tool!r} (function tools only: "
                         "{\"type\": \"function\", \"name\": ..., \"parameters\": {...}})")
    function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: Any) -> Any:
    """The Responses API's ``tool_choice`` as the chat request's."""
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ValueError(f"SamplingParams.tool_choice={choice!r} is invalid: expected 'none', "
                     "'auto', 'required' or {\"type\": \"function\", \"name\": ...}")


def _message(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        kind = item.get("type") if isinstance(item, dict) else type(item).__name__
        raise ValueError(f"SamplingParams.input is invalid: items of type {kind!r} are not "
                         "supported (messages, function_call, function_call_output and "
                         "reasoning)")
    role, content = item.get("role"), item.get("content")
    if role not in ("user", "assistant", "system", "developer"):
        raise ValueError(f"SamplingParams.input is invalid: role {role!r} (expected user, "
                         "assistant, system or developer)")
    if isinstance(content, list):
        kinds = {p.get("type") if isinstance(p, dict) else None for p in content}
        if not kinds <= {*_TEXT_PARTS, "input_image"}:
            raise ValueError(f"SamplingParams.input is invalid: content parts of types "
                             f"{sorted(str(k) for k in kinds - {*_TEXT_PARTS, 'input_image'})}"
                             " are not supported (text and image parts only)")
        if "input_image" in kinds:  # the chat path's parts: it loads the images
            content = [_image_part(p) if p["type"] == "input_image"
                       else {"type": "text", "text": part_text(p)} for p in content]
        else:
            content = joined_text(content)
    if not isinstance(content, (str, list)):
        raise ValueError("SamplingParams.input is invalid: a message's content must be a "
                         "string or a list of text and image parts")
    return {"role": "system" if role == "developer" else role, "content": content}


def _image_part(part: dict[str, Any]) -> dict[str, Any]:
    """An ``input_image`` part as the chat request's ``image_url`` part (a URL: a ``data:``
    URI, or a remote one the server fetches only if allowed)."""
    url = part.get("image_url")
    if not isinstance(url, str):
        raise ValueError("SamplingParams.input is invalid: an input_image part needs an "
                         "image_url (uploaded files are not supported)")
    return {"type": "image_url", "image_url": {"url": url}}


def chat_response_format(fmt: Any) -> dict[str, Any]:
    """``text.format`` as the chat request's ``response_format``."""
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object",
                                                            "json_schema"):
        raise ValueError(f"SamplingParams.text is invalid: format {fmt!r} (expected type "
                         "text, json_object or json_schema)")
    if fmt["type"] != "json_schema":
        return {"type": fmt["type"]}
    return {"type": "json_schema", "json_schema": {
        "name": fmt.get("name", "answer"), "schema": fmt.get("schema"),
        "strict": fmt.get("strict", False)}}
