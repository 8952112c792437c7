"""``mrv2 serve --enable-auto-tool-choice --tool-call-parser hermes``: a chat answer's tool
calls as OpenAI's ``tool_calls`` (vLLM's flags and parser name).

The ``hermes`` format (Qwen2.5, Qwen3, Hermes models): the model writes each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. The text before the first call
is the message's ``content`` (None when empty); each call becomes ``{"id", "type":
"function", "function": {"name", "arguments": "<JSON text>"}}``. A block whose JSON does not
parse, or lacks a name, leaves the whole answer as content, as vLLM's parser does; a last block
cut off before ``</tool_call>`` still counts if its JSON is whole.

A stream sends the content as it arrives, holding back what may be the start of
``<tool_call>``; from the first call on it holds everything, and the calls go out whole, each
in one delta, when the choice finishes (OpenAI's protocol lets a call's arguments come in one
chunk). A choice that made calls finishes with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from mrv2.entrypoints.reasoning import held_tag_prefix

#: ``--tool-call-parser`` values.
TOOL_CALL_PARSERS = ("hermes",)

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (with ``index`` in a stream's delta)."""
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            call["index"] = index
        return call


def check_tool_call_parser(name: str | None) -> str | None:
    """``name`` if it is a parser (or None); ValueError listing the parsers otherwise."""
    if name is not None and name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser={name!r}: allowed values are "
                         f"{', '.join(TOOL_CALL_PARSERS)}")
    return name


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A finished answer's ``(content, calls)`` (module doc); no calls: ``(text, [])``."""
    first = text.find(START)
    if first < 0:
        return (text or None), []
    calls: list[ToolCall] = []
    for match in _BLOCK.finditer(text, first):
        body = match.group(1).strip()
        if not body:
            continue
        try:
            value = json.loads(body)
        except ValueError:
            return (text or None), []
        name = value.get("name") if isinstance(value, dict) else None
        if not isinstance(name, str) or not name:
            return (text or None), []
        arguments = value.get("arguments", value.get("parameters", {}))
        calls.append(ToolCall(name, arguments if isinstance(arguments, str)
                              else json.dumps(arguments, ensure_ascii=False)))
    if not calls:
        return (text or None), []
    return (text[:first] or None), calls


class ToolCallStream:
    """Splits one choice's content deltas into content to send now and, at the end, calls."""

    def __init__(self) -> None:
        self.held = ""  # text not sent yet: a possible tag start, or everything from a call on
        self.in_calls = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """The next content delta; ``final``: the choice finished (the calls, if any, come
        back now, or the held text as content when it held none)."""
        text = self.held + delta
        self.held = ""
        if not self.in_calls:
            start = text.find(START)
            if start < 0:
                keep = 0 if final else held_tag_prefix(text, START)
                self.held = text[len(text) - keep:]
                return text[: len(text) - keep], []
            self.in_calls = True
            before, text = text[:start], text[start:]
        else:
            before = ""
        if not final:
            self.held = text
            return before, []
        content, calls = parse_tool_calls(text)
        if calls:
            return before + (content or ""), calls
        return before + text, []  # not calls after all: the held text is content
