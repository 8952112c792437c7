"""gpt-oss's output format, OpenAI's *harmony*: the text split into its messages, whole or as
it streams. The reasoning parser ``openai_gptoss`` and the tool-call parser ``openai`` read
it (:mod:`mrv2.entrypoints.reasoning`, :mod:`mrv2.entrypoints.tool_calls`).

After a prompt ending in ``<|start|>assistant`` the model writes one or more messages::

    <|channel|>analysis<|message|>User asks for weather; call the tool.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json
    <|message|>{"location": "Paris"}<|call|>

Each is a header, ``<|message|>``, a body, and an end: ``<|end|>`` (more follow),
``<|return|>`` (the answer is done) or ``<|call|>`` (a tool is called). A header holds the
role after ``<|start|>`` (the prompt gave the first one), ``<|channel|>NAME``, a recipient
``to=NAME`` (before the channel or after it) and a content type (``<|constrain|>json``, or a
bare ``json``). What each message is, as vLLM's harmony parsing has it:

* to ``functions.NAME`` (any channel): a call of ``NAME``, its body the arguments;
* channel ``analysis``, or to another recipient (a built-in tool: ``python``,
  ``browser.search``): reasoning;
* channel ``final``, or ``commentary`` with no recipient (a preamble before calls, meant for
  the user): content;
* another role's message (a tool's answer the model wrote itself): dropped.

Two messages of one kind are joined with a newline. The markers are special tokens of the
o200k_harmony tokenizer: the detokenizer keeps them only with ``skip_special_tokens=False``.
A stop token's text is not in an answer (``<|return|>`` and ``<|call|>`` are gpt-oss's EOS),
so the last message usually ends with the text. Text that opens with no header (an answer
held to a grammar from its first token, or a model that is not gpt-oss) is content; markers
inside a body that cannot be there (``<|message|>``, ``<|constrain|>``) are dropped, and
``<|start|>`` / ``<|channel|>`` there open the next message (a missing ``<|end|>``). A header
cut off (``max_tokens``) says nothing and is dropped; one that runs past
``MAX_HEADER_CHARS`` without its ``<|message|>`` was no header: its text is content.

A stream (:class:`HarmonyStream`) holds back only what may still be a marker (or a header
that has not reached its ``<|message|>``), and a call's arguments until its message ends:
the pieces a stream gives, joined, are the pieces of the whole text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["MARKERS", "HarmonyStream", "Piece", "parse_harmony", "read_header"]

START, END, MESSAGE = "<|start|>", "<|end|>", "<|message|>"
CHANNEL, CONSTRAIN = "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
#: Every harmony marker (the o200k_harmony special tokens of the format).
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_ENDS = (END, RETURN, CALL)
_LONGEST = max(len(m) for m in MARKERS)
#: A header longer than this without its ``<|message|>`` was no header.
MAX_HEADER_CHARS = 256
FUNCTIONS = "functions."
#: A recipient in the role's part of a header, at a message's start (``<|start|>assistant``
#: was the prompt's): `` to=functions.get_weather<|channel|>commentary json<|message|>``.
_ROLE_RECIPIENT = re.compile(r"\s*to=[^\s<]*\s*")
_CHANNEL_NAME = re.compile(r"[^\s<]*")


@dataclass(frozen=True)
class Piece:
    """Text of one kind: ``reasoning`` or ``content`` (a part of a message's body), or a
    ``call`` (a whole message: ``name`` the function, ``text`` its arguments, ``content_type``
    the header's, None when it gave none; ``ended``: by a marker, not by the text's end)."""

    kind: str
    text: str
    name: str = ""
    content_type: str | None = None
    ended: bool = True

    @property
    def json(self) -> bool:
        """A call's arguments are JSON (no content type, or a JSON one), as vLLM reads them."""
        return self.content_type is None or "json" in self.content_type


@dataclass(frozen=True)
class Header:
    """What a message is (module doc): ``kind`` (``reasoning``, ``content``, ``call`` or
    ``drop``), and a call's function ``name`` and ``content_type``."""

    kind: str
    name: str = ""
    content_type: str | None = None


def read_header(header: str) -> Header:
    """A message's header (the text before its ``<|message|>``) as what the message is."""
    text = header.strip()
    opened = text.startswith(START)
    text = text.removeprefix(START)
    channel = None
    at = text.find(CHANNEL)
    if at >= 0:
        rest = text[at + len(CHANNEL):]
        name = _CHANNEL_NAME.match(rest)
        assert name is not None  # (it matches the empty string)
        channel = name.group(0) or None
        text = f"{text[:at]} {rest[name.end():]}"
    parts = text.replace(CONSTRAIN, " " + CONSTRAIN).split()
    role = parts.pop(0) if opened and parts and not parts[0].startswith("to=") else "assistant"
    recipient = content_type = None
    for part in parts:
        if part.startswith("to="):
            recipient = part[3:]
        elif content_type is None:
            content_type = part.removeprefix(CONSTRAIN) or None
    if role != "assistant":
        return Header("drop")
    if recipient is not None and recipient.startswith(FUNCTIONS):
        return Header("call", recipient[len(FUNCTIONS):], content_type)
    if recipient not in (None, "all") or channel not in (None, "final", "commentary"):
        return Header("reasoning")  # analysis, a built-in tool's call, an unknown channel
    return Header("content")


def _held(text: str) -> int:
    """How many trailing characters of ``text`` may begin a marker."""
    for n in range(min(_LONGEST - 1, len(text)), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in MARKERS):
            return n
    return 0


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The first of ``markers`` in ``text`` and where it is (``(-1, "")``: none)."""
    found = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(found) if found else (-1, "")


def _opens_header(text: str, final: bool) -> bool | None:
    """At a message's start: does ``text`` open a header (None: it cannot tell yet)?"""
    final = final or len(text) > MAX_HEADER_CHARS
    stripped = text.lstrip()
    if stripped.startswith((START, CHANNEL)):
        return True
    match = _ROLE_RECIPIENT.match(text)
    if match is not None:
        rest = text[match.end():]
        if rest.startswith(CHANNEL):
            return True
        return None if not final and CHANNEL.startswith(rest) else False
    if not final and any(m.startswith(stripped) for m in (START, CHANNEL, "to=")):
        return None  # whitespace, or the start of a marker or of "to="
    return False


class HarmonyStream:
    """Splits one output's text deltas into :class:`Piece` s (module doc)."""

    def __init__(self) -> None:
        # "boundary": where a message may start; "header": before its <|message|>; "body"
        self.state = "boundary"
        self.pending = ""  # text held back: a possible marker, or a header not yet whole
        self.header = Header("drop")  # the open message's
        self.call: list[str] = []  # the open call's arguments so far, in pieces
        self.sent: set[str] = set()  # the kinds that gave text already
        self.join = False  # the open message's first text opens with a newline

    def feed(self, delta: str, final: bool = False) -> list[Piece]:
        """The next delta of the output's text; ``final``: nothing follows (held text goes
        out as it is, an open call with it)."""
        text, self.pending = self.pending + delta, ""
        out: list[Piece] = []
        while True:
            if self.state == "boundary":
                opens = _opens_header(text, final)
                if opens is None:
                    self.pending = text
                    break
                if opens:
                    text, self.state = text.lstrip(), "header"
                    continue
                if not text.strip():
                    break  # (final) whitespace only
                self._open(Header("content"))
                continue
            if self.state == "header":
                at, marker = _first(text, (MESSAGE, *_ENDS))
                if marker and at <= MAX_HEADER_CHARS:
                    if marker == MESSAGE:
                        self._open(read_header(text[:at]))
                    else:  # a header ended before its <|message|>: dropped
                        self.state = "boundary"
                    text = text[at + len(marker):]
                    continue
                if marker or len(text) > MAX_HEADER_CHARS:  # no header after all: content
                    self._open(Header("content"))
                    text = text.removeprefix(START).removeprefix(CHANNEL)
                    continue
                if not final:
                    self.pending = text
                break  # (final: a header cut off, dropped)
            at, marker = _first(text, MARKERS)
            if marker:
                self._add(text[:at], out)
                text = text[at + len(marker):] if marker not in (START, CHANNEL) else text[at:]
                if marker in (MESSAGE, CONSTRAIN):
                    continue  # out of place: dropped
                self._close(out, ended=True)
                self.state = "boundary" if marker in _ENDS else "header"
                continue
            keep = 0 if final else _held(text)
            self._add(text[:len(text) - keep], out)
            self.pending = text[len(text) - keep:]
            if final:
                self._close(out, ended=False)
            break
        return out

    def _open(self, header: Header) -> None:
        self.state, self.header, self.call = "body", header, []
        self.join = header.kind in self.sent

    def _add(self, text: str, out: list[Piece]) -> None:
        kind = self.header.kind
        if not text or kind == "drop":
            return
        if kind == "call":
            self.call.append(text)
            return
        if self.join:
            text, self.join = "\n" + text, False
        self.sent.add(kind)
        if out and out[-1].kind == kind:
            out[-1] = Piece(kind, out[-1].text + text)
        else:
            out.append(Piece(kind, text))

    def _close(self, out: list[Piece], ended: bool) -> None:
        if self.header.kind == "call":
            out.append(Piece("call", "".join(self.call), self.header.name,
                             self.header.content_type, ended))
        self.header, self.call = Header("drop"), []


def parse_harmony(text: str) -> list[Piece]:
    """A finished output's pieces (reasoning and content runs, calls), in order."""
    return HarmonyStream().feed(text, final=True)
