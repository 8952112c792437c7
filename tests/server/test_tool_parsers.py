"""Every ``--tool-call-parser`` format, text only: whole answers (content before the calls,
several calls, arguments typed by the tools' schema, malformed answers left as content, a last
call cut off), and streams cut in random small pieces that give the same content and calls (a
call's argument pieces joined: its arguments text to the byte; of a malformed answer, at most a
call's beginning) without ever sending what turns out to be (a part of) a call marker
(``minimax_m2``'s also a character at a time and cut in two anywhere); ``mistral``'s call ids
are 9 letters and digits, ``kimi_k2``'s the model's own (test_tool_parsers_more.py has more of
the newer formats)."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
from server_util import join_tool_calls

from mrv2.entrypoints.tool_calls import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    PARSERS,
    TOOL_CALL_PARSERS,
    mistral_call_id,
    parse_tool_calls,
)
from mrv2.entrypoints.tool_parsers_more import (
    DSML,
    DSML_CALLS,
    KIMI_ARGUMENTS,
    KIMI_CALL,
    KIMI_CALL_END,
    KIMI_SECTIONS,
)
from mrv2.entrypoints.tool_stream import ToolCallStream

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "tags": {"type": "array"}, "opts": {"type": "object"},
        "nothing": {"type": "null"}, "either": {"type": ["null", "integer", "string"]}}}}},
         {"type": "function", "function": {"name": "now"}},
         # pydantic's / LangChain's schemas: Optional[...] as anyOf, enums without a type
         {"type": "function", "function": {"name": "plan", "parameters": {
             "type": "object", "properties": {
                 "n": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None},
                 "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                 "level": {"enum": [1, 2]}, "mode": {"enum": ["1", "2"]},
                 "count": {"type": ["string", "integer"]}, "any": {"description": "?"}}}}}]

Calls = list[tuple[str, dict[str, Any]]]


def _qc(name: str, **params: str) -> str:
    """A qwen3_coder call."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _glm(name: str, newline: bool = True, **args: str) -> str:
    """A glm45 call (``newline=False``: glm47's)."""
    sep = "\n" if newline else ""
    body = "".join(f"<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>{sep}"
                   for k, v in args.items())
    return f"<tool_call>{name}{sep}{body}</tool_call>"


def _mm(*invokes: str) -> str:
    """A minimax_m2 block of invokes."""
    return "<minimax:tool_call>\n" + "".join(invokes) + "</minimax:tool_call>"


def _inv(name: str, quote: str = '"', **params: str) -> str:
    """A minimax_m2 invoke (``quote``: around the names)."""
    body = "".join(f"<parameter name={quote}{k}{quote}>{v}</parameter>\n"
                   for k, v in params.items())
    return f"<invoke name={quote}{name}{quote}>\n{body}</invoke>\n"


def _v3(name: str, arguments: str) -> str:
    return f"{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n{arguments}\n```{DS_CALL_END}"


def _v31(name: str, arguments: str) -> str:
    return f"{DS_CALL_BEGIN}{name}{DS_SEP}{arguments}{DS_CALL_END}"


def _kimi(call_id: str, arguments: str) -> str:
    return f"{KIMI_CALL}{call_id}{KIMI_ARGUMENTS}{arguments}{KIMI_CALL_END}"


def _dsml(*invokes: str) -> str:
    """A deepseek_v32 block of invokes."""
    return f"{DSML_CALLS}\n" + "".join(invokes) + f"</{DSML}function_calls>"


def _dinv(name: str, typed: dict[str, str] | None = None, **strings: str) -> str:
    """A deepseek_v32 invoke: ``strings`` written with ``string="true"``, ``typed`` with
    ``string="false"``."""
    params = [(k, v, "true") for k, v in strings.items()] + [
        (k, v, "false") for k, v in (typed or {}).items()]
    body = "".join(f'<{DSML}parameter name="{k}" string="{s}">{v}</{DSML}parameter>\n'
                   for k, v, s in params)
    return f'<{DSML}invoke name="{name}">\n{body}</{DSML}invoke>\n'


