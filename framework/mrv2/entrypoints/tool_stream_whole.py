"""The calls of a streamed answer in the formats whose calls are blocks (the XML-like ones) and
``pythonic``'s: :class:`BlockCalls` and :class:`PythonCalls` read the text from the first
call marker on as it comes, in work proportional to the new text, as :class:`Part` pieces.

An XML-like call's name goes out as soon as its head is read, then its arguments parameter by
parameter as each closes, the rest (``}``) when its block closes
(:mod:`mrv2.entrypoints.tool_stream_xml`); where a piece could differ from the whole answer's
reading, the rest of the call waits for its block, read then by the format's own parser from
that block alone (which reads it as it reads it within the whole answer). A block closes at its
closing tag (``</function>``, ``</tool_call>``, ``</invoke>``, or the closing tag of the block
around the invokes, which ends its last one as the whole answer's parser has it). A
``pythonic`` call goes out whole once the ``,`` or ``]`` after it shows (its values are Python
literals, whole only there). A block the parser refuses makes the whole answer no call (its
failure rule): nothing more goes out (:attr:`BlockCalls.failed`; what went out stands), the
whole answer's parse decides.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mrv2.entrypoints.reasoning import held_tag_prefix
from mrv2.entrypoints.tool_calls import PYTHON_START, ToolCall
from mrv2.entrypoints.tool_parsers_more import (
    DSML_CALLS,
    DSML_CALLS_END,
    DSML_INVOKE,
    DSML_INVOKE_END,
)
from mrv2.entrypoints.tool_parsers_xml import (
    MINIMAX_CALLS,
    MINIMAX_CALLS_END,
    MINIMAX_INVOKE,
    MINIMAX_INVOKE_END,
    Tools,
)
from mrv2.entrypoints.tool_stream_xml import ArgumentStream, Format, Part

__all__ = ["BLOCKS", "BlockCalls", "CallDelta", "Part", "PythonCalls"]

#: A format's calls: the text of its blocks -> their calls (ValueError: malformed).
CallsOf = Callable[[str, Tools], list[ToolCall]]
Tags = tuple[str, str]

#: The formats whose calls are blocks: ``(the block around the calls, or None; a call's
#: block)``, each as ``(opening tag, closing tag)`` (no two of a format's tags can overlap).
BLOCKS: dict[str, tuple[Tags | None, Tags]] = {
    "qwen3_coder": (None, ("<function=", "</function>")),
    "qwen3_xml": (None, ("<function=", "</function>")),
    "glm45": (None, ("<tool_call>", "</tool_call>")),
    "glm47": (None, ("<tool_call>", "</tool_call>")),
    "minimax_m2": ((MINIMAX_CALLS, MINIMAX_CALLS_END), (MINIMAX_INVOKE, MINIMAX_INVOKE_END)),
    "deepseek_v32": ((DSML_CALLS, DSML_CALLS_END), (DSML_INVOKE, DSML_INVOKE_END)),
}


@dataclass
class CallDelta:
    """One streamed piece of a call: its ``index`` and the next piece of its ``arguments``
    text; the call's first piece also carries its ``id`` and ``name`` (empty on the others)."""

    index: int
    arguments: str
    name: str = ""
    id: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The chat stream's ``delta.tool_calls`` entry (vLLM's: id, type and name on the
        call's first piece only)."""
        if not self.name:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class BlockCalls:
    """An XML-like format's calls as they come (module doc), found as the whole answer's
    parser finds them: a block from its opening tag to the first closing tag after it (an
    invoke at the latest where the block around it ends); text between is skipped. ``form``:
    how a call's arguments stream (None: each call whole when its block closes)."""

    def __init__(self, calls_of: CallsOf, tools: Tools, outer: Tags | None, inner: Tags,
                 form: Format | None = None) -> None:
        self.calls_of, self.tools, self.outer, self.inner = calls_of, tools, outer, inner
        self.form = form
        # "out": before a block around the calls; "between": before a call's block (within
        # the block around them, if any); "call": in a call's block
        self.state = "out" if outer is not None else "between"
        self.rest = ""  # text not read yet: what may begin a tag
        self.body: list[str] = []  # the open call's block's text so far
        self.call: ArgumentStream | None = None  # the open call's arguments (form's)
        self.failed = False

    def feed(self, text: str) -> list[Part]:
        """The next text: the parts of calls it made certain."""
        if self.failed:
            return []
        text, self.rest = self.rest + text, ""
        out: list[Part] = []
        while text and not self.failed:
            text = self._step(text, out)
        return out

    def _step(self, text: str, out: list[Part]) -> str:
        """Reads ``text`` up to the next tag that changes the state: what is left of it."""
        start, end = self.inner
        opening, closing = self.outer or ("", "")
        if self.state == "out":
            at = text.find(opening)
            if at < 0:
                self._hold(text, opening, "")
                return ""
            self.state = "between"
            return text[at + len(opening):]
        stop = text.find(closing) if closing else -1
        if self.state == "between":
            at = text.find(start)
            if at >= 0 and (stop < 0 or at + len(start) <= stop):
                self.state, self.body = "call", []
                if self.form is not None:
                    self.call = ArgumentStream(self.form, self.tools)
                return text[at + len(start):]
            if stop >= 0:  # (the block around the calls ended)
                self.state = "out"
                return text[stop + len(closing):]
            self._hold(text, start, closing)
            return ""
        at = text.find(end)
        if at >= 0 and (stop < 0 or at + len(end) <= stop):
            self._close(text[:at], end, out)
            self.state = "between"
            return text[at + len(end):]
        if stop >= 0:  # (an invoke without its closing tag: it ends with the block around)
            self._close(text[:stop], "", out)
            self.state = "out"
            return text[stop + len(closing):]
        keep = self._hold(text, end, closing)
        self._body(text[:len(text) - keep], out)
        return ""

    def _body(self, text: str, out: list[Part]) -> None:
        """More of the open call's block."""
        self.body.append(text)
        if self.call is not None:
            out += self.call.feed(text)

    def _hold(self, text: str, tag: str, other: str) -> int:
        """Keeps the end of ``text`` that may begin ``tag`` or ``other``: how much."""
        keep = max(held_tag_prefix(text, tag), held_tag_prefix(text, other) if other else 0)
        self.rest = text[len(text) - keep:] if keep else ""
        return keep

    def _close(self, last: str, end: str, out: list[Part]) -> None:
        """A call's block closed (``end``: its closing tag; "": the block around it ended
        it): its calls, read from that block alone (what of them did not go out yet)."""
        self._body(last, out)
        block = self.inner[0] + "".join(self.body) + end
        if self.outer is not None:
            block = self.outer[0] + block + self.outer[1]
        call, self.body, self.call = self.call, [], None
        try:
            calls = self.calls_of(block, self.tools)
        except (ValueError, RecursionError):  # (the whole answer is no call)
            self.failed = True
            return
        out += call.close(calls) if call is not None else [
            Part(c.arguments, c.name, c.id) for c in calls]


