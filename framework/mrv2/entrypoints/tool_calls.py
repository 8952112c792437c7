"""``mrv2 serve --enable-auto-tool-choice --tool-call-parser NAME``: a chat answer's tool
calls as OpenAI's ``tool_calls`` (vLLM's flags and parser names).

How each model family writes its calls (``...``: more calls may follow):

* ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>...``.
* ``qwen3_coder`` (Qwen3-Coder): ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE
  \\n</parameter>...</function>\\n</tool_call>...``; a value is raw text (one leading and one
  trailing newline dropped), ending at ``</parameter>`` or, where the model dropped that tag,
  at the next ``<parameter=`` or ``</function>`` (vLLM's). A call may also open at
  ``<function=`` without ``<tool_call>``.
* ``glm45`` (GLM-4.5, GLM-4.6) and ``glm47`` (GLM-4.7, which writes no newline after the
  name; either parser reads both): ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>
  VALUE</arg_value>...</tool_call>...``.
* ``minimax_m2`` (MiniMax-M2): ``<minimax:tool_call>\\n<invoke name="NAME">\\n<parameter
  name="KEY">VALUE</parameter>...</invoke>...</minimax:tool_call>...``, several invokes in a
  block; names in double, single or no quotes, values with surrounding whitespace stripped
  (vLLM's). The text between and after the blocks is content too (after the text before them).
* ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n
  ```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``.
* ``deepseek_v31`` (DeepSeek-V3.1): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME
  <｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``.
* ``qwen3_xml``, ``deepseek_v32`` (DeepSeek-V3.2's DSML) and ``kimi_k2`` (Kimi-K2, whose
  ``functions.NAME:IDX`` is the call's id): :mod:`mrv2.entrypoints.tool_parsers_more`.
* ``llama3_json`` (Llama 3.x) and ``llama4_json`` (Llama 4; vLLM's other name of the same
  parser): the whole answer, after optional whitespace and ``<|python_tag|>``, is ``{"name":
  ..., "parameters": {...}}`` (or ``"arguments"``), or several such objects separated by
  ``;``. An answer that does not open so is content.
* ``pythonic`` (Llama 3.2, Llama 4, ...) and ``llama4_pythonic`` (the same parser): the whole
  answer is a Python list of calls with keyword arguments, ``[get_weather(city="Paris",
  days=3), now()]``, optionally inside Llama 4's ``<|python_start|>`` ... ``<|python_end|>``;
  values are Python literals (``True``/``False``/``None`` become JSON's), read with
  ``ast.literal_eval`` (nothing is executed). An answer that does not open so is content.
* ``mistral`` (Mistral 7B v0.3, Mistral Nemo, Mistral Small, Ministral, Magistral, Devstral):
  ``[TOOL_CALLS]`` then the older (tokenizers before v11) JSON list ``[{"name": ...,
  "arguments": {...}}, ...]`` (or a lone object; vLLM's fallback too: the first ``[{`` to the
  last ``}]`` after other text), or the newer ``NAME[ARGS]{...}``, one ``[TOOL_CALLS]`` a call
  (``NAME{...}`` where ``[ARGS]`` was not decoded; ``NAME[CALL_ID]ID[ARGS]{...}``: the model's
  id is not used); either format after each ``[TOOL_CALLS]``; text after the JSON is dropped
  (vLLM's). The ids are 9 letters and digits (vLLM's ``MistralToolCall``): Mistral's chat
  templates refuse others.
* ``openai`` (gpt-oss): OpenAI's harmony messages (:mod:`mrv2.entrypoints.harmony`); each
  message ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`` (ended
  by ``<|call|>``, or by the text: ``<|call|>`` is an EOS) is a call. This parser reads the
  model's whole output, not what a reasoning parser left (:attr:`ToolParser.harmony`): the
  content is the ``final`` channel's text and the ``commentary`` preambles, wherever they are,
  with no marker (the ``analysis`` channel is ``openai_gptoss``'s reasoning, dropped here);
  arguments must be a JSON object (none before an end marker: ``{}``) unless the header
  names another content type (they are then passed as written, as vLLM does).

The text before the first call is the message's ``content`` (None when empty); each call
becomes ``{"id", "type": "function", "function": {"name", "arguments": "<JSON text>"}}``.
The XML-like formats (``qwen3_coder``, ``qwen3_xml``, ``glm45``/``glm47``, ``minimax_m2``,
``deepseek_v32``; :mod:`mrv2.entrypoints.tool_parsers_xml`) write values as text: each is typed
by the request's ``tools`` JSON schema (``null``/``integer``/``number``/``boolean``/``object``/
``array``, tried in that order, where its ``type``, an ``anyOf`` / ``oneOf`` branch or an
``enum`` value allows it: pydantic's ``Optional[int]`` is ``anyOf`` integer, null; a value that
fits none, or has no schema, stays a string; ``glm45``/``glm47``: a value whose schema does not
say ``string`` is read as JSON where it parses, as vLLM's GLM parser does).

Failure rule (vLLM's): anything malformed (JSON that does not parse, no name, a structure cut
off where it cannot be recovered) leaves the whole answer as content; so does, in any format's
arguments, a number that would be written back as ``NaN`` or ``Infinity``, which is not JSON
(a client's ``JSON.parse`` fails): ``NaN``, ``Infinity``, ``-Infinity`` (Python's json reads
them) and numbers no float holds (``1e999``). A last call cut off by ``max_tokens`` still
counts if what came is whole (its JSON, its arguments). (``openai``: a call whose JSON does
not parse is dropped, the rest of the answer kept: its text was never content.)

Special tokens: DeepSeek's markers, GLM's tags, harmony's markers and Mistral's
``[TOOL_CALLS]`` / ``[ARGS]`` / ``[CALL_ID]`` are special tokens of their tokenizers, and
``<tool_call>`` is one in some Hermes models' tokenizers; the detokenizer drops them with
``skip_special_tokens`` (the request default). Those parsers say so
(:attr:`ToolParser.special_tokens`), and the chat route then decodes a request that offers
tools with ``skip_special_tokens=False``, as vLLM's ``adjust_request`` does.

A stream (:class:`mrv2.entrypoints.tool_stream.ToolCallStream`) sends the content as it
arrives and each call's arguments in pieces as the model writes them, as vLLM's parsers do
(the formats whose arguments are a JSON object; the XML-like formats' a parameter at a time;
``pythonic``'s calls go out whole, each when it closes). A choice that made calls finishes
with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import ast
import contextlib
import json
import re
import secrets
import string
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mrv2.entrypoints import tool_parsers_more as more
from mrv2.entrypoints.harmony import CHANNEL, START, Piece, parse_harmony
from mrv2.entrypoints.tool_parsers_xml import (
    MINIMAX_CALLS,
    Call,
    Tools,
    glm_calls,
    minimax_m2_calls,
    minimax_m2_outside,
    qwen3_coder_calls,
    strict_json,
    strict_json_at,
)
from mrv2.entrypoints.tool_parsers_xml import blocks as _blocks


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` entry (a stream's: :class:`mrv2.entrypoints.tool_stream.
        CallDelta`)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


#: Makes a call's id: ``(its function's name, its index) -> id``, the index counting the calls
#: before it in the conversation (the messages' assistant ``tool_calls``) and in the answer.
CallId = Callable[[str, int], str]


@dataclass(frozen=True)
class ToolParser:
    """One ``--tool-call-parser`` format.

    ``starts``: the markers that open the calls (the text before the first is content);
    ``calls_of``: the calls in the text from that marker on, ValueError when malformed;
    ``leading``: the calls count only if the answer opens with a marker (after whitespace);
    ``special_tokens``: the markers are special tokens (decode with them kept);
    ``harmony``: gpt-oss's messages, read from the model's whole output (before any
    reasoning parser's split), the content apart from the calls wherever it is;
    ``outside``: the content in the text from the first marker on, outside the calls (none
    where it is not given: what follows the first marker is the calls');
    ``named``: a named ``tool_choice``'s reader, whose whole (not streamed) answer keeps the
    engine's finish reason (``stop``), as OpenAI's and vLLM's do, instead of ``tool_calls``;
    ``call_id``: makes the calls' ids (None: :class:`ToolCall`'s ``call_...``, or the model's
    where the format writes them: ``kimi_k2``);
    ``forced_id``: the ids of the calls a server with this parser forces by ``tool_choice``
    (None: ``call_id``'s; ``kimi_k2``: Kimi's ``functions.NAME:IDX``, as vLLM gives them);
    ``earlier``: the tool calls already in the conversation, where ``call_id``'s index begins;
    ``function``: a named ``tool_choice``'s function (the answer is its arguments);
    ``stream``: a plugin's streaming reader, made for each choice from the request's tools,
    whose ``feed(text)`` gets the text from the first marker on as it comes and returns what
    it made certain: whole :class:`ToolCall`'s, or pieces of a call's arguments
    (:class:`mrv2.entrypoints.tool_stream.CallDelta`; :mod:`mrv2.entrypoints.tool_stream`)."""

    name: str
    starts: tuple[str, ...]
    calls_of: Callable[[str, Tools], list[ToolCall]]
    leading: bool = False
    special_tokens: bool = False
    harmony: bool = False
    outside: Callable[[str], str] | None = None
    named: bool = False
    call_id: CallId | None = None
    forced_id: CallId | None = None
    earlier: int = 0
    function: str = ""
    stream: Callable[[Tools], Any] | None = None

    def make_id(self, name: str, index: int) -> str:
        """The id of the answer's call ``index`` (from 0), whose function is ``name``:
        :attr:`call_id`'s, counting the conversation's calls before the answer too; "" where
        the parser makes none (:class:`ToolCall`'s ``call_...``)."""
        return "" if self.call_id is None else self.call_id(name, self.earlier + index)

    def first_start(self, text: str) -> int:
        """Where the calls begin in ``text`` (-1: nowhere)."""
        if self.leading:
            stripped = text.lstrip()
            return 0 if any(stripped.startswith(s) for s in self.starts) else -1
        found = [i for i in (text.find(s) for s in self.starts) if i >= 0]
        return min(found, default=-1)

    def parse(self, text: str, tools: Tools = ()) -> tuple[str | None, list[ToolCall]]:
        """A finished answer's ``(content, calls)`` (module doc); no calls: ``(text, [])``
        (``harmony``: the content without its markers)."""
        if self.harmony:
            content, calls = _harmony_split(parse_harmony(text))
            return content or None, calls
        first = self.first_start(text)
        if first < 0:
            return (text or None), []
        try:
            calls = self.calls_of(text[first:], tools)
        except (ValueError, RecursionError):  # malformed (RecursionError: JSON nested deep)
            calls = []
        if not calls:
            return (text or None), []
        if self.call_id is not None:
            for index, call in enumerate(calls):
                call.id = self.make_id(call.name, index)
        rest = self.outside(text[first:]) if self.outside is not None else ""
        return (text[:first] + rest or None), calls


# -- shared pieces ---------------------------------------------------------------------------

def _dumps(arguments: Any) -> str:
    """A call's arguments as JSON text (non-ASCII as is; ValueError for a float that is not
    finite, which json would write as ``NaN`` / ``Infinity``: not JSON)."""
    return json.dumps(arguments, ensure_ascii=False, allow_nan=False)


def _json_call(value: Any) -> ToolCall:
    """``{"name": ..., "arguments" | "parameters": {...}}`` as a call (ValueError: no name);
    arguments given as a string are the JSON it holds, or, where it holds none, that string
    (its JSON text: a call's arguments are always JSON)."""
    name = value.get("name") if isinstance(value, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError("a call without a name")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            arguments = strict_json(arguments)
    return ToolCall(name, _dumps(arguments))


def _json_arguments(name: str, text: str) -> ToolCall:
    """A call whose arguments are a JSON object's text (ValueError: bad JSON, a number that is
    not JSON's or no float holds, no name)."""
    arguments = strict_json(text)
    if not name or not isinstance(arguments, dict):
        raise ValueError("a call without a name or an arguments object")
    return ToolCall(name, _dumps(arguments))


# -- the formats -----------------------------------------------------------------------------

def _hermes(text: str, tools: Tools) -> list[ToolCall]:
    return [_json_call(strict_json(body)) for body, _ in _blocks(text, "<tool_call>",
                                                                  "</tool_call>")]


#: DeepSeek's markers (full-width bars U+FF5C, U+2581 for spaces).
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
_DS_V3_CALL = re.compile(r"\s*\w*\s*" + re.escape(DS_SEP)
                         + r"([^\n]*)\n\s*```(?:json)?\s*\n(.*?)\n?```\s*", re.DOTALL)


def _deepseek_v3(text: str, tools: Tools) -> list[ToolCall]:
    calls = []
    for body, _ in _blocks(text, DS_CALL_BEGIN, DS_CALL_END):
        match = _DS_V3_CALL.fullmatch(body)
        if match is None:
            raise ValueError("a call that is not function<sep>NAME ```json ...```")
        calls.append(_json_arguments(match.group(1).strip(), match.group(2)))
    return calls


def _deepseek_v31(text: str, tools: Tools) -> list[ToolCall]:
    calls = []
    for body, _ in _blocks(text, DS_CALL_BEGIN, DS_CALL_END):
        name, sep, arguments = body.partition(DS_SEP)
        if not sep:
            raise ValueError("a call without a separator")
        calls.append(_json_arguments(name.strip(), arguments))
    return calls


PYTHON_TAG = "<|python_tag|>"


def _llama3_json(text: str, tools: Tools) -> list[ToolCall]:
    body = text.lstrip().removeprefix(PYTHON_TAG)
    calls, pos = [], 0
    while True:
        pos = len(body) - len(body[pos:].lstrip())
        value, pos = strict_json_at(body, pos)
        calls.append(_json_call(value))
        rest = body[pos:].lstrip()
        if not rest or rest == ";":
            return calls
        if not rest.startswith(";"):
            raise ValueError("text after a call")
        pos = len(body) - len(rest) + 1


PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


def _python_value(node: ast.expr) -> Any:
    """A call argument's value: a Python literal (strings, numbers, True/False/None, lists,
    tuples, dicts), ValueError for anything else (names, calls, expressions, a dict keyed by
    a list)."""
    try:
        value = ast.literal_eval(node)
    except TypeError as error:  # ({[1]: 2}: an unhashable key)
        raise ValueError(f"not a Python literal: {error}") from None
    if isinstance(value, (set, frozenset, bytes, complex)):
        raise ValueError("not a JSON value")
    return value


def _pythonic(text: str, tools: Tools) -> list[ToolCall]:
    body = text.strip().removeprefix(PYTHON_START).removesuffix(PYTHON_END).strip()
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError as error:
        raise ValueError(f"not a Python list of calls: {error}") from None
    if not isinstance(tree, ast.List) or not tree.elts:
        raise ValueError("not a Python list of calls")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:  # keyword arguments only
            raise ValueError("not a call with keyword arguments")
        name = ast.unparse(node.func)  # a name, or a dotted one
        if not re.fullmatch(r"[A-Za-z_][\w.-]*", name):
            raise ValueError(f"not a function name: {name!r}")
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:  # **kwargs
                raise ValueError("not a call with keyword arguments")
            arguments[keyword.arg] = _python_value(keyword.value)
        try:  # (1e999: ValueError; a set, ..., or tuple keys inside: TypeError)
            text = _dumps(arguments)
        except TypeError as error:
            raise ValueError(f"not JSON values: {error}") from None
        calls.append(ToolCall(name, text))
    return calls


MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_MISTRAL_NAME = re.compile(r"[^\s\[\]{}]+")
_MISTRAL_LIST = re.compile(r"\[\s*\{.*\}\s*\]", re.DOTALL)  # (vLLM's fallback)
_ALPHANUMERIC = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """A Mistral call id: 9 letters and digits (vLLM's ``MistralToolCall.generate_random_id``;
    mistral-common's validator and Mistral's chat templates refuse any other)."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


def _mistral_id(name: str, index: int) -> str:
    return mistral_call_id()  # (random: neither the name nor the index shows)


def _mistral_list(body: str) -> list[ToolCall]:
    """The older format's JSON list of calls (text after it dropped; a lone object taken)."""
    value, _ = strict_json_at(body)
    items = [value] if isinstance(value, dict) else value
    if not isinstance(items, list) or not items:
        raise ValueError("not a list of calls")
    return [_json_call(item) for item in items]


def _mistral_call(segment: str) -> ToolCall:
    """The newer format's ``NAME[ARGS]{...}`` (or ``NAME{...}``, ``NAME[CALL_ID]ID[ARGS]
    {...}``); text after the arguments' JSON dropped."""
    head, sep, arguments = segment.partition(MISTRAL_ARGS)
    if not sep:  # (decoded without [ARGS]: vLLM's name ends at the first "{")
        brace = segment.find("{")
        if brace < 0:
            raise ValueError("a call without arguments")
        head, arguments = segment[:brace], segment[brace:]
    name = head.partition(MISTRAL_CALL_ID)[0].strip()
    if not _MISTRAL_NAME.fullmatch(name):
        raise ValueError(f"not a function name: {name!r}")
    value, _ = strict_json_at(arguments.lstrip())
    if not isinstance(value, dict):
        raise ValueError("arguments that are not a JSON object")
    return ToolCall(name, _dumps(value))


def _mistral(text: str, tools: Tools) -> list[ToolCall]:
    calls = []
    for segment in text.split(MISTRAL_CALLS)[1:]:
        body = segment.strip()
        if not body.startswith(("[", "{")) and MISTRAL_ARGS not in segment and not (
                _MISTRAL_NAME.fullmatch(segment.partition("{")[0].strip())):
            found = _MISTRAL_LIST.search(body)  # text before a list (vLLM's fallback)
            body = found.group() if found else body
        if body.startswith(("[", "{")):  # (no name opens so)
            calls += _mistral_list(body)
        else:
            calls.append(_mistral_call(segment))
    return calls


def harmony_call(piece: Piece) -> ToolCall | None:
    """A harmony call message as a call; None where its name is empty or its JSON arguments
    do not parse (cut off by ``max_tokens``): not a call, and not content either. Empty JSON
    arguments are ``{}`` where a marker ended the message (else it may have been cut off
    right after its header)."""
    if not piece.name or not (piece.ended or piece.text.strip()):
        return None
    if not piece.json:
        return ToolCall(piece.name, piece.text)
    try:
        return _json_arguments(piece.name, piece.text.strip() or "{}")
    except (ValueError, RecursionError):
        return None


def _harmony_split(pieces: list[Piece]) -> tuple[str, list[ToolCall]]:
    """The content and the calls of harmony pieces (reasoning dropped)."""
    calls = [c for p in pieces if p.kind == "call" and (c := harmony_call(p)) is not None]
    return "".join(p.text for p in pieces if p.kind == "content"), calls


def _openai(text: str, tools: Tools) -> list[ToolCall]:
    return _harmony_split(parse_harmony(text))[1]


def _xml(calls_of: Callable[[str, Tools], list[Call]]) -> Callable[[str, Tools], list[ToolCall]]:
    """An XML-like format's ``(name, arguments)`` pairs as calls."""
    return lambda text, tools: [ToolCall(name, arguments) for name, arguments
                                in calls_of(text, tools)]


#: ``--tool-call-parser`` name -> format.
PARSERS: dict[str, ToolParser] = {p.name: p for p in (
    ToolParser("hermes", ("<tool_call>",), _hermes, special_tokens=True),
    ToolParser("qwen3_coder", ("<tool_call>", "<function="), _xml(qwen3_coder_calls)),
    ToolParser("qwen3_xml", ("<tool_call>", "<function="), _xml(more.qwen3_xml_calls),
               outside=more.qwen3_xml_outside),
    ToolParser("glm45", ("<tool_call>",), _xml(glm_calls), special_tokens=True),
    ToolParser("glm47", ("<tool_call>",), _xml(glm_calls), special_tokens=True),
    ToolParser("minimax_m2", (MINIMAX_CALLS,), _xml(minimax_m2_calls),
               outside=minimax_m2_outside),
    ToolParser("deepseek_v3", (DS_CALLS_BEGIN,), _deepseek_v3, special_tokens=True),
    ToolParser("deepseek_v31", (DS_CALLS_BEGIN,), _deepseek_v31, special_tokens=True),
    ToolParser("deepseek_v32", (more.DSML_CALLS,), _xml(more.deepseek_v32_calls),
               special_tokens=True),
    ToolParser("kimi_k2", more.KIMI_SECTIONS, lambda text, tools: [  # (the model's ids)
        ToolCall(*call) for call in more.kimi_k2_calls(text, tools)], special_tokens=True,
               forced_id=more.kimi_call_id),
    ToolParser("llama3_json", (PYTHON_TAG, "{"), _llama3_json, leading=True),
    ToolParser("llama4_json", (PYTHON_TAG, "{"), _llama3_json, leading=True),
    ToolParser("pythonic", ("[", PYTHON_START), _pythonic, leading=True),
    ToolParser("llama4_pythonic", ("[", PYTHON_START), _pythonic, leading=True),
    ToolParser("mistral", (MISTRAL_CALLS,), _mistral, special_tokens=True,
               call_id=_mistral_id),
    ToolParser("openai", (CHANNEL, START), _openai, special_tokens=True, harmony=True),
)}
#: The built-in ``--tool-call-parser`` values (:func:`register_tool_parser` adds others to
#: :data:`PARSERS`).
TOOL_CALL_PARSERS = tuple(PARSERS)


def register_tool_parser(parser: ToolParser) -> ToolParser:
    """Add a ``--tool-call-parser`` format under ``parser.name`` (what a
    ``--tool-parser-plugin`` file calls; vLLM's ``ToolParserManager.register_module``).

    The format is a :class:`ToolParser`: ``starts``, the markers that open the calls, and
    ``calls_of``, a function ``(text, tools) -> list[ToolCall]`` given the answer from the first
    marker on and the request's ``tools``, raising ValueError when the text is malformed (the
    answer is then content). Its calls stream whole when the answer ends, or, with
    ``stream``, as its reader finds them (:mod:`mrv2.entrypoints.tool_stream`). A name taken
    already (a built-in parser's, or another plugin's) is a ValueError naming it. Returns
    ``parser``."""
    if not isinstance(parser, ToolParser):
        raise ValueError(f"register_tool_parser: expected a ToolParser, got "
                         f"{type(parser).__name__}")
    if not parser.name or parser.name in PARSERS:
        raise ValueError(f"tool parser {parser.name!r} is registered already"
                         if parser.name else "a tool parser needs a name")
    if not parser.starts or not callable(parser.calls_of):
        raise ValueError(f"tool parser {parser.name!r}: needs its markers (starts) and a "
                         "calls_of function")
    if parser.stream is not None and not callable(parser.stream):
        raise ValueError(f"tool parser {parser.name!r}: stream must be a class or function "
                         "of the request's tools")
    PARSERS[parser.name] = parser
    return parser


def check_tool_call_parser(name: str | None) -> str | None:
    """``name`` if it is a parser (or None); ValueError listing the parsers otherwise."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"tool_call_parser={name!r}: allowed values are "
                         f"{', '.join(PARSERS)}")
    return name


def get_tool_parser(parser: str | ToolParser) -> ToolParser:
    """The format of a parser name (ValueError listing the names for an unknown one)."""
    if isinstance(parser, ToolParser):
        return parser
    check_tool_call_parser(parser)
    return PARSERS[parser]


def parse_tool_calls(text: str, parser: str | ToolParser = "hermes", tools: Tools = ()
                     ) -> tuple[str | None, list[ToolCall]]:
    """A finished answer's ``(content, calls)`` (module doc); no calls: ``(text, [])``."""
    return get_tool_parser(parser).parse(text, tools)


def _forced_calls(text: str, name: str | None) -> list[ToolCall]:
    """A forced answer's calls: a named choice's arguments object, or ``required``'s list of
    ``{"name", "parameters"}`` (ValueError: not that JSON, e.g. cut off by max_tokens)."""
    if name is not None:
        return [_json_arguments(name, text)]
    value = strict_json(text)
    if not isinstance(value, list) or not value:
        raise ValueError("no list of calls")
    return [_json_call(item) for item in value]


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    schema = tool["function"].get("parameters")
    return schema if isinstance(schema, dict) and schema else {"type": "object"}


def forced_tool_choice(tool_choice: str | Mapping[str, Any], tools: Tools,
                       parallel_tool_calls: bool = True, call_id: CallId | None = None,
                       earlier: int = 0) -> tuple[ToolParser, dict[str, Any]]:
    """``tool_choice`` ``"required"`` or ``{"type": "function", "function": {"name": N}}`` as
    vLLM does it, by structured outputs: the JSON schema the answer must match (a named
    choice: that tool's parameters; ``required``: a list of ``{"name", "parameters"}``, one
    item with ``parallel_tool_calls`` false; the tools' ``$defs`` moved to its root, where
    their ``#/$defs/...`` references point) and the parser that reads it into calls, their
    ids made by ``call_id`` (the server's parser's :attr:`ToolParser.forced_id`, else its
    ``call_id``: vLLM gives a Mistral model's forced calls Mistral's ids, a Kimi-K2's Kimi's;
    None: ``call_...``), the first numbered ``earlier`` (the calls already in the
    conversation).
    ValueError naming ``tool_choice`` for a name no tool has or another form."""
    names = [t["function"]["name"] for t in tools]
    if tool_choice == "required":
        items: list[dict[str, Any]] = []
        defs: dict[str, dict[str, Any]] = {}
        for t in tools:
            parameters = _parameters(t)
            for key in ("$defs", "definitions"):  # ("#/$defs/..." refs: to the root, vLLM's)
                nested = parameters.get(key)
                if not isinstance(nested, dict):
                    continue
                parameters = {k: v for k, v in parameters.items() if k != key}
                for def_name, value in nested.items():
                    if defs.setdefault(key, {}).setdefault(def_name, value) != value:
                        raise ValueError(f"SamplingParams.tool_choice='required' is invalid: "
                                         f"the tools give {key}.{def_name} different schemas "
                                         "(a forced call's schema holds every tool's)")
            items.append({"type": "object", "additionalProperties": False,
                          "required": ["name", "parameters"],
                          "properties": {"name": {"enum": [t["function"]["name"]]},
                                         "parameters": parameters}})
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": {"anyOf": items}, **defs}
        if not parallel_tool_calls:
            schema["maxItems"] = 1
        return ToolParser("required", ("",), lambda text, _: _forced_calls(text, None),
                          call_id=call_id, earlier=earlier), schema
    function = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    if not (isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function"
            and isinstance(name, str)):
        raise ValueError(f"SamplingParams.tool_choice={tool_choice!r} is invalid: expected "
                         "'none', 'auto', 'required' or {\"type\": \"function\", "
                         "\"function\": {\"name\": ...}}")
    if name not in names:
        raise ValueError(f"SamplingParams.tool_choice names {name!r}, which tools lacks "
                         f"(tools: {', '.join(names)})")
    tool = tools[names.index(name)]
    return (ToolParser("named", ("",), lambda text, _: _forced_calls(text, name), named=True,
                       call_id=call_id, earlier=earlier, function=name), _parameters(tool))


@dataclass(frozen=True)
class ToolCalling:
    """One chat request's tool calling: the server's parser and the tools the request
    offers (they type the XML-like formats' arguments)."""

    parser: ToolParser
    tools: Tools = ()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished answer's ``(content, calls)``."""
        return self.parser.parse(text, self.tools)
