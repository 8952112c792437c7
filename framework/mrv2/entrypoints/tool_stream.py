"""A streamed chat answer's tool calls (:class:`ToolCallStream`): the content as it arrives,
and each call as :class:`CallDelta` pieces, as vLLM streams them.

The content streams as it comes, holding back what may be the start of a call marker; from
the first call on, the text is the calls' (``openai``: only the calls' messages; content
after them still streams; ``minimax_m2``: the content between and after its blocks goes out at
the end). A call's first piece carries its index, id and name with the first part of its
arguments (``{``); later pieces of that index carry only more of its arguments, and the
pieces of an index, joined, are the arguments text of the whole answer's call (the same
string, re-serialized as the parsers write it: :mod:`mrv2.entrypoints.json_stream`). A piece
holds only what is certain: an unfinished number or escape waits, and a call's closing brace
waits until the next call begins or the answer ends.

The formats whose arguments are a JSON object in the text stream them so: ``hermes``,
``llama3_json`` / ``llama4_json``, ``mistral``, ``deepseek_v3``, ``deepseek_v31``, ``kimi_k2``
(its ids the model's), ``openai`` and the forced ``tool_choice`` readers (where a call is one
JSON object, its ``"name"`` comes before its ``"arguments"`` / ``"parameters"``). The XML-like
formats (``qwen3_coder``, ``qwen3_xml``, ``glm45`` / ``glm47``, ``minimax_m2``,
``deepseek_v32``) send a call's name alone as soon as it is read, then its arguments a
parameter at a time as each closes, typed by the tools' schemas, and ``}`` with its block
(:mod:`mrv2.entrypoints.tool_stream_xml`); ``pythonic`` sends each call whole, in one piece,
as soon as it closes (:mod:`mrv2.entrypoints.tool_stream_whole`); a call written otherwise
(its arguments a string, or before its name) goes out whole when the answer ends. When the
answer ends it is parsed whole, as the non-streamed answer is: the rest of each call's
arguments (its closing brace at least) and any call that did not stream go out then. A stream
cannot take back what it sent: where the answer turns out malformed or cut off
(``max_tokens``) after a call went out (or a call went out otherwise than the whole answer
reads it), what went out stands and nothing more of that call comes (an XML-like call's key
given twice: its closing brace, the pieces reading as the whole answer's arguments); the
choice finishes with ``tool_calls`` only where the whole answer has calls
(:attr:`ToolCallStream.called`).

A ``--tool-parser-plugin`` parser streams with its reader (``ToolParser.stream``: a class or
function of the request's ``tools``, made for each choice; vLLM's
``extract_tool_calls_streaming``): its ``feed(text)`` gets the text from the first marker on
as it comes (what ``calls_of`` reads whole) and returns what it made certain, in order: whole
``ToolCall``'s, or :class:`CallDelta`'s: a call's first piece (the next ``index`` from 0, its
``name``; an ``id`` of "" is made as the parser's) or more of the last call's arguments (its
``index``, no name). The answer's end is parsed whole (``calls_of``), as every format's: what
the reader did not send goes out then. An item out of order, or a ValueError, ends its
stream (what went out stands). Without a reader, the calls go out when the answer ends.

A delta costs work in proportion to its own length, however long the call: the text is kept
in the pieces it came in (joined once, for the whole answer's parse), only the text not read
yet is scanned (a call's arguments by its :class:`JsonStream`, which keeps its own state), and
while the next call's marker has not shown, only the new text is searched for it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mrv2.entrypoints.harmony import HarmonyStream
from mrv2.entrypoints.json_stream import JsonStream
from mrv2.entrypoints.reasoning import held_tag_prefix
from mrv2.entrypoints.tool_calls import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_SEP,
    MISTRAL_ARGS,
    MISTRAL_CALL_ID,
    MISTRAL_CALLS,
    PARSERS,
    PYTHON_TAG,
    ToolCall,
    ToolParser,
    get_tool_parser,
    harmony_call,
)
from mrv2.entrypoints.tool_parsers_more import KIMI_ARGUMENTS, KIMI_CALL, KIMI_CALL_END, KIMI_ID
from mrv2.entrypoints.tool_parsers_xml import Tools
from mrv2.entrypoints.tool_stream_whole import BLOCKS, BlockCalls, CallDelta, PythonCalls
from mrv2.entrypoints.tool_stream_xml import FORMATS, reads_as

__all__ = ["CallDelta", "ToolCallStream"]


# -- where a call's arguments begin ----------------------------------------------------------

class _Wait(Exception):
    """The text so far cannot tell yet (``marker``: nothing changes until it shows)."""

    def __init__(self, marker: str = "") -> None:
        super().__init__(marker)
        self.marker = marker


class _Fail(Exception):
    """Not a call written so that its arguments can stream."""


_JSON_WS = " \t\n\r"
_JSON_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\.)*"', re.DOTALL)
_OPEN_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\.)*\\?\Z', re.DOTALL)
_WORD = re.compile(r"\w*")
_MISTRAL_NAME = re.compile(r"[^\s\[\]{}]+")


def _ws(text: str, pos: int, python: bool = False) -> int:
    """Past the whitespace at ``pos`` (JSON's, or ``python``: ``str.strip``'s)."""
    while pos < len(text) and (text[pos].isspace() if python else text[pos] in _JSON_WS):
        pos += 1
    return pos


def _lit(text: str, pos: int, literal: str) -> int:
    """Past ``literal`` at ``pos``."""
    if text.startswith(literal, pos):
        return pos + len(literal)
    if literal.startswith(text[pos:]):
        raise _Wait
    raise _Fail


def _opt(text: str, pos: int, literal: str) -> int:
    """Past ``literal`` at ``pos`` if it is there."""
    if text.startswith(literal, pos):
        return pos + len(literal)
    if literal.startswith(text[pos:]):
        raise _Wait
    return pos


def _json_string(text: str, pos: int) -> tuple[str, int]:
    """The JSON string at ``pos`` and where it ends."""
    match = _JSON_STRING.match(text, pos)
    if match is None:
        raise _Wait if _OPEN_STRING.match(text, pos) or pos == len(text) else _Fail
    try:
        return json.loads(match.group()), match.end()
    except ValueError:
        raise _Fail from None


def _object_head(text: str, pos: int) -> tuple[str, int]:
    """``{"name": NAME, "arguments" | "parameters": `` at ``pos`` (other members with string
    values may come before the arguments: ``"type": "function"``): the name, and where the
    arguments begin."""
    pos, name = _lit(text, _ws(text, pos), "{"), ""
    while True:
        key, pos = _json_string(text, _ws(text, pos))
        pos = _lit(text, _ws(text, pos), ":")
        if key in ("arguments", "parameters"):
            if not name:
                raise _Fail
            return name, pos
        value, pos = _json_string(text, _ws(text, pos))
        name = value if key == "name" else name
        pos = _lit(text, _ws(text, pos), ",")


def _after(text: str, pos: int, marker: str) -> int:
    """Past the next ``marker`` from ``pos``."""
    at = text.find(marker, pos)
    if at < 0:
        raise _Wait(marker)
    return at + len(marker)


#: A format's next call: ``(text from the first marker, where the last call's arguments
#: ended (0: none yet), how the last call was written (None: none yet))`` -> ``(its name,
#: where its arguments begin, how it is written, its id as the model wrote it ("": made
#: here))``; raises _Wait or _Fail.
Head = Callable[[str, int, "str | None"], tuple[str, int, str, str]]


def _hermes(text: str, pos: int, last: str | None) -> tuple[str, int, str, str]:
    if last is not None:  # (the call's object, then its block, end)
        pos = _lit(text, _ws(text, _lit(text, _ws(text, pos), "}")), "</tool_call>")
    return (*_object_head(text, _after(text, pos, "<tool_call>")), "object", "")


def _llama3_json(text: str, pos: int, last: str | None) -> tuple[str, int, str, str]:
    if last is None:
        pos = _opt(text, _ws(text, pos, python=True), PYTHON_TAG)
    else:
        pos = _lit(text, _ws(text, _lit(text, _ws(text, pos), "}"), python=True), ";")
    return (*_object_head(text, _ws(text, pos, python=True)), "object", "")


def _mistral(text: str, pos: int, last: str | None) -> tuple[str, int, str, str]:
    if last in ("list", "object"):
        pos = _ws(text, _lit(text, _ws(text, pos), "}"))
        if last == "list":
            if pos == len(text):
                raise _Wait
            if text[pos] == ",":
                return (*_object_head(text, pos + 1), "list", "")
    start = _after(text, pos, MISTRAL_CALLS)
    pos = _ws(text, start, python=True)
    if pos == len(text):
        raise _Wait
    if text[pos] in "[{":  # the older format: a list of calls, or one
        return (*_object_head(text, pos + (text[pos] == "[")),
                "list" if text[pos] == "[" else "object", "")
    found = [i for i in (text.find("[", pos), text.find("{", pos)) if i >= 0]
    if not found:
        raise _Wait
    at = min(found)
    name = text[start:at].strip()
    if not _MISTRAL_NAME.fullmatch(name):
        raise _Fail
    if text[at] == "{":  # (NAME{...}: [ARGS] not decoded)
        return name, at, "call", ""
    try:
        return name, _lit(text, at, MISTRAL_ARGS), "call", ""
    except _Fail:
        return name, _after(text, _lit(text, at, MISTRAL_CALL_ID), MISTRAL_ARGS), "call", ""


def _deepseek_v31(text: str, pos: int, last: str | None) -> tuple[str, int, str, str]:
    if last is not None:
        pos = _lit(text, _ws(text, pos), DS_CALL_END)
    start = _after(text, pos, DS_CALL_BEGIN)
    sep, end = text.find(DS_SEP, start), text.find(DS_CALL_END, start)
    if end >= 0 and (sep < 0 or end < sep):
        raise _Fail
    if sep < 0:
        raise _Wait
    name = text[start:sep].strip()
    if not name:
        raise _Fail
    return name, sep + len(DS_SEP), "call", ""


def _deepseek_v3(text: str, pos: int, last: str | None) -> tuple[str, int, str, str]:
    if last is not None:  # (```, then the call's end)
        pos = _lit(text, _ws(text, _lit(text, _ws(text, pos), "```"), python=True),
                   DS_CALL_END)
    pos = _ws(text, _after(text, pos, DS_CALL_BEGIN), python=True)
    word = _WORD.match(text, pos)
    assert word is not None  # (it matches the empty string)
    pos = _lit(text, _ws(text, word.end(), python=True), DS_SEP)
    newline = text.find("\n", pos)
    if newline < 0 or DS_CALL_END in text[pos:newline]:
        raise _Fail if DS_CALL_END in text[pos:] else _Wait
    name = text[pos:newline].strip()
    if not name:
        raise _Fail
    pos = _opt(text, _lit(text, _ws(text, newline + 1, python=True), "```"), "json")
    end = _ws(text, pos, python=True)
    if "\n" not in text[pos:end]:
        raise _Wait if end == len(text) else _Fail
    return name, pos, "call", ""


def _kimi_k2(text: str, pos: int, last: str | None) -> tuple[str, int, str, str]:
    """Kimi-K2's calls: the model's id ``functions.NAME:IDX`` names the function."""
    if last is not None:
        pos = _lit(text, _ws(text, pos), KIMI_CALL_END)
    start = _after(text, pos, KIMI_CALL)
    sep, end = text.find(KIMI_ARGUMENTS, start), text.find(KIMI_CALL_END, start)
    if end >= 0 and (sep < 0 or end < sep):
        raise _Fail
    if sep < 0:
        raise _Wait
    match = KIMI_ID.fullmatch(text, start, sep)
    if match is None:
        raise _Fail
    call_id = match.group(1)
    name = call_id.rpartition(":")[0].rpartition(".")[2]
    if not name:
        raise _Fail
    return name, sep + len(KIMI_ARGUMENTS), "call", call_id


def _named(name: str) -> Head:
    """A named ``tool_choice``'s answer: the arguments object, one call."""
    def head(text: str, pos: int, last: str | None) -> tuple[str, int, str, str]:
        if last is not None:
            raise _Wait
        return name, 0, "call", ""
    return head


def _required(text: str, pos: int, last: str | None) -> tuple[str, int, str, str]:
    """``tool_choice: required``'s answer: a list of ``{"name", "parameters"}``."""
    if last is None:
        return (*_object_head(text, _lit(text, _ws(text, pos), "[")), "list", "")
    pos = _lit(text, _ws(text, _lit(text, _ws(text, pos), "}")), ",")
    return (*_object_head(text, pos), "list", "")


#: The formats whose calls stream their arguments (the others: each call whole at the end),
#: and the marker that ends a call's text where the whole answer's parser cuts it there
#: (arguments that reach it before they close are malformed, even inside a JSON string).
HEADS: dict[str, tuple[Head, str]] = {
    "hermes": (_hermes, "</tool_call>"), "llama3_json": (_llama3_json, ""),
    "llama4_json": (_llama3_json, ""), "mistral": (_mistral, MISTRAL_CALLS),
    "deepseek_v3": (_deepseek_v3, "```"), "deepseek_v31": (_deepseek_v31, DS_CALL_END),
    "kimi_k2": (_kimi_k2, KIMI_CALL_END), "required": (_required, "")}


# -- the stream ------------------------------------------------------------------------------

@dataclass
class _Call:
    """A call being streamed: its name, its arguments' reader (None: raw text, harmony's
    non-JSON content types), how much of the window (harmony: of its message's pieces) was
    read and how much of its text left the window, and its index once its first piece went
    out."""

    name: str
    json: JsonStream | None
    read: int = 0
    cut: int = 0
    index: int | None = None
    held: str = ""  # its opening brace, until a key or its end follows (``{bad}``: nothing);
    # raw arguments: their leading whitespace, until more follows
    id: str = ""  # the model's (none: made when its first piece goes out)


@dataclass
class _Sent:
    """A call that went out: its name, id and the pieces of its arguments sent so far."""

    name: str
    id: str
    parts: list[str]

    @property
    def arguments(self) -> str:
        return "".join(self.parts)


class ToolCallStream:
    """Splits one choice's content deltas into content to send now and :class:`CallDelta`
    pieces of its calls (module doc). The work of a delta is proportional to it, however long
    the call: the text is kept as the deltas came (joined once, for the whole answer's parse),
    and only what is not read yet is scanned."""

    def __init__(self, parser: str | ToolParser = "hermes", tools: Tools = ()) -> None:
        self.parser, self.tools = get_tool_parser(parser), tools
        self.held = ""  # content not sent yet: what may begin a marker
        self.pieces: list[str] = []  # the text from the first call marker on
        # "open": a leading parser's answer so far may still open with a marker; "text":
        # content, a marker may come; "calls": the calls' text; "plain": content only.
        self.state = "open" if self.parser.leading else "text"
        #: ``harmony``: the messages' split
        self.harmony = HarmonyStream() if self.parser.harmony else None
        self.head: Head | None
        self.head, self.end = ((_named(self.parser.function), "") if self.parser.function
                               else HEADS.get(self.parser.name, (None, "")))
        #: The formats whose calls are blocks (their arguments by parameter where this module
        #: knows the parser: a registered parser of a built-in name sends each call whole).
        self.whole: BlockCalls | PythonCalls | None = None
        if self.parser.name in BLOCKS and not self.parser.function:
            known = PARSERS.get(self.parser.name)
            form = FORMATS.get(self.parser.name) if known is not None and (
                known.calls_of is self.parser.calls_of) else None
            self.whole = BlockCalls(self.parser.calls_of, tools, *BLOCKS[self.parser.name],
                                    form)
        elif self.parser.name in ("pythonic", "llama4_pythonic"):
            self.whole = PythonCalls(self.parser.calls_of, tools)
        #: A plugin's reader (:attr:`ToolParser.stream`; None: none, or it went wrong).
        self.custom: Any = (self.parser.stream(tools) if self.parser.stream is not None
                            and not self.parser.function else None)
        #: Each call sent so far (by index).
        self.sent: list[_Sent] = []
        self.call: _Call | None = None  # the call being streamed
        self.last: str | None = None  # how the last call found was written
        self.window = ""  # the calls' text still to read (a call's: from its arguments on)
        self.pos = 0  # where the last call's arguments ended in the window
        self.wait = ""  # the marker the next call's head waits for (none: it waits for text)
        self.gap: list[str] = []  # the text since the head last looked, while it waits so
        self.wait_tail = ""  # the end of the text read, where that marker may begin
        self.due: int | None = None  # a call whose closing brace waits for the next call
        #: The choice finished with calls (it finishes with ``tool_calls``).
        self.called = False

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        """The next content delta (``harmony``: of the model's whole output): the content
        to send and the calls' pieces; ``final``: the choice finished (the rest of the
        calls, or the held text as content when it held none)."""
        if self.harmony is not None:
            return self._harmony(delta, final)
        if self.state == "calls":
            return self._calls(delta, final)
        text, starts = self.held + delta, self.parser.starts
        self.held, before = "", ""
        if self.state == "open":
            stripped = text.lstrip()
            if self.parser.first_start(text) == 0:
                self.state = "calls"
            elif not final and any(s.startswith(stripped) for s in starts):
                self.held = text  # whitespace, or a part of a marker: wait
                return "", []
            else:
                self.state = "plain"
        if self.state == "plain":
            return text, []
        if self.state == "text":
            first = self.parser.first_start(text)
            if first < 0:
                keep = 0 if final else max(held_tag_prefix(text, s) for s in starts)
                self.held = text[len(text) - keep:]
                return text[: len(text) - keep], []
            self.state = "calls"
            before, text = text[:first], text[first:]
        said, pieces = self._calls(text, final)
        return before + said, pieces

    def _calls(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        """The calls' next text."""
        self.pieces.append(text)
        if not final:
            if self.custom is not None:
                return "", self._custom(text)
            return "", self._whole(text) if self.whole is not None else self._follow(text)
        whole = "".join(self.pieces)
        content, calls = self.parser.parse(whole, self.tools)
        if calls:
            self.called = True
            return content or "", self._rest(calls)
        return "" if self.sent else whole, []  # (no calls: the held text is content)

    def _start(self, name: str, reader: JsonStream | None, call_id: str) -> list[CallDelta]:
        """A call found (the one due its closing brace gets it now)."""
        out = []
        if self.due is not None:
            out.append(self._piece(self.due, "}"))
            self.due = None
        self.call = _Call(name, reader, id=call_id)
        return out

    def _piece(self, index: int, text: str) -> CallDelta:
        self.sent[index].parts.append(text)
        return CallDelta(index, text)

    def _emit(self, call: _Call, new: str) -> list[CallDelta]:
        """The next piece of ``call``'s arguments (its first: with its index, id and name)."""
        if not new:
            return []
        if call.index is not None:
            return [self._piece(call.index, new)]
        made = ToolCall(call.name, new,
                        call.id or self.parser.make_id(call.name, len(self.sent)))
        call.index = len(self.sent)
        self.sent.append(_Sent(made.name, made.id, [new]))
        return [CallDelta(call.index, new, made.name, made.id)]

    def _json(self, call: _Call, raw: str, stop: bool) -> list[CallDelta]:
        """The call's next raw arguments text (``stop``: its end marker came)."""
        assert call.json is not None
        call.json.feed(raw)
        if stop and not call.json.done:  # (nothing of the call lies past it)
            call.json.failed = True
        new = call.held + call.json.take()
        call.held = new if call.index is None and new == "{" and not call.json.done else ""
        return [] if call.held else self._emit(call, new)

    def _read(self) -> list[CallDelta]:
        """The open call's arguments in the window (from where it was read to): its next
        piece; what was read leaves the window (but what may begin the end marker)."""
        call, text = self.call, self.window
        assert call is not None and call.json is not None
        stop, upto = -1, len(text)
        if self.end:  # (up to the call's end marker, or what may begin it)
            stop = text.find(self.end, max(0, call.read - len(self.end)))
            upto = stop if stop >= 0 else len(text) - held_tag_prefix(text, self.end)
        raw, call.read = text[call.read:upto], max(upto, call.read)
        out = self._json(call, raw, stop >= 0)
        if not call.json.done:
            cut = max(0, call.read - len(self.end))
            self.window, call.read, call.cut = text[cut:], call.read - cut, call.cut + cut
        return out

    def _follow(self, delta: str) -> list[CallDelta]:
        """The pieces of the calls that ``delta`` made certain."""
        if self.head is None:
            return []
        if self.wait:  # (the head reads nothing new until its marker shows)
            seen = self.wait_tail + delta
            if self.wait not in seen:
                self.gap.append(delta)
                self.wait_tail = seen[max(0, len(seen) - len(self.wait) + 1):]
                return []
            self.window += "".join(self.gap) + delta
            self.wait, self.gap = "", []
        else:
            self.window += delta
        out: list[CallDelta] = []
        while self.head is not None:
            if self.call is None:
                try:
                    name, at, self.last, call_id = self.head(self.window, self.pos, self.last)
                except _Wait as wait:
                    self.wait = wait.marker
                    self.wait_tail = self.window[max(0, len(self.window) - len(self.wait) + 1):]
                    break
                except _Fail:
                    self.head = None  # (the rest goes out when the answer ends)
                    break
                out += self._start(name, JsonStream(), call_id)
                self.window, self.pos = self.window[at:], 0
            call = self.call
            assert call is not None and call.json is not None
            out += self._read()
            if call.json.failed:
                self.head = None
            if not call.json.done:
                break
            self.pos, self.due, self.call = call.json.end - call.cut, call.index, None
        if self.head is None:
            self.window = ""
        return out

    def _whole(self, text: str) -> list[CallDelta]:
        """The pieces of the block formats' calls that ``text`` made certain."""
        assert self.whole is not None
        out = []
        for part in self.whole.feed(text):
            if not part.name:  # (more of the last call's arguments)
                out.append(self._piece(len(self.sent) - 1, part.arguments))
                continue
            call_id = (self.parser.make_id(part.name, len(self.sent)) or part.id
                       or ToolCall(part.name, "").id)
            self.sent.append(_Sent(part.name, call_id, [part.arguments]))
            out.append(CallDelta(len(self.sent) - 1, part.arguments, part.name, call_id))
        return out

    def _custom(self, text: str) -> list[CallDelta]:
        """What a plugin's reader made certain in ``text`` (module doc); an item out of
        order, or its ValueError, ends its stream (the rest goes out when the answer ends)."""
        try:
            found = self.custom.feed(text)
        except (ValueError, RecursionError):
            found = [None]
        found = found if isinstance(found, list | tuple) else [None]
        out = []
        for item in found:
            index = len(self.sent)
            if isinstance(item, ToolCall):  # (a whole call)
                item = CallDelta(index, item.arguments, item.name,
                                 self.parser.make_id(item.name, index) or item.id)
            if not (isinstance(item, CallDelta) and isinstance(item.arguments, str)):
                self.custom = None
                break
            if item.index == index and item.name:  # a call's first piece
                call_id = (item.id or self.parser.make_id(item.name, index)
                           or ToolCall(item.name, "").id)
                self.sent.append(_Sent(item.name, call_id, [item.arguments]))
                out.append(CallDelta(index, item.arguments, item.name, call_id))
            elif item.index == index - 1 >= 0 and not item.name and not item.id:
                out += [self._piece(item.index, item.arguments)] if item.arguments else []
            else:
                self.custom = None
                break
        return out

    def _rest(self, calls: list[ToolCall]) -> list[CallDelta]:
        """The whole answer's calls: what of them did not go out yet."""
        out = []
        for index, call in enumerate(calls):
            if index >= len(self.sent):
                out.append(CallDelta(index, call.arguments, call.name, call.id))
                continue
            sent = self.sent[index]
            call.id, arguments = sent.id, sent.arguments
            rest = call.arguments[len(arguments):]
            if call.name == sent.name and call.arguments.startswith(arguments) and rest:
                out.append(self._piece(index, rest))
            elif call.name == sent.name and reads_as(arguments + "}", call.arguments):
                out.append(self._piece(index, "}"))  # (a key given twice)
        return out

    # -- harmony (gpt-oss) -------------------------------------------------------------------

    def _harmony(self, delta: str, final: bool) -> tuple[str, list[CallDelta]]:
        """Harmony's content, and each call message's arguments as they come."""
        assert self.harmony is not None
        said, out = [], []
        for piece in self.harmony.feed(delta, final):
            if piece.kind == "content":
                said.append(piece.text)
            elif piece.kind == "call":
                out += self._harmony_end(harmony_call(piece))
        stream = self.harmony
        header = stream.header
        if stream.state == "body" and header.kind == "call" and header.name:
            if self.call is None:
                json_args = header.content_type is None or "json" in header.content_type
                self.call = _Call(header.name, JsonStream() if json_args else None)
            call = self.call
            new, call.read = "".join(stream.call[call.read:]), len(stream.call)
            if call.json is not None:
                out += self._json(call, new, False)
            else:  # (raw text: from its first non-blank character on)
                call.held += new
                if call.index is not None or call.held.strip():
                    new, call.held = call.held, ""
                    out += self._emit(call, new)
        return "".join(said), out

    def _harmony_end(self, call: ToolCall | None) -> list[CallDelta]:
        """A call message ended: ``call`` what it is (None: not a call)."""
        was, self.call = self.call, None
        if call is not None:
            self.called = True
        if was is None or was.index is None:  # (it did not stream)
            if call is None:
                return []
            call.id = self.parser.make_id(call.name, len(self.sent)) or call.id
            self.sent.append(_Sent(call.name, call.id, [call.arguments]))
            return [CallDelta(len(self.sent) - 1, call.arguments, call.name, call.id)]
        sent = self.sent[was.index].arguments
        if call is None or not call.arguments.startswith(sent):
            return []  # (what went out stands)
        rest = call.arguments[len(sent):]
        return [self._piece(was.index, rest)] if rest else []
