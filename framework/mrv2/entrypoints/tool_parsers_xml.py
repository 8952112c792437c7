"""The XML-like tool-call formats of :mod:`mrv2.entrypoints.tool_calls` (``qwen3_coder``,
``glm45``/``glm47``, ``minimax_m2``), whose argument values are text typed by the request's
``tools`` JSON schemas, and the block splitting every text format shares.

A format here is ``(text from its first marker, tools) -> [(name, arguments JSON text)]``,
ValueError when malformed (``tool_calls`` makes the pairs its ``ToolCall`` and applies the
failure rule); this module imports nothing of ``tool_calls``.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

#: A request's ``tools`` (OpenAI's ``[{"type": "function", "function": {...}}]``).
Tools = Sequence[Mapping[str, Any]]
#: One call: the function's name and its arguments as JSON text.
Call = tuple[str, str]


def blocks(text: str, start: str, end: str) -> list[tuple[str, bool]]:
    """``(body, closed)`` of each ``start ... end`` block; the last may run to the text's end
    unclosed (cut off). Text between blocks is ignored; blank blocks are skipped."""
    found = re.finditer(re.escape(start) + "(.*?)(" + re.escape(end) + r"|\Z)", text, re.DOTALL)
    return [(m.group(1), bool(m.group(2))) for m in found if m.group(1).strip()]


#: A Python value's JSON type (an ``enum`` value's).
_JSON_TYPE: dict[type, str] = {type(None): "null", bool: "boolean", int: "integer",
                               float: "number", str: "string", list: "array", dict: "object"}


def _types_of(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows (vLLM's ``extract_types_from_schema``): its
    ``type`` (one or a list), its ``enum`` values' types, and those of its ``anyOf`` /
    ``oneOf`` / ``allOf`` branches (pydantic writes ``Optional[int]`` as ``{"anyOf":
    [{"type": "integer"}, {"type": "null"}]}``); empty: unknown."""
    if not isinstance(schema, Mapping):
        return []
    kinds = schema.get("type")
    found = [k for k in (kinds if isinstance(kinds, list) else [kinds]) if isinstance(k, str)]
    enum = schema.get("enum")
    for value in enum if isinstance(enum, list) else []:
        found.append(_JSON_TYPE.get(type(value), "string"))
    for key in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(key)
        for branch in branches if isinstance(branches, list) else []:
            found += _types_of(branch)
    return found


def schema_types(tools: Tools, name: str) -> dict[str, list[str]]:
    """The JSON types each parameter of the tool ``name`` allows (:func:`_types_of`)."""
    for tool in tools:
        function = tool.get("function")
        if isinstance(function, Mapping) and function.get("name") == name:
            parameters = function.get("parameters")
            props = parameters.get("properties") if isinstance(parameters, Mapping) else None
            if isinstance(props, Mapping):
                return {k: _types_of(v) for k, v in props.items()}
    return {}


_INTEGER = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    """A JSON number that fits a float (1e999 does not: it would be written back as
    ``Infinity``, which is not JSON)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


#: json's decoder, refusing what it reads beyond JSON (``NaN``, ``Infinity``, ``-Infinity``) and
#: numbers no float holds (``1e999``): written back, either would not be JSON.
_STRICT = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite)


def strict_json(text: str) -> Any:
    """``text`` as JSON (ValueError: not JSON, or a number no float holds)."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite)


def strict_json_at(text: str, pos: int = 0) -> tuple[Any, int]:
    """The JSON value that begins at ``text[pos]`` and where it ends (text may follow it),
    read as :func:`strict_json` reads (ValueError likewise)."""
    return _STRICT.raw_decode(text, pos)


def _python(text: str) -> Any:
    """A Python literal (``{'k': True}``) as a JSON value (ValueError: not one; nothing is
    executed)."""
    try:
        return strict_json(json.dumps(ast.literal_eval(text), allow_nan=False))
    except (SyntaxError, TypeError, MemoryError, RecursionError) as error:  # (TypeError: a set)
        raise ValueError(f"not a Python literal: {error}") from None