HERMES = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
QC_CUT = "<tool_call>\n<function=weather>\n<parameter=city>\nPar"
QC_DROPPED = "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n<parameter=days>\n3"
GLM_ARGS = "<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
KIMI, KIMI_END = KIMI_SECTIONS[0], "<|tool_calls_section_end|>"
DS_CUT = f'{DSML_CALLS}\n<{DSML}invoke name="weather">\n<{DSML}parameter name="city" string="tr'
MM_CUT = '<minimax:tool_call>\n<invoke name="weather">\n<parameter name="city">Par'
PARIS: Calls = [("weather", {"city": "Paris"})]

#: parser -> [(answer, content, calls)]
CASES: dict[str, list[tuple[str, str | None, Calls]]] = {
    "hermes": [
        ("Let me check.\n" + HERMES + HERMES.replace("Paris", "Lyon"), "Let me check.\n",
         [*PARIS, ("weather", {"city": "Lyon"})]),
        ('<tool_call>{"name": "now", "arguments": {}}', None, [("now", {})]),  # cut off
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ],
    "qwen3_coder": [
        ("Sure.\n" + _qc("weather", city="Paris", days="3") + "\n"
         + _qc("weather", city="New\nYork", metric="True", ratio="0.5", tags='["a", 1]',
               opts='{"x": null}', nothing="null", either="7"),
         "Sure.\n", [("weather", {"city": "Paris", "days": 3}),
                     ("weather", {"city": "New\nYork", "metric": True, "ratio": 0.5,
                                  "tags": ["a", 1], "opts": {"x": None}, "nothing": None,
                                  "either": 7})]),
        (_qc("weather", days="three", ratio="1e999", metric="yes", tags="{}", either="null",
             extra="5"), None,
         [("weather", {"days": "three", "ratio": "1e999", "metric": "yes", "tags": "{}",
                       "either": None, "extra": "5"})]),
        (_qc("weather", city="\n  x = 1\n", days="-2"), None,  # one newline off each end
         [("weather", {"city": "\n  x = 1\n", "days": -2})]),
        (_qc("lookup", days="3"), None, [("lookup", {"days": "3"})]),  # no schema: text
        (_qc("plan", n="3", note="null", level="2", mode="2", count="4", any="[1]"), None,
         [("plan", {"n": 3, "note": None, "level": 2, "mode": "2", "count": 4,
                    "any": "[1]"})]),  # (vLLM's: a value without a type is text)
        (_qc("plan", n="null", note="x"), None, [("plan", {"n": None, "note": "x"})]),
        ("Run: <function=now>\n</function>", "Run: ", [("now", {})]),  # no <tool_call>
        (_qc("now") + "\n" + _qc("weather", city="Paris")[:-24], None,  # cut off, whole
         [("now", {}), *PARIS]),
        ("Hi\n" + QC_CUT, "Hi\n" + QC_CUT, []),  # cut off in a value
        # </parameter> dropped (long contexts; vLLM's parser takes it): the value ends where
        # the next parameter opens, or at </function>; not where the answer was cut off
        (QC_DROPPED + "\n</function>\n</tool_call>", None,
         [("weather", {"city": "Paris", "days": 3})]),
        ("Hi\n" + QC_DROPPED, "Hi\n" + QC_DROPPED, []),
        (_qc("weather", city="a <parameter=x> b"), None,  # tags that pair up: read as written
         [("weather", {"city": "a <parameter=x> b"})]),
        ("<tool_call>\n<function=>\n</function>\n</tool_call>",
         "<tool_call>\n<function=>\n</function>\n</tool_call>", []),
        (_qc("now") + "<tool_call>\n<function=now>\njunk\n</function>",
         _qc("now") + "<tool_call>\n<function=now>\njunk\n</function>", []),
        (HERMES, HERMES, []),  # no <function=: not calls
    ],
    "glm45": [
        ("Let me look.\n" + _glm("weather", city="Paris", days="3") + "\n"
         + _glm("weather", metric="false", opts='{"a": [1]}', ratio="2"),
         "Let me look.\n", [("weather", {"city": "Paris", "days": 3}),
                            ("weather", {"metric": False, "opts": {"a": [1]}, "ratio": 2})]),
        (_glm("weather", False, city="Paris", days="x"), None,  # GLM-4.7's: no newlines
         [("weather", {"city": "Paris", "days": "x"})]),
        ("<tool_call>now</tool_call>", None, [("now", {})]),
        # anyOf / enum types; a value without a type is JSON where it parses (vLLM's); a
        # string as written, whitespace and all
        (_glm("plan", n="3", note="null", level="2", mode="2", any='{"k": [1]}', extra="7"),
         None, [("plan", {"n": 3, "note": None, "level": 2, "mode": "2", "any": {"k": [1]},
                          "extra": 7})]),
        (_glm("plan", n=" null ", any=" a b ", count="x") + _glm("weather", city=" a\n"),
         None, [("plan", {"n": None, "any": "a b", "count": "x"}), ("weather", {"city": " a\n"})]),
        (GLM_ARGS, None, PARIS),  # cut off after a whole argument
        ("<tool_call>now\n", None, [("now", {})]),
        ("x" + GLM_ARGS[:-12], "x" + GLM_ARGS[:-12], []),  # cut off in a value
        ("<tool_call>now", "<tool_call>now", []),  # cut off in the name
        ("<tool_call>weather\n<arg_key>city</arg_key>\n</tool_call>",
         "<tool_call>weather\n<arg_key>city</arg_key>\n</tool_call>", []),
        ("<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
         "<tool_call>\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>", []),
    ],
    "minimax_m2": [
        ("Let me check.\n" + _mm(_inv("weather", city="Paris", days="3"),
                                 _inv("weather", city="New York", metric="true", ratio="0.5",
                                      tags='["a", 1]', opts='{"x": null}', nothing="null",
                                      either="7")),
         "Let me check.\n", [("weather", {"city": "Paris", "days": 3}),
                             ("weather", {"city": "New York", "metric": True, "ratio": 0.5,
                                          "tags": ["a", 1], "opts": {"x": None},
                                          "nothing": None, "either": 7})]),
        # several blocks: the text between and after them is content too (blank text not)
        ("<think>\nplan\n</think>\n\n" + _mm(_inv("now")) + "\nThen:\n"
         + _mm(_inv("weather", "'", city="Zürich")) + "\n",
         "<think>\nplan\n</think>\n\n\nThen:\n", [("now", {}), ("weather", {"city": "Zürich"})]),
        (_mm(_inv("weather", "", city="a < b & c", days="three", ratio="1e999", metric="yes",
                  either="null", extra="5")), None,  # bare names; values that fit no type
         [("weather", {"city": "a < b & c", "days": "three", "ratio": "1e999",
                       "metric": "yes", "either": None, "extra": "5"})]),
        (_mm(_inv("weather", city="\n  New\nYork \n", days=" -2 ")), None,  # stripped
         [("weather", {"city": "New\nYork", "days": -2})]),
        (_mm(_inv("lookup", days="3")), None, [("lookup", {"days": "3"})]),  # no schema: text
        (_mm(_inv("plan", n="3", note="null", level="1")), None,
         [("plan", {"n": 3, "note": None, "level": 1})]),
        (_mm(_inv("now"))[:-len("</minimax:tool_call>")] + _inv("weather", city="Paris")[:-11],
         None, [("now", {}), *PARIS]),  # cut off after a whole argument
        ("Hi\n" + MM_CUT, "Hi\n" + MM_CUT, []),  # cut off in a value
        ('<minimax:tool_call>\n<invoke name="wea', '<minimax:tool_call>\n<invoke name="wea',
         []),  # cut off in the name
        (_mm('<invoke name="">\n</invoke>'), _mm('<invoke name="">\n</invoke>'), []),
        (_mm('<invoke name="now">\njunk\n</invoke>'),
         _mm('<invoke name="now">\njunk\n</invoke>'), []),
        (_mm(), _mm(), []),  # a block without an invoke
        (HERMES, HERMES, []),  # another format's call: content
    ],
    "qwen3_xml": [  # qwen3_coder's, and the text between and after the calls is content
        ("Sure.\n" + _qc("weather", city="Paris", days="3") + "\nAnd:\n" + _qc("now") + "\n",
         "Sure.\n\nAnd:\n", [("weather", {"city": "Paris", "days": 3}), ("now", {})]),
        (_qc("weather", opts="{'a': True, 'b': None}", tags="('x', 1)", nothing="None",
             either="None", city="None", days="None"), None,  # (Qwen3.5's None; literals)
         [("weather", {"opts": {"a": True, "b": None}, "tags": ["x", 1], "nothing": None,
                       "either": None, "city": "None", "days": "None"})]),
        (_qc("weather", opts="{1, 2}", tags="[1e999]", metric="yes") + "Done.", "Done.",
         [("weather", {"opts": "{1, 2}", "tags": "[1e999]", "metric": "yes"})]),
        (_qc("plan", n="None", note="None", any="None"), None,
         [("plan", {"n": None, "note": None, "any": "None"})]),
        ("Run: <function=now>\n</function> ok", "Run:  ok", [("now", {})]),
        (_qc("now") + "\n" + _qc("weather", city="Paris")[:-24], None,  # cut off, whole
         [("now", {}), *PARIS]),
        ("Hi\n" + QC_CUT, "Hi\n" + QC_CUT, []),  # cut off in a value
        (HERMES, HERMES, []),
    ],
    "deepseek_v32": [
        ("Checking.\n\n" + _dsml(_dinv("weather", {"days": "3"}, city="杭州"), _dinv(
            "weather", {"metric": "true", "tags": '["a", 1]', "opts": '{"x": null}',
                        "either": "7", "nothing": "null"}, city="Lyon")),
         "Checking.\n\n", [("weather", {"city": "杭州", "days": 3}), (
             "weather", {"city": "Lyon", "metric": True, "tags": ["a", 1], "opts": {"x": None},
                         "either": 7, "nothing": None})]),
        # string="true": as written; string="false" without a schema: JSON where it parses
        (_dsml(_dinv("weather", city=" a <b>\n", days="3")) + "\nDropped.", None,
         [("weather", {"city": " a <b>\n", "days": "3"})]),
        (_dsml(_dinv("lookup", {"n": "3", "o": '{"k": [1]}', "s": " two words "})), None,
         [("lookup", {"n": 3, "o": {"k": [1]}, "s": "two words"})]),
        (_dsml(_dinv("plan", {"n": "null", "level": "2", "count": "4"}, note="null")), None,
         [("plan", {"n": None, "level": 2, "count": 4, "note": "null"})]),
        # a lone wrapper the tool lacks, around the tool's parameters: unwrapped (vLLM's)
        (_dsml(_dinv("weather", {"arguments": '{"city": "Paris"}'}),
               _dinv("weather", input='{"city": "Paris"}'),
               _dinv("weather", {"input": '{"zzz": 1}'})), None,
         [*PARIS, *PARIS, ("weather", {"input": {"zzz": 1}})]),
        (f'{DSML_CALLS}<{DSML}invoke name="weather"><{DSML}parameter name="days">3'
         f"</{DSML}parameter></{DSML}invoke>", None, [("weather", {"days": 3})]),  # no string=
        (_dsml(_dinv("now")).removesuffix(f"</{DSML}function_calls>")
         + _dinv("weather", city="Paris").removesuffix(f"</{DSML}invoke>\n"), None,
         [("now", {}), *PARIS]),  # cut off after a whole parameter
        ("Hi" + DS_CUT, "Hi" + DS_CUT, []),  # cut off in a parameter
        (_dsml(f'<{DSML}invoke name="">\n</{DSML}invoke>'),
         _dsml(f'<{DSML}invoke name="">\n</{DSML}invoke>'), []),
        (_dsml(f'<{DSML}invoke name="now">\njunk\n</{DSML}invoke>'),
         _dsml(f'<{DSML}invoke name="now">\njunk\n</{DSML}invoke>'), []),
        (HERMES, HERMES, []),
    ],
    "kimi_k2": [
        ("Let me check." + KIMI + _kimi("functions.weather:0", '{"city": "Paris"}')
         + _kimi(" functions.now:1 ", " {} ") + KIMI_END + "Dropped.", "Let me check.",
         [*PARIS, ("now", {})]),
        (KIMI_SECTIONS[1] + _kimi("weather:0", '{"city": "Paris"}'), None, PARIS),
        (KIMI + _kimi("functions.weather:0", '{"city": "Paris"}').removesuffix(KIMI_CALL_END),
         None, PARIS),  # cut off, whole
        (KIMI + _kimi("functions.weather:0", '{"city": "Pa'),
         KIMI + _kimi("functions.weather:0", '{"city": "Pa'), []),
        (KIMI + _kimi("weather", "{}"), KIMI + _kimi("weather", "{}"), []),  # no :IDX
        (KIMI + _kimi("functions.:0", "{}"), KIMI + _kimi("functions.:0", "{}"), []),
        (KIMI + _kimi("functions.now:0", "[1]"), KIMI + _kimi("functions.now:0", "[1]"), []),
        (KIMI + _kimi("functions.now:0", '{"x": NaN}'),
         KIMI + _kimi("functions.now:0", '{"x": NaN}'), []),
        (KIMI + _kimi("functions.now:0", '{"x": 1e999}'),
         KIMI + _kimi("functions.now:0", '{"x": 1e999}'), []),
        (KIMI + KIMI_END, KIMI + KIMI_END, []),
        (HERMES, HERMES, []),
    ],
    "deepseek_v3": [
        ("Checking." + DS_CALLS_BEGIN + _v3("weather", '{"city": "Paris"}') + "\n"
         + _v3("now", "{}") + DS_CALLS_END + "<｜end▁of▁sentence｜>", "Checking.",
         [*PARIS, ("now", {})]),
        (DS_CALLS_BEGIN + _v3("weather", '{"city": "Paris"}')[:-len(DS_CALL_END)], None,
         PARIS),  # cut off, whole
        (DS_CALLS_BEGIN + _v3("weather", "{bad}"), DS_CALLS_BEGIN + _v3("weather", "{bad}"),
         []),
        (DS_CALLS_BEGIN + _v3("weather", '{"city": "Pa'), DS_CALLS_BEGIN
         + _v3("weather", '{"city": "Pa'), []),
        (DS_CALLS_BEGIN + _v31("weather", "{}"), DS_CALLS_BEGIN + _v31("weather", "{}"), []),
    ],
    "deepseek_v31": [
        ("Checking." + DS_CALLS_BEGIN + _v31("weather", '{"city": "Paris"}')
         + _v31("now", "{}") + DS_CALLS_END, "Checking.", [*PARIS, ("now", {})]),
        (DS_CALLS_BEGIN + _v31("weather", '{"city": "Paris"}')[:-len(DS_CALL_END)], None,
         PARIS),  # cut off, whole
        (DS_CALLS_BEGIN + _v31("weather", '{"city": "Par'),
         DS_CALLS_BEGIN + _v31("weather", '{"city": "Par'), []),
        (DS_CALLS_BEGIN + _v31("", "{}"), DS_CALLS_BEGIN + _v31("", "{}"), []),
        (DS_CALLS_BEGIN + f"{DS_CALL_BEGIN}weather{{}}{DS_CALL_END}",
         DS_CALLS_BEGIN + f"{DS_CALL_BEGIN}weather{{}}{DS_CALL_END}", []),
    ],
    "llama3_json": [
        ('{"name": "weather", "parameters": {"city": "Paris"}}', None, PARIS),
        (' \n<|python_tag|>{"name": "weather", "arguments": {"city": "Paris"}} ; '
         '{"name": "now", "parameters": {}};', None, [*PARIS, ("now", {})]),
        ('Sure: {"name": "weather", "parameters": {}}',
         'Sure: {"name": "weather", "parameters": {}}', []),
        ('{"name": "weather", "parameters": {"city": "Par',
         '{"name": "weather", "parameters": {"city": "Par', []),
        ('{"city": "Paris"}', '{"city": "Paris"}', []),
        ('{"name": "now", "parameters": {}} and more', '{"name": "now", "parameters": {}} and more',
         []),
        ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
        ("<|python", "<|python", []),
        ("  ", "  ", []),
    ],
    "pythonic": [
        ('[weather(city="Paris")]', None, PARIS),
        ('<|python_start|>[weather(city="Paris"), now()]<|python_end|>', None,
         [*PARIS, ("now", {})]),
        (' \n[weather(city="Paris", days=3, metric=True, ratio=0.5, tags=["a", (1, 2)], '
         'opts={"k": None})] ', None, [("weather", {
             "city": "Paris", "days": 3, "metric": True, "ratio": 0.5, "tags": ["a", [1, 2]],
             "opts": {"k": None}})]),
        ("[tools.now()]", None, [("tools.now", {})]),
        ("Sure: [now()]", "Sure: [now()]", []),  # not the whole answer
        ('[weather(city="Par', '[weather(city="Par', []),  # cut off
        ("[1, 2]", "[1, 2]", []),
        ("[]", "[]", []),
        ('[weather("Paris")]', '[weather("Paris")]', []),  # positional
        ("[weather(city=paris)]", "[weather(city=paris)]", []),  # a name, not a literal
        ("[weather(**opts)]", "[weather(**opts)]", []),
        ('[__import__("os").system("ls")]', '[__import__("os").system("ls")]', []),
        ("[weather(ratio=1e999)]", "[weather(ratio=1e999)]", []),  # not JSON
        ("[weather(tags=[{1, 2}])]", "[weather(tags=[{1, 2}])]", []),  # a set inside
        ("[weather(opts={(1, 2): 3})]", "[weather(opts={(1, 2): 3})]", []),  # tuple keys
        ("[weather(opts={[1]: 2})]", "[weather(opts={[1]: 2})]", []),  # unhashable key
        ("[weather(city=...)]", "[weather(city=...)]", []),  # Ellipsis
        ("[see](https://x.org)", "[see](https://x.org)", []),
        ("[now()] and more", "[now()] and more", []),
    ],
}

