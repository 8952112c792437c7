"""The arguments of an XML-like format's call streamed parameter by parameter, as vLLM streams
them (:class:`ArgumentStream`, one a call; :class:`mrv2.entrypoints.tool_stream_whole.
BlockCalls` feeds it the call's block as it comes).

The call's name goes out as soon as it is known (``<function=NAME>``, GLM's ``NAME<arg_key>``,
``<invoke name="NAME">``), with no arguments; then each parameter when its closing tag
(``</parameter>``, ``</arg_value>``, ``</｜DSML｜parameter>``) comes, as its piece of the
arguments' JSON text, its value typed by the tool's schema as the whole answer's parser types
it: ``{"city": "Paris"``, ``, "days": 3``; the closing ``}`` (``{}``: no parameters) when the
call's block closes. The pieces joined are the whole answer's arguments text to the byte.

A parameter goes out only where the whole answer's parser must read it so, whatever follows:
its text, from the end of the one before to its closing tag, is one parameter as every reading
of the format's parser has it (``qwen3_coder``: a value holding ``<parameter=`` is read
otherwise where a later ``</parameter>`` is missing). Otherwise the rest of the call waits
for its block to close and goes out then (in one piece, as the block's own parse reads it):
a parameter written otherwise (a dropped ``</parameter>``), a name the parser would refuse
(the block then makes the answer no call), and ``deepseek_v32``'s call whose first parameter
is an ``arguments`` / ``input`` wrapper the tool does not have (its parser unwraps a lone one).
A key given again goes out again, as vLLM sends it (the whole answer keeps the key's first
place with its last value: the pieces joined then read as its arguments, ``{"a": 1, "a": 2}``,
without being its text). A block the parser refuses after pieces went out leaves them as sent,
as a malformed JSON call does: nothing more of it comes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mrv2.entrypoints.tool_calls import ToolCall
from mrv2.entrypoints.tool_parsers_more import (
    ARGUMENT_WRAPPERS,
    DSML,
    DSML_NAME,
    DSML_PARAMETER,
    tool_properties,
)
from mrv2.entrypoints.tool_parsers_xml import (
    ARG,
    DROPPED,
    INVOKE_NAME,
    MINIMAX_PARAMETER,
    PARAMETER,
    Tools,
    schema_types,
    typed_value,
    unquoted,
)

__all__ = ["FORMATS", "ArgumentStream", "Format", "Part", "reads_as"]


@dataclass
class Part:
    """A piece of a stream's calls: a call's first (``name`` set; ``id``: the call's where it
    is known) or the next piece of the last call's ``arguments``."""

    arguments: str
    name: str = ""
    id: str = ""


#: A call's head: ``(its block's text so far, which shows the head's end marker) -> (its name,
#: where its parameters begin)``; ValueError: not a head whose name can go out early.
Head = Callable[[str], tuple[str, int]]
#: A parameter: ``(its match, the tool's parameters' types, whether it is the call's first,
#: the request's tools, the call's name) -> (key, value)``; ValueError: it cannot go out early.
Pair = Callable[[re.Match[str], dict[str, list[str]], bool, Tools, str], tuple[str, Any]]


@dataclass(frozen=True)
class Format:
    """How a format's call streams: its ``head`` (read once ``head_end`` shows), a parameter's
    closing tag (``close``), the ``patterns`` that each read a parameter as one of the parser's
    readings does (all must read it whole and alike), and the ``pair`` they read."""

    head: Head
    head_end: str
    close: str
    patterns: tuple[re.Pattern[str], ...]
    pair: Pair


def _qwen_head(text: str) -> tuple[str, int]:
    name, _, _ = text.partition(">")
    name = name.strip()
    if not name or "\n" in name:
        raise ValueError("a function without a name")
    return name, text.index(">") + 1


def _qwen_pair(python: bool) -> Pair:
    def pair(match: re.Match[str], types: dict[str, list[str]], first: bool, tools: Tools,
             name: str) -> tuple[str, Any]:
        key = match.group(1).strip()
        value = match.group(2).removeprefix("\n").removesuffix("\n")
        return key, typed_value(value, types.get(key, []), python=python)
    return pair


def _glm_head(text: str) -> tuple[str, int]:
    at = text.index("<arg_key>")
    name = text[:at].strip()
    if not name or "\n" in name or "<" in name:
        raise ValueError("a call without a name")
    return name, at


def _glm_pair(match: re.Match[str], types: dict[str, list[str]], first: bool, tools: Tools,
              name: str) -> tuple[str, Any]:
    key = match.group(1).strip()
    return key, typed_value(match.group(2), types.get(key, []), loose=True)


def _minimax_head(text: str) -> tuple[str, int]:
    match = INVOKE_NAME.match(text)
    if match is None:  # (a quoted name may hold ">": the block's parse reads it)
        raise ValueError("not a name read early")
    return unquoted(match.group(1), "an invoke"), match.end()


def _minimax_pair(match: re.Match[str], types: dict[str, list[str]], first: bool,
                  tools: Tools, name: str) -> tuple[str, Any]:
    key = unquoted(match.group(1), "a parameter")
    return key, typed_value(match.group(2).strip(), types.get(key, []))


def _dsml_head(text: str) -> tuple[str, int]:
    match = DSML_NAME.match(text)
    if match is None or not match.group(1).strip():
        raise ValueError("not a name read early")
    return match.group(1).strip(), match.end()


