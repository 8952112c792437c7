"""A JSON object's text as it streams, rewritten as it is certain to end: :class:`JsonStream`
gives the beginning of ``json.dumps(json.loads(raw), ensure_ascii=False)`` (the arguments text
of a parsed tool call) that the raw text so far fixes, so a stream can send a call's arguments
in pieces whose concatenation is the whole answer's arguments text.

What is held back: a number or ``true``/``false``/``null`` until it ends (``1`` may become
``10``; ``1.0e2`` is written ``100.0``), a string escape until it is whole (a high surrogate
until the next six characters show whether a low one follows), and the object's closing
brace (:meth:`JsonStream.closing`: the caller sends it when the call is over). What the raw
text cannot become (a control character in a string, a key given twice, a bad escape or
literal, a number json would write back as ``NaN`` or ``Infinity``, which is not JSON and the
tool-call parsers refuse: ``NaN``, ``-Infinity``, ``1e999``; anything but an object at the top)
stops the stream (:attr:`JsonStream.failed`): nothing more comes out, and what came out stays
a beginning of the text a valid object with that beginning would give. This module imports
nothing of mrv2.
"""

from __future__ import annotations

import json
import math
import re

__all__ = ["JsonStream"]

_WS = " \t\n\r"  # (JSON's whitespace, as Python's json reads it)
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')  # string characters that need no escape
_SCALAR = re.compile(r"[-+.0-9A-Za-z]+")  # a number's or literal's characters
_SIMPLE = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
           "t": "\t"}
_HEX = re.compile(r"[0-9a-fA-F]{4}")


def _canon(char: str) -> str:
    """One decoded string character as ``json.dumps(..., ensure_ascii=False)`` writes it."""
    return json.dumps(char, ensure_ascii=False)[1:-1]