_MS_LIST = '[{"name": "weather", "arguments": {"city": "Paris"}}, {"arguments": {}, "name": "now"}]'
_MS_NOW = '[TOOL_CALLS]now[ARGS]{}'
CASES["mistral"] = [
    # tokenizers v11+ (Mistral Small 3.2, Magistral, Devstral, Ministral 3): NAME[ARGS]{...}
    ('Let me check.[TOOL_CALLS]weather[ARGS]{"city": "Paris", "days": 3}' + _MS_NOW,
     "Let me check.", [("weather", {"city": "Paris", "days": 3}), ("now", {})]),
    ('[TOOL_CALLS]weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}', None, PARIS),
    ('[TOOL_CALLS]weather{"city": "Paris"}', None, PARIS),  # [ARGS] not decoded: at "{"
    ('[TOOL_CALLS] weather [ARGS] {"city": "Zürich"} ', None, [("weather", {"city": "Zürich"})]),
    ('[TOOL_CALLS]weather[ARGS]{"city": "Paris"}\nDone.', None, PARIS),  # text after: dropped
    ('[TOOL_CALLS]plan[ARGS]{"n": "3", "opts": {"a": [1, {"b": null}]}}', None,
     [("plan", {"n": "3", "opts": {"a": [1, {"b": None}]}})]),  # as written, nested
    # older tokenizers (Mistral 7B v0.3, Nemo, Small 3.1): a JSON list after [TOOL_CALLS]
    ("[TOOL_CALLS] " + _MS_LIST, None, [*PARIS, ("now", {})]),
    ("Sure.[TOOL_CALLS]" + _MS_LIST + "\nextra trailing data", "Sure.", [*PARIS, ("now", {})]),
    ('[TOOL_CALLS]  junk [{"name": "weather", "arguments": {"city": "Paris"}}] trail', None,
     PARIS),  # vLLM's fallback: the list found in the text
    ('[TOOL_CALLS][{"name": "weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]', None,
     PARIS),  # arguments as a JSON string
    ('[TOOL_CALLS] {"name": "weather", "arguments": {"city": "Paris"}}', None, PARIS),
    (f"[TOOL_CALLS]{_MS_LIST}{_MS_NOW}", None, [*PARIS, ("now", {}), ("now", {})]),
    # malformed: the whole answer is content
    ('Hi[TOOL_CALLS]weather[ARGS]{"city": "Par', 'Hi[TOOL_CALLS]weather[ARGS]{"city": "Par', []),
    ("[TOOL_CALLS]weat", "[TOOL_CALLS]weat", []),  # cut off in the name
    ("Hi[TOOL_CALLS]", "Hi[TOOL_CALLS]", []),
    (_MS_NOW + "[TOOL_CALLS]wea", _MS_NOW + "[TOOL_CALLS]wea", []),  # the next one cut off
    ("[TOOL_CALLS]weather[ARGS]{city: Paris}", "[TOOL_CALLS]weather[ARGS]{city: Paris}", []),
    ("[TOOL_CALLS]weather[ARGS][1, 2]", "[TOOL_CALLS]weather[ARGS][1, 2]", []),
    ("[TOOL_CALLS][ARGS]{}", "[TOOL_CALLS][ARGS]{}", []),  # no name
    ("[TOOL_CALLS]get weather{}", "[TOOL_CALLS]get weather{}", []),
    ("[TOOL_CALLS] not json at all", "[TOOL_CALLS] not json at all", []),
    ('[TOOL_CALLS] [{"arguments": {}}]', '[TOOL_CALLS] [{"arguments": {}}]', []),
    ("[TOOL_CALLS] []", "[TOOL_CALLS] []", []),
    ('[TOOL_CALLS] [{"name": "now"', '[TOOL_CALLS] [{"name": "now"', []),
    ("See [docs](x) and [TOOL_CALL", "See [docs](x) and [TOOL_CALL", []),
    (HERMES, HERMES, []),  # another format's call: content
]
_HARMONY_CALL = ('<|start|>assistant<|channel|>commentary to=functions.weather '
                 '<|constrain|>json<|message|>{"city": "Paris", "days": 3}<|call|>')