def _as_type(value: str, kind: Any, python: bool = False) -> Any:
    """``value`` as the schema type ``kind`` (unknown: the string); ValueError if it does not
    fit. ``python``: also ``None`` for null and a Python literal for an object or array."""
    text = value.strip()
    if kind in ("integer", "number") and _INTEGER.fullmatch(text):
        return int(text)
    if kind == "number" and _NUMBER.fullmatch(text) and math.isfinite(float(text)):
        return float(text)
    if kind in ("integer", "number"):
        raise ValueError(value)
    if kind == "boolean":
        if text.lower() not in ("true", "false"):
            raise ValueError(value)
        return text.lower() == "true"
    if kind in ("object", "array"):
        try:
            parsed = strict_json(text)
        except ValueError:
            if not python:
                raise
            parsed = _python(text)
        if not isinstance(parsed, dict if kind == "object" else list):
            raise ValueError(value)
        return parsed
    if kind == "null":
        if text != "null" and not (python and text == "None"):
            raise ValueError(value)
        return None
    if kind == "json":  # (any JSON value)
        return strict_json(text)
    return value


#: The order in which a value is tried against the types its schema allows (vLLM's): a
#: ``null`` is None, a number a number, ..., before any string.
_PRIORITY = ("null", "integer", "number", "boolean", "object", "array")


def typed_value(value: str, kinds: list[str], loose: bool = False, python: bool = False
                 ) -> Any:
    """``value`` as the first of its schema's types (``kinds``) it fits, in the order of
    :data:`_PRIORITY`; a string if it fits none of them. ``loose`` (GLM's, vLLM's rule): a value
    whose schema does not say ``string`` is read as JSON where it parses (stripped).
    ``python``: :func:`_as_type`'s."""
    for kind in _PRIORITY:
        if kind in kinds:
            try:
                return _as_type(value, kind, python)
            except ValueError:
                continue
    if loose and "string" not in kinds:
        try:
            return _as_type(value, "json")
        except ValueError:
            return value.strip()
    return value


def typed_call(name: str, pairs: list[tuple[str, str]], tools: Tools,
               loose: bool = False, python: bool = False) -> Call:
    """A call from text arguments, each typed by the tool's schema (:func:`typed_value`:
    ``null``/``integer``/``number``/``boolean``/``object``/``array``, also where ``anyOf`` /
    ``oneOf`` or an ``enum`` allows it; a value that fits none, or has no schema, stays a
    string; ``python``: :func:`_as_type`'s)."""
    types = schema_types(tools, name)
    arguments = {key: typed_value(value, types.get(key, []), loose, python)
                 for key, value in pairs}
    return name, json.dumps(arguments, ensure_ascii=False, allow_nan=False)


