"""Three more tool-call formats of :mod:`mrv2.entrypoints.tool_calls` (vLLM's parser names):

* ``kimi_k2`` (Kimi-K2, Kimi-K2-Thinking): ``<|tool_calls_section_begin|><|tool_call_begin|>
  functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>...
  <|tool_calls_section_end|>`` (the section also as ``<|tool_call_section_begin|>``, as vLLM
  reads it). The model's ``functions.NAME:IDX`` (or ``NAME:IDX``) is the call's id, as vLLM
  keeps it (Kimi's template writes it back in the next turn); the name is what follows its
  last ``.`` before the ``:``. Arguments are a JSON object. Its markers are special tokens.
  A call the server forces (``tool_choice`` named or ``required``) gets an id of that form too
  (:func:`kimi_call_id`, vLLM's), IDX counting the calls already in the conversation.
* ``qwen3_xml`` (Qwen3-Coder, Qwen3.5): ``qwen3_coder``'s format and values, with what vLLM's
  ``qwen3_xml`` parser reads besides: the text between and after the calls is content too
  (blank text is not), a value whose schema allows ``null`` may be written ``None`` (Qwen3.5's
  template renders a null so), and an ``object`` / ``array`` value that is not JSON may be a
  Python literal (``{'k': 'v'}``, ``True``; nothing is executed).
* ``deepseek_v32`` (DeepSeek-V3.2): DSML, ``<｜DSML｜function_calls>\\n<｜DSML｜invoke
  name="NAME">\\n<｜DSML｜parameter name="KEY" string="true|false">VALUE
  </｜DSML｜parameter>...</｜DSML｜invoke>...</｜DSML｜function_calls>``. A ``string="true"``
  value is the text as written; a ``string="false"`` one (DeepSeek's encoding writes it as
  JSON) is typed by the tool's schema, and read as JSON where the schema does not say
  ``string`` (``glm45``'s rule). A call that wraps its arguments in one ``arguments`` or
  ``input`` parameter the tool does not have is unwrapped where the wrapped object's keys are
  the tool's (vLLM's repair). The text after the block is dropped (DeepSeek's encoding ends
  the message there). The chat route decodes with ``skip_special_tokens=False``, as vLLM's
  parser asks.

A format here is ``(text from its first marker, tools) -> calls``, ValueError when malformed
(``tool_calls`` applies the failure rule: the whole answer is content); a last call cut off
by ``max_tokens`` counts where what came is whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from mrv2.entrypoints.tool_parsers_xml import (
    Call,
    Tools,
    blocks,
    qwen3_coder_calls,
    strict_json,
    typed_call,
)

# -- Kimi-K2 ---------------------------------------------------------------------------------

#: Kimi-K2's section markers (vLLM reads the singular spelling too).
KIMI_SECTIONS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
KIMI_CALL, KIMI_ARGUMENTS, KIMI_CALL_END = (
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
#: A Kimi-K2 call id (``functions.NAME:INDEX``) between its markers.
KIMI_ID = re.compile(r"\s*([^<>\s]+:\d+)\s*")


def _json_object(text: str) -> str:
    """A JSON object's text, written back as JSON (ValueError: not one, or a number no float
    holds: 1e999 would be written back as ``Infinity``)."""
    value = strict_json(text)
    if not isinstance(value, dict):
        raise ValueError("arguments that are not a JSON object")
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def kimi_call_id(name: str, index: int) -> str:
    """Kimi-K2's id of a call the server makes (a forced ``tool_choice``'s): ``functions.NAME:
    IDX``, IDX counting the calls before it in the conversation and the answer (vLLM's
    ``make_tool_call_id``)."""
    return f"functions.{name}:{index}"


def kimi_k2_calls(text: str, tools: Tools) -> list[tuple[str, str, str]]:
    """Each ``<|tool_call_begin|>ID<|tool_call_argument_begin|>{...}<|tool_call_end|>`` as
    ``(name, arguments JSON, id)``; the id is the model's ``functions.NAME:IDX``."""
    calls = []
    for body, _ in blocks(text, KIMI_CALL, KIMI_CALL_END):
        head, sep, arguments = body.partition(KIMI_ARGUMENTS)
        match = KIMI_ID.fullmatch(head)
        if not sep or match is None:
            raise ValueError("a call without an id NAME:INDEX and its arguments")
        call_id = match.group(1)
        name = call_id.rpartition(":")[0].rpartition(".")[2]
        if not name:
            raise ValueError(f"a call id without a name: {call_id!r}")
        calls.append((name, _json_object(arguments), call_id))
    return calls