CASES["openai"] = [  # (test_harmony.py has the format's cases)
    ("<|channel|>analysis<|message|>Call it.<|end|>" + _HARMONY_CALL, None,
     [("weather", {"city": "Paris", "days": 3})]),
    ("<|channel|>commentary<|message|>Checking.<|end|>" + _HARMONY_CALL * 2, "Checking.",
     [("weather", {"city": "Paris", "days": 3})] * 2),
    ("<|channel|>final<|message|>Sunny.<|return|>", "Sunny.", []),
    (_HARMONY_CALL[:-20], None, []),  # cut off: not a call, not content
]
CASES["glm47"] = CASES["glm45"]
CASES["llama4_pythonic"] = CASES["pythonic"]
CASES["llama4_json"] = CASES["llama3_json"]
for _cases in CASES.values():  # every format: plain text, a near-marker, nothing
    _cases += [("No tools needed.", "No tools needed.", []), ("a <tool_c b", "a <tool_c b", []),
               ("", None, [])]
ALL = [(name, *case) for name, cases in CASES.items() for case in cases]


def _calls(calls: list[Any]) -> Calls:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _joined(calls: list[dict[str, Any]]) -> Calls:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_every_parser_is_tested_and_the_special_tokens_rule() -> None:
    assert sorted(CASES) == sorted(TOOL_CALL_PARSERS)
    assert {n for n, p in PARSERS.items() if p.special_tokens} == {
        "hermes", "glm45", "glm47", "deepseek_v3", "deepseek_v31", "deepseek_v32", "kimi_k2",
        "mistral", "openai"}
    for marker in (DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP):
        assert marker[:2] == "<\uff5c" and marker[-2:] == "\uff5c>" and "\u2581" in marker