def _dsml_pair(match: re.Match[str], types: dict[str, list[str]], first: bool, tools: Tools,
               name: str) -> tuple[str, Any]:
    key, as_text, value = match.group(1).strip(), match.group(2) == "true", match.group(3)
    if not key:
        raise ValueError("a parameter without a name")
    if first and key in ARGUMENT_WRAPPERS:
        properties = tool_properties(tools, name)
        if properties and key not in properties:
            raise ValueError("a wrapper the parser may unwrap")
    return key, value if as_text else typed_value(value, types.get(key, []), loose=True)


_QWEN = (_qwen_head, ">", "</parameter>", (PARAMETER, DROPPED))
_GLM = Format(_glm_head, "<arg_key>", "</arg_value>", (ARG,), _glm_pair)
#: The formats whose arguments stream parameter by parameter (``BLOCKS``' formats).
FORMATS: dict[str, Format] = {
    "qwen3_coder": Format(*_QWEN, _qwen_pair(False)),
    "qwen3_xml": Format(*_QWEN, _qwen_pair(True)),
    "glm45": _GLM, "glm47": _GLM,
    "minimax_m2": Format(_minimax_head, ">", "</parameter>", (MINIMAX_PARAMETER,),
                         _minimax_pair),
    "deepseek_v32": Format(_dsml_head, ">", f"</{DSML}parameter>", (DSML_PARAMETER,),
                           _dsml_pair),
}


def reads_as(text: str, arguments: str) -> bool:
    """Whether ``text`` is JSON that reads as the arguments text ``arguments`` does (a key
    given twice: its last value)."""
    try:
        return bool(json.loads(text) == json.loads(arguments))
    except (ValueError, RecursionError):
        return False


def _tail(text: str, tag: str) -> str:
    """The end of ``text`` that a ``tag`` found in it with more text may begin in."""
    return text[max(0, len(text) - len(tag) + 1):]


class ArgumentStream:
    """One call's name and arguments as its block's text comes (module doc): :meth:`feed` the
    block's text after its opening tag, piece by piece, then :meth:`close` with the block's
    own parse. Each text is searched once (a marker split across pieces is found in the end
    kept from the piece before), and a parameter's text is joined once, at its closing tag."""

    def __init__(self, form: Format, tools: Tools) -> None:
        self.form, self.tools = form, tools
        self.state = "head"  # "params": its name went out; "hold": the rest waits for close
        self.text: list[str] = []  # the head's, then the open parameter's text so far
        self.tail = ""  # the end of that text, where the marker looked for may begin
        self.name = ""
        self.types: dict[str, list[str]] = {}
        self.keys: set[str] = set()
        self.again = False  # a key went out twice
        self.sent: list[str] = []  # the arguments' pieces that went out

    def feed(self, text: str) -> list[Part]:
        """More of the block's text: the parts it made certain."""
        out: list[Part] = []
        while text and self.state != "hold":
            marker = self.form.head_end if self.state == "head" else self.form.close
            seen = self.tail + text
            at = seen.find(marker)
            if at < 0:
                self.text.append(text)
                self.tail = _tail(seen, marker)
                return out
            end = at + len(marker) - len(self.tail)  # (where the marker ends in text)
            whole, text = "".join(self.text) + text[:end], text[end:]
            self.text, self.tail = [], ""
            if self.state == "head":
                text = self._head(whole, out) + text
            else:
                self._parameter(whole, out)
        return out

    def _head(self, text: str, out: list[Part]) -> str:
        """The head's text, with its end marker: the text after it (its parameters')."""
        try:
            self.name, at = self.form.head(text)
        except ValueError:
            self.state = "hold"
            return ""
        self.state, self.types = "params", schema_types(self.tools, self.name)
        out.append(Part("", self.name))
        return text[at:]

    def _parameter(self, text: str, out: list[Part]) -> None:
        """A parameter's text, up to its closing tag: its piece, if it is certain."""
        found = [p.match(text) for p in self.form.patterns]
        whole = [m for m in found if m is not None and m.end() == len(text)]
        if len(whole) != len(found) or len({m.groups() for m in whole}) != 1:
            self.state = "hold"
            return
        try:
            key, value = self.form.pair(whole[0], self.types, not self.sent, self.tools,
                                        self.name)
            piece = (", " if self.sent else "{") + json.dumps(key, ensure_ascii=False) + ": " \
                + json.dumps(value, ensure_ascii=False, allow_nan=False)
        except ValueError:
            self.state = "hold"
            return
        self.again = self.again or key in self.keys
        self.keys.add(key)
        self.sent.append(piece)
        out.append(Part(piece))

    def close(self, calls: list[ToolCall]) -> list[Part]:
        """The block closed, its own parse's ``calls``: what of them did not go out yet
        (a key given twice: the closing brace, where what went out reads as that parse's
        arguments; nothing more where it does not)."""
        if not self.name:  # (nothing went out: the calls whole)
            return [Part(call.arguments, call.name, call.id) for call in calls]
        if len(calls) != 1 or calls[0].name != self.name:
            return []
        sent, whole = "".join(self.sent), calls[0].arguments
        if whole.startswith(sent):
            return [Part(whole[len(sent):])] if whole != sent else []
        if self.again and self.state == "params" and reads_as(sent + "}", whole):
            self.sent.append("}")
            return [Part("}")]
        return []