# -- Qwen3 XML -------------------------------------------------------------------------------

#: A call block: ``<tool_call>...</tool_call>``, or ``<function=...>...</function>`` alone (cut
#: off: to the end).
_QWEN_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|\Z)|<function=.*?(?:</function>|\Z)",
                         re.DOTALL)


def qwen3_xml_calls(text: str, tools: Tools) -> list[Call]:
    """``qwen3_coder``'s calls, a value also read as vLLM's ``qwen3_xml`` reads it (``None``
    for null, a Python literal for an object or array)."""
    return qwen3_coder_calls(text, tools, python=True)


def qwen3_xml_outside(text: str) -> str:
    """The text (from the first call on) between and after the calls, which is content; blank
    pieces are dropped."""
    return "".join(piece for piece in _QWEN_BLOCK.split(text) if piece.strip())


# -- DeepSeek-V3.2 (DSML) --------------------------------------------------------------------

DSML = "｜DSML｜"  # (full-width bars, U+FF5C)
DSML_CALLS, DSML_CALLS_END = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
#: A DSML call's block markers (its name attribute follows the opening one).
DSML_INVOKE, DSML_INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
DSML_NAME = re.compile(r'\s+name="([^"\n]*)"\s*>')
DSML_PARAMETER = re.compile(
    rf'\s*<{DSML}parameter\s+name="([^"\n]*)"(?:\s+string="(true|false)")?\s*>(.*?)'
    rf"</{DSML}parameter>", re.DOTALL)
#: The wrappers a model may put around a call's arguments (vLLM's repair).
ARGUMENT_WRAPPERS = ("arguments", "input")


def tool_properties(tools: Tools, name: str) -> Mapping[str, Any]:
    """The tool ``name``'s parameters' properties (empty: no tool or no schema)."""
    for tool in tools:
        function = tool.get("function")
        if isinstance(function, Mapping) and function.get("name") == name:
            parameters = function.get("parameters")
            props = parameters.get("properties") if isinstance(parameters, Mapping) else None
            return props if isinstance(props, Mapping) else {}
    return {}


def _unwrapped(arguments: dict[str, Any], properties: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments inside a lone ``arguments`` / ``input`` wrapper the tool does not have,
    where the wrapped object's keys are the tool's parameters; else ``arguments``."""
    if len(arguments) != 1 or not properties:
        return arguments
    ((key, inner),) = arguments.items()
    if key not in ARGUMENT_WRAPPERS or key in properties:
        return arguments
    if isinstance(inner, str):
        try:
            inner = strict_json(inner)
        except ValueError:
            return arguments
    if isinstance(inner, dict) and inner and set(inner) <= set(properties):
        return inner
    return arguments


def _dsml_call(body: str, tools: Tools) -> Call:
    """One invoke (``body``: what follows ``<｜DSML｜invoke``)."""
    head = DSML_NAME.match(body)
    if head is None or not head.group(1).strip():
        raise ValueError("an invoke without a name")
    name, pos, found = head.group(1).strip(), head.end(), []
    while (match := DSML_PARAMETER.match(body, pos)) is not None:
        found.append((match.group(1).strip(), match.group(2) == "true", match.group(3)))
        pos = match.end()
    if body[pos:].strip() or any(not key for key, _, _ in found):
        raise ValueError(f"unexpected text in an invoke: {body[pos:pos + 40]!r}")
    typed = json.loads(typed_call(name, [(k, v) for k, as_text, v in found if not as_text],
                                  tools, loose=True)[1])
    arguments = {key: value if as_text else typed[key] for key, as_text, value in found}
    return name, json.dumps(_unwrapped(arguments, tool_properties(tools, name)),
                            ensure_ascii=False, allow_nan=False)


def deepseek_v32_calls(text: str, tools: Tools) -> list[Call]:
    """Every invoke of every ``<｜DSML｜function_calls>`` block."""
    return [_dsml_call(body, tools)
            for block, _ in blocks(text, DSML_CALLS, DSML_CALLS_END)
            for body, _ in blocks(block, DSML_INVOKE, DSML_INVOKE_END)]