@pytest.mark.parametrize(("parser", "text", "content", "calls"), ALL)
def test_whole_answers(parser: str, text: str, content: str | None, calls: Calls) -> None:
    got_content, got_calls = parse_tool_calls(text, parser, TOOLS)
    assert (got_content, _calls(got_calls)) == (content, calls)
    assert all(_id_fits(parser, c.id) for c in got_calls)
    if got_calls:  # arguments are JSON text, non-ASCII kept as is
        assert all(json.dumps(json.loads(c.arguments), ensure_ascii=False) == c.arguments
                   for c in got_calls)


@pytest.mark.parametrize("parser", sorted(CASES))
def test_a_stream_in_small_pieces_gives_the_whole_answer(parser: str) -> None:
    rng = random.Random(0)
    for text, content, calls in CASES[parser]:
        for _ in range(30):
            deltas, pos = [], 0
            while pos < len(text):
                step = rng.randint(1, 6)
                deltas.append(text[pos:pos + step])
                pos += step
            deltas = deltas or [""]
            stream, sent, got = ToolCallStream(parser, TOOLS), "", []
            for i, delta in enumerate(deltas):
                piece, pieces = stream.feed(delta, final=i == len(deltas) - 1)
                sent += piece
                got += [p.as_dict() for p in pieces]
                # nothing sent turns out to be (a part of) a marker: the content so far is
                # always a beginning of the final content
                assert (content or "").startswith(sent), (text, deltas[:i + 1])
            joined = join_tool_calls(got)
            assert all(_id_fits(parser, c["id"]) for c in joined)
            assert stream.called == bool(calls)  # (the choice finishes with tool_calls)
            if not calls:  # malformed, or cut off: calls begun may have gone out (an XML
                # call's name as soon as it is read), the last one unfinished, not more
                assert all(isinstance(json.loads(c["function"]["arguments"]), dict)
                           for c in joined[:-1])
                assert (content or "").startswith(sent)
                continue
            assert ((sent or None), _joined(joined)) == (content, calls), (text, deltas)
            # the arguments pieces join into the whole answer's text, to the byte
            assert [c["function"]["arguments"] for c in joined] == [
                c.arguments for c in parse_tool_calls(text, parser, TOOLS)[1]]