_CODE = re.compile(r"[^'\"#()\[\]{},]+")  # Python text with nothing to track
_IN_STRING = {q: re.compile(r"[^\\" + q + "]+") for q in "'\""}


class PythonCalls:
    """``pythonic``'s calls (``[f(a=1), g()]``, optionally after ``<|python_start|>``), each
    once the ``,`` or ``]`` after it shows (module doc): its element of the list, read by the
    parser as a list of that one call. Strings (of any quoting) and comments are skipped, so a
    bracket or comma in them is not the list's."""

    def __init__(self, calls_of: CallsOf, tools: Tools) -> None:
        self.calls_of, self.tools = calls_of, tools
        self.state = "lead"  # before the list's "[" ("tagged": after <|python_start|>),
        # "list": in it, "done": past its "]" (or not a list of calls: nothing more)
        self.rest = ""  # text not read yet (what may begin a marker, a quote or an escape)
        self.depth = 1  # the brackets open within the list, its own included
        self.quote = ""  # the open string's quote (its three for a triple one), "#": a comment
        self.element: list[str] = []  # the list element's text so far

    def feed(self, text: str) -> list[Part]:
        """The next text: the calls it made certain, each whole."""
        if self.state == "done":
            return []
        text, self.rest = self.rest + text, ""
        if self.state != "list":
            text = self._lead(text)
            if self.state != "list":
                return []
        out: list[Part] = []
        mark, (i, held) = 0, self._scan(text, 0)
        while not held and i < len(text):
            char = text[i]
            if char in "([{":
                self.depth += 1
            elif self.depth > 1:  # (within the element)
                self.depth -= char != ","
            elif char == ",":  # an element ends
                out += self._element(text[mark:i])
                mark = i + 1
            else:  # the list ends ("]"; ")" or "}": it is no list, the whole parse decides)
                if char == "]":
                    out += self._element(text[mark:i])
                self.state = "done"
                return out
            i, held = self._scan(text, i + 1)
        self.element.append(text[mark:i])
        self.rest = text[i:]
        return out

    def _lead(self, text: str) -> str:
        """Before the list: what follows its ``[`` (the state then ``list``)."""
        text = text.lstrip()
        if self.state == "lead" and text.startswith(PYTHON_START):
            text, self.state = text[len(PYTHON_START):].lstrip(), "tagged"
        if not text or (self.state == "lead" and PYTHON_START.startswith(text)):
            self.rest = text
            return ""
        if text[0] != "[":
            self.state = "done"  # (the whole answer's parse decides)
            return ""
        self.state = "list"
        return text[1:]

    def _scan(self, text: str, i: int) -> tuple[int, bool]:
        """From ``i``: past strings, comments and plain text, to the next bracket or comma
        (``len(text)``: none), or to a quote or escape that needs more text (held: True)."""
        n = len(text)
        while i < n:
            quote = self.quote
            if quote == "#":
                newline = text.find("\n", i)
                if newline < 0:
                    return n, False
                self.quote, i = "", newline + 1
            elif quote:
                match = _IN_STRING[quote[0]].match(text, i)
                i = match.end() if match is not None else i
                if i == n:
                    return n, False
                if text[i] == "\\":
                    if i + 1 == n:
                        return i, True
                    i += 2
                elif text.startswith(quote, i):
                    self.quote, i = "", i + len(quote)
                elif n - i < 3 and quote.startswith(text[i:]):  # (a triple quote's end?)
                    return i, True
                else:
                    i += 1
            else:
                match = _CODE.match(text, i)
                if match is not None:
                    i = match.end()
                    continue
                char = text[i]
                if char == "#":
                    self.quote, i = "#", i + 1
                elif char in "'\"":
                    if text.startswith(char * 3, i):
                        self.quote, i = char * 3, i + 3
                    elif n - i < 3 and (char * 3).startswith(text[i:]):  # ("", or '''?)
                        return i, True
                    else:
                        self.quote, i = char, i + 1
                else:
                    return i, False
        return n, False

    def _element(self, tail: str) -> list[Part]:
        """A list element ended: its call, read as a list of it alone (a comment may end
        it: the newline)."""
        text, self.element = "".join(self.element) + tail, []
        try:
            return [Part(c.arguments, c.name, c.id)
                    for c in self.calls_of("[" + text + "\n]", self.tools)]
        except (ValueError, RecursionError):  # (not a call; or none: a trailing comma)
            self.state = "done"
            return []