class JsonStream:
    """The canonical text of one JSON object whose raw text arrives in pieces (module doc).

    :meth:`feed` the raw text (leading whitespace allowed); :meth:`take` the canonical text
    made certain since the last take; :attr:`done` once the object closed (:attr:`end`: how
    many raw characters it took, whitespace before it included), its closing brace then
    given by :meth:`closing`."""

    def __init__(self) -> None:
        #: The open containers: ``{`` or ``[``, and each object's keys so far.
        self.stack: list[str] = []
        self.keys: list[set[str]] = []
        #: What comes next: ``value``, ``item`` (a value or ``]``: an array opened),
        #: ``key`` (or ``}`` where ``first``), ``colon``, ``after`` (a value ended: ``,`` or
        #: a closing bracket), ``string``, ``scalar``.
        self.expect = "value"
        self.first = False  # the open object has no member yet
        self.key = False  # the open string is a key
        self.key_text: list[str] = []
        self.scalar = ""
        self.rest = ""  # an escape not whole yet (read again with the next raw text)
        self.out: list[str] = []
        self.done = self.failed = False
        self.fed = 0
        #: How many raw characters were read (once :attr:`done`: the object's end).
        self.end = 0

    def take(self) -> str:
        """The canonical text made certain since the last call."""
        text, self.out = "".join(self.out), []
        return text

    def closing(self) -> str:
        """The held closing brace, once :attr:`done`."""
        return "}" if self.done else ""

    def feed(self, raw: str) -> None:
        """The next raw text (what follows the object's end is not read)."""
        if self.done or self.failed:
            return
        self.fed += len(raw)
        data, self.rest = self.rest + raw, ""
        i, n = 0, len(data)
        while i < n and not (self.done or self.failed):
            if self.expect == "string":
                at = self._string(data, i)
                if at < 0:  # (an escape cut off: read again with the next text)
                    self.rest = data[i:]
                    i = n
                    break
                i = at
                continue
            if self.expect == "scalar":
                match = _SCALAR.match(data, i)
                if match is not None:
                    self.scalar += match.group()
                    i = match.end()
                    continue
                self._scalar_end()
                continue
            char = data[i]
            i += 1
            if char not in _WS:
                self._structure(char)
        self.end = self.fed - len(self.rest) - (n - i)

    # -- structure ---------------------------------------------------------------------------

    def _structure(self, char: str) -> None:
        expect = self.expect
        if expect == "item" and char == "]":
            self._close("[")
        elif expect in ("value", "item"):
            self._value(char)
        elif expect == "key":
            if char == '"':
                self.out.append('"')
                self.expect, self.key, self.key_text = "string", True, []
            elif char == "}" and self.first:
                self._close("{")
            else:
                self.failed = True
        elif expect == "colon":
            if char == ":":
                self.out.append(": ")
                self.expect = "value"
            else:
                self.failed = True
        elif char == ",":  # (expect "after")
            self.out.append(", ")
            self.expect, self.first = ("key" if self.stack[-1] == "{" else "value"), False
        elif char in "}]":
            self._close("{" if char == "}" else "[")
        else:
            self.failed = True

    def _value(self, char: str) -> None:
        if not self.stack and char != "{":
            self.failed = True  # (arguments are an object)
        elif char in "{[":
            self.stack.append(char)
            if char == "{":
                self.keys.append(set())
            self.out.append(char)
            self.expect, self.first = ("key" if char == "{" else "item"), True
        elif char == '"':
            self.out.append('"')
            self.expect, self.key = "string", False
        elif _SCALAR.match(char):
            self.expect, self.scalar = "scalar", char
        else:
            self.failed = True

    def _close(self, bracket: str) -> None:
        if not self.stack or self.stack[-1] != bracket:
            self.failed = True
            return
        self.stack.pop()
        if bracket == "{":
            self.keys.pop()
        if not self.stack:
            self.done = True  # (its brace held: closing())
            return
        self.out.append("}" if bracket == "{" else "]")
        self.expect = "after"

    def _scalar_end(self) -> None:
        try:  # (json's own reading: 1.0e2 -> 100.0, -0 -> 0)
            value = json.loads(self.scalar)
        except ValueError:
            self.failed = True
            return
        if isinstance(value, (str, list, dict)) or (
                isinstance(value, float) and not math.isfinite(value)):  # (NaN, 1e999)
            self.failed = True
            return
        self.out.append(json.dumps(value))
        self.expect = "after"

    # -- strings -----------------------------------------------------------------------------

    def _emit(self, text: str) -> None:
        self.out.append(text)
        if self.key:
            self.key_text.append(text)

    def _string(self, raw: str, i: int) -> int:
        """Reads string characters from ``raw[i]``: where it stopped (-1: at an escape that
        is not whole yet)."""
        match = _PLAIN.match(raw, i)
        if match is not None:
            self._emit(match.group())
            return match.end()
        char = raw[i]
        if char == "\\":
            used = self._escape(raw[i:i + 12])
            return -1 if used is None else i + used
        if char != '"':
            self.failed = True  # (a raw control character)
            return i + 1
        self.out.append('"')
        if self.key:
            key = "".join(self.key_text)
            if key in self.keys[-1]:
                self.failed = True  # (the last value would win: already sent)
            self.keys[-1].add(key)
            self.expect = "colon"
        else:
            self.expect = "after"
        return i + 1

    def _escape(self, esc: str) -> int | None:
        """Emits the escape at ``esc``'s start: how many characters it took (None: more are
        needed to tell)."""
        if len(esc) < 2:
            return None
        kind = esc[1]
        if kind in _SIMPLE:
            self._emit(_canon(_SIMPLE[kind]))
            return 2
        if kind != "u":
            self.failed = True
            return 2
        if len(esc) < 6:
            return None
        if not _HEX.fullmatch(esc[2:6]):
            self.failed = True
            return 6
        code = int(esc[2:6], 16)
        if 0xD800 <= code <= 0xDBFF and "\\u".startswith(esc[6:8]):  # a low one may follow
            if len(esc) < 12:
                return None
            if not _HEX.fullmatch(esc[8:12]):
                self.failed = True
                return 12
            low = int(esc[8:12], 16)
            if 0xDC00 <= low <= 0xDFFF:
                self._emit(_canon(chr(0x10000 + ((code - 0xD800) << 10) + low - 0xDC00)))
                return 12
        self._emit(_canon(chr(code)))
        return 6