def _id_fits(parser: str, call_id: str) -> bool:
    """``mistral``'s ids are 9 letters and digits (Mistral's templates refuse others),
    ``kimi_k2``'s the model's ``functions.NAME:IDX``, the others' ``call_`` and 24 hex
    digits."""
    if parser == "mistral":
        return re.fullmatch(r"[A-Za-z0-9]{9}", call_id) is not None
    if parser == "kimi_k2":
        return re.fullmatch(r"(functions\.)?\w+:\d+", call_id) is not None
    return re.fullmatch(r"call_[0-9a-f]{24}", call_id) is not None


def test_mistral_call_ids() -> None:
    """Each call its own id of 9 letters and digits (vLLM's ``MistralToolCall``), drawn from
    the OS's randomness (a seeded ``random`` would repeat them across servers)."""
    ids = {mistral_call_id() for _ in range(2000)}
    assert len(ids) == 2000 and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    assert set("".join(ids)) == set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                    "0123456789")
    state = random.getstate()
    try:
        random.seed(0)
        first = mistral_call_id()
        random.seed(0)
        assert mistral_call_id() != first
    finally:
        random.setstate(state)
    _, calls = parse_tool_calls("[TOOL_CALLS]" + _MS_LIST, "mistral")
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize(("text", "content", "calls"), CASES["minimax_m2"])
def test_a_minimax_stream_split_anywhere_gives_the_whole_answer(
        text: str, content: str | None, calls: Calls) -> None:
    """``minimax_m2`` streamed a character at a time, and in two pieces cut at every place:
    the same content and calls as the whole answer, never a part of a marker sent (an answer
    of no calls, malformed or cut off after a call's name went out: what went out stands)."""
    splits = [list(text)] + [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for deltas in splits:
        deltas = deltas or [""]
        stream, sent, got = ToolCallStream("minimax_m2", TOOLS), "", []
        for i, delta in enumerate(deltas):
            piece, pieces = stream.feed(delta, final=i == len(deltas) - 1)
            sent += piece
            got += [p.as_dict() for p in pieces]
            assert (content or "").startswith(sent), (text, deltas[:i + 1])
        if not calls and got:
            assert [c["function"]["arguments"] for c in join_tool_calls(got)] == [""]
            assert not stream.called
            continue
        assert ((sent or None), _joined(join_tool_calls(got))) == (content, calls), (
            text, deltas)


def test_a_stream_holds_a_markers_beginning() -> None:
    assert ToolCallStream("deepseek_v3").feed("Hi <｜tool▁cal") == ("Hi ", [])
    assert ToolCallStream("qwen3_coder").feed("Hi <func") == ("Hi ", [])
    assert ToolCallStream("minimax_m2").feed("Hi <minimax:tool") == ("Hi ", [])
    assert ToolCallStream("mistral").feed("Hi [TOOL_CA") == ("Hi ", [])
    stream = ToolCallStream("llama3_json")
    assert stream.feed(" \n<|py") == ("", [])
    assert stream.feed("thon") == ("", [])
    assert stream.feed("!", final=True) == (" \n<|python!", [])
    plain = ToolCallStream("llama3_json")
    assert plain.feed(" Sure") == (" Sure", []) and plain.feed(" {") == (" {", [])