def pairs_of(text: str, pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    """The ``(key, value)`` matches of ``pattern`` back to back over all of ``text`` (only
    whitespace between and after them; anything else: ValueError)."""
    pairs, pos = [], 0
    while (match := pattern.match(text, pos)) is not None:
        pairs.append((match.group(1).strip(), match.group(2)))
        pos = match.end()
    if text[pos:].strip():
        raise ValueError(f"unexpected text in a call: {text[pos:pos + 40]!r}")
    return pairs


# -- Qwen3-Coder -----------------------------------------------------------------------------

PARAMETER = re.compile(r"\s*<parameter=([^>]*)>(.*?)</parameter>", re.DOTALL)
#: A parameter whose ``</parameter>`` the model may have dropped (long contexts; vLLM's parser
#: takes them too): its value ends where the next parameter opens, and in a closed
#: ``<function=...>`` block (:data:`_CLOSED_DROPPED`) also at ``</function>`` (a block cut off
#: by ``max_tokens`` in its last value is not a whole call). Read only where the tags do not
#: pair up: a value may hold ``<parameter=`` text.
DROPPED = re.compile(r"\s*<parameter=([^>]*)>(.*?)(?:</parameter>|(?=<parameter=))",
                      re.DOTALL)
_CLOSED_DROPPED = re.compile(
    r"\s*<parameter=([^>]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def qwen3_coder_calls(text: str, tools: Tools, python: bool = False) -> list[Call]:
    """Every ``<function=NAME>`` block's call (``python``: :func:`_as_type`'s)."""
    calls = []
    for body, closed in blocks(text, "<function=", "</function>"):
        name, sep, rest = body.partition(">")
        if not sep or not name.strip() or "\n" in name.strip():
            raise ValueError("a function without a name")
        try:
            found = pairs_of(rest, PARAMETER)
        except ValueError:  # (a </parameter> dropped)
            found = pairs_of(rest, _CLOSED_DROPPED if closed else DROPPED)
        pairs = [(key, value.removeprefix("\n").removesuffix("\n")) for key, value in found]
        calls.append(typed_call(name.strip(), pairs, tools, python=python))
    return calls


# -- GLM-4.5 / 4.6 / 4.7 ---------------------------------------------------------------------

ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def glm_calls(text: str, tools: Tools) -> list[Call]:
    calls = []
    for body, closed in blocks(text, "<tool_call>", "</tool_call>"):
        args = body.find("<arg_key>")
        head = body if args < 0 else body[:args]
        name = head.strip()
        if not name or "\n" in name or "<" in name:
            raise ValueError("a call without a name")
        if not closed and args < 0 and not head.endswith("\n"):
            raise ValueError("a call cut off in its name")
        # (a string value as written, whitespace and all; others stripped: vLLM's)
        calls.append(typed_call(name, pairs_of(body[len(head):], ARG), tools, loose=True))
    return calls


# -- MiniMax-M2 ------------------------------------------------------------------------------

#: MiniMax-M2's call block markers (plain text in its tokenizer, not special tokens).
MINIMAX_CALLS, MINIMAX_CALLS_END = "<minimax:tool_call>", "</minimax:tool_call>"
#: A MiniMax-M2 call's block markers (the name follows the opening one).
MINIMAX_INVOKE, MINIMAX_INVOKE_END = "<invoke name=", "</invoke>"
#: A name as MiniMax-M2 writes it: in double quotes, single quotes, or bare.
_QUOTED = r"""\s*("[^"\n]*"|'[^'\n]*'|[^\s"'>]+)\s*>"""
INVOKE_NAME = re.compile(_QUOTED)
MINIMAX_PARAMETER = re.compile(r"\s*<parameter name=" + _QUOTED + "(.*?)</parameter>",
                                re.DOTALL)
_MINIMAX_BLOCK = re.compile(re.escape(MINIMAX_CALLS) + "(?:.*?)(?:"
                            + re.escape(MINIMAX_CALLS_END) + r"|\Z)", re.DOTALL)


def unquoted(name: str, what: str) -> str:
    if len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'":
        name = name[1:-1].strip()
    if not name:
        raise ValueError(f"{what} without a name")
    return name


def minimax_m2_calls(text: str, tools: Tools) -> list[Call]:
    """Every ``<invoke>`` of every ``<minimax:tool_call>`` block (text between invokes is
    ignored); values with surrounding whitespace stripped, as vLLM's parser does."""
    calls = []
    for block, _ in blocks(text, MINIMAX_CALLS, MINIMAX_CALLS_END):
        for body, _ in blocks(block, MINIMAX_INVOKE, MINIMAX_INVOKE_END):
            head = INVOKE_NAME.match(body)
            if head is None:
                raise ValueError("an invoke without a name")
            name = unquoted(head.group(1), "an invoke")
            pairs = [(unquoted(key, "a parameter"), value.strip())
                     for key, value in pairs_of(body[head.end():], MINIMAX_PARAMETER)]
            calls.append(typed_call(name, pairs, tools))
    return calls


def minimax_m2_outside(text: str) -> str:
    """The text (from the first block on) between and after the ``<minimax:tool_call>``
    blocks, which is content; blank pieces are dropped."""
    return "".join(piece for piece in _MINIMAX_BLOCK.split(text) if piece.strip())
