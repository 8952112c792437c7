"""The grammar text of a request's structured output (``SamplingParams.structured_outputs``):
a JSON schema (closed with ``disable_additional_properties``, vLLM's whitespace options), any
JSON object, a regular expression, a choice of strings, a Lark or GBNF grammar, or vLLM's
structural tags, as llguidance's grammar; :mod:`mrv2.engine.structured_outputs` compiles and
checks it and holds each request's matcher."""

from __future__ import annotations

import json
import re
from typing import Any

from mrv2.contract.params import StructuredOutputsParams

__all__ = ["FIELD", "grammar_of", "load_llguidance"]

#: The request field a bad constraint is reported under.
FIELD = "SamplingParams.structured_outputs"


def load_llguidance() -> Any:
    """The ``llguidance`` module (with ``llguidance.hf``); ValueError naming the field where
    this Python lacks it."""
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise ValueError(f"{FIELD} needs llguidance, which this Python lacks: pip install "
                         "llguidance (or 'mrv2[serve]')") from None
    return llguidance


def grammar_of(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar text of ``spec`` (not checked yet); ValueError where it cannot
    be built (a grammar neither Lark nor GBNF, a structural tag without its fields)."""
    llg = load_llguidance()
    matcher = llg.LLMatcher
    if spec.json is not None or spec.json_object:
        schema = {"type": "object"} if spec.json_object else spec.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        return str(matcher.grammar_from_json_schema(_closed(spec, schema),
                                                    overrides=_json_options(spec)))
    if spec.regex is not None:
        return str(matcher.grammar_from_regex(spec.regex))
    if spec.choice is not None:  # Lark string literals, JSON-escaped
        return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
    if spec.structural_tag is not None:
        return _structural_tag_grammar(spec)
    assert spec.grammar is not None
    return str(matcher.grammar_from_lark(_lark(spec.grammar)))


#: A line that defines a GBNF rule (``name ::= ...``; Lark writes ``name: ...``).
_GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z_][\w-]*\s*::=")


def _lark(grammar: str) -> str:
    """``grammar`` as Lark: vLLM's EBNF (llama.cpp's GBNF, which xgrammar reads: ``root ::=
    ...``) converted by llguidance; a grammar in which no line defines a rule with ``::=``,
    or with a ``start:`` rule, is Lark already (``?start:`` too, which llguidance's own test,
    wanting ``start:``, would convert)."""
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

    if not _GBNF_RULE.search(grammar) or is_lark_syntax(grammar):
        return grammar
    try:
        return str(gbnf_to_lark(grammar))
    except Exception as error:  # (the converter's own errors, whatever their type)
        raise ValueError(f"neither Lark nor GBNF: {error}") from None


def _json_options(spec: StructuredOutputsParams) -> dict[str, Any] | None:
    """llguidance's JSON compile options of ``spec`` (None: its defaults, any whitespace)."""
    options: dict[str, Any] = {}
    if spec.disable_any_whitespace:
        options["whitespace_flexible"] = False
    if spec.whitespace_pattern is not None:
        options["whitespace_pattern"] = spec.whitespace_pattern
    return options or None


#: JSON-schema keywords whose value maps names to subschemas, and those whose value is a
#: subschema or a list of them (where ``additionalProperties: false`` may have to go).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                "dependencies")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "items", "prefixItems",
               "additionalItems", "unevaluatedItems", "contains", "not", "if", "then", "else",
               "anyOf", "oneOf", "propertyNames", "contentSchema")


def _closed(spec: StructuredOutputsParams, schema: Any) -> Any:
    """``schema``, with ``disable_additional_properties``: a copy in which every object schema
    that lists properties and says nothing of others has ``additionalProperties: false``
    (vLLM's rule), but an ``allOf``'s parts and the schema that holds them (each part closed
    would refuse the others' properties: nothing could match)."""
    if not spec.disable_additional_properties:
        return schema

    def close(node: Any, part: bool = False) -> Any:
        if isinstance(node, list):
            return [close(item, part) for item in node]
        if not isinstance(node, dict):
            return node
        out = dict(node)
        for key in _SCHEMA_MAPS:
            if isinstance(out.get(key), dict):
                out[key] = {name: close(sub) for name, sub in out[key].items()}
        for key in _SUBSCHEMAS:
            if isinstance(out.get(key), (dict, list)):
                out[key] = close(out[key])
        if isinstance(out.get("allOf"), list):
            out["allOf"] = close(out["allOf"], part=True)
        if (not part and "allOf" not in out and "additionalProperties" not in out
                and (isinstance(out.get("properties"), dict)
                     or isinstance(out.get("patternProperties"), dict))):
            out["additionalProperties"] = False
        return out

    return close(schema)


def _structural_tag_grammar(spec: StructuredOutputsParams) -> str:
    """The grammar of vLLM's structural tag ``{"structures": [{"begin", "schema", "end"}],
    "triggers": [...]}``: free text in which a trigger opens one of its structures (the
    ``begin`` that starts with it, then JSON of ``schema``, then ``end``); the ``"format"``
    form (xgrammar's alone) is refused."""
    tag = spec.structural_tag
    if isinstance(tag, str):
        tag = json.loads(tag)
    assert isinstance(tag, dict)
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if "format" in tag and structures is None:
        raise ValueError("the \"format\" form of a structural tag is xgrammar's, which this "
                         "server lacks: give {\"structures\": [{\"begin\", \"schema\", "
                         "\"end\"}], \"triggers\": [...]}")
    if not (isinstance(structures, list) and structures and isinstance(triggers, list)
            and all(isinstance(t, str) and t for t in triggers)):
        raise ValueError("expected {\"structures\": [{\"begin\", \"schema\", \"end\"}, "
                         "...], \"triggers\": [non-empty strings]}")
    options = _json_options(spec) or {}
    tags = []
    for s in structures:
        if not (isinstance(s, dict) and isinstance(s.get("begin"), str)
                and isinstance(s.get("end"), str)
                and isinstance(s.get("schema", {}), (dict, bool))):
            raise ValueError(f"a structure is {{\"begin\": str, \"schema\": {{...}}, "
                             f"\"end\": str}}, not {s!r}")
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"no trigger begins the structure {s['begin']!r} (triggers: "
                             f"{triggers!r})")
        schema = _closed(spec, s.get("schema", {}))
        if options and isinstance(schema, dict):  # (the compiler's options, in the schema)
            schema = {**schema, "x-guidance": {**schema.get("x-guidance", {}), **options}}
        tags.append(load_llguidance().StructTag(trigger=trigger, begin=s["begin"],
                                                grammar=schema, end=s["end"]))
    return str(load_llguidance().StructTag.to_grammar(tags))
