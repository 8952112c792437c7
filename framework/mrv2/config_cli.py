"""The engine's CLI flags: one ``--flag`` per field of :class:`mrv2.config.EngineConfig`'s
sections (vLLM's names, and its other spellings: ``-tp``, ``--scheduling-policy``), their
argparse types (vLLM's value forms: ``32k``, ``8G``, JSON objects), and the config built from
them."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any, Literal, get_args, get_origin

from mrv2.config import (
    _FLAT_TO_SECTION,
    _NOT_FLAT,
    _SECTIONS,
    AUTO_MAX_MODEL_LEN,
    EngineConfig,
    _is_auto_length,
)
from mrv2.config_compat import (
    NO_OP_ARGUMENTS,
    compilation_dict,
    dotted_entries,
)

#: vLLM's other names of engine flags (``-tp 2``, as its recipes write them).
_SHORT_FLAGS: dict[str, tuple[str, ...]] = {
    "tensor_parallel_size": ("-tp",), "quantization": ("-q",),
    "policy": ("--scheduling-policy",), "pipeline_parallel_size": ("-pp",),
    "data_parallel_size": ("-dp",), "enable_expert_parallel": ("-ep",)}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per engine field (``--max-model-len``), plus ``--config FILE``."""
    group = parser.add_argument_group("engine")
    group.add_argument("--config", default=None, help="YAML or JSON file of engine arguments")
    for section, model in _SECTIONS.items():
        for name, field in model.model_fields.items():
            if (section == "model" and name == "model") or (section, name) in _NOT_FLAT:
                continue
            flags = ["--" + name.replace("_", "-"), *_SHORT_FLAGS.get(name, ())]
            help_text = field.description or ""
            if field.annotation is bool:
                group.add_argument(
                    *flags, dest=name, default=None, action=argparse.BooleanOptionalAction,
                    help=help_text,
                )
            elif name in _LIST_FLAGS:  # vLLM's form: ``--cuda-graph-sizes 1 2 4 8``
                group.add_argument(*flags, dest=name, default=None, nargs="+",
                                   type=_LIST_FLAGS[name], help=help_text)
            else:
                group.add_argument(
                    *flags, dest=name, default=None,
                    type=_CLI_TYPES.get(name) or _cli_type(field.annotation), help=help_text,
                )
    group.add_argument(
        "--max-cudagraph-capture-size", dest="max_cudagraph_capture_size", default=None,
        type=int, help="vLLM's largest decode CUDA graph: --cuda-graph-sizes N (1, 2, 4, "
        "then every 8 up to N; every 16 past 256)")
    _add_compat_args(group)
    group.add_argument(
        "--logits-processors", dest="logits_processors", default=None, nargs="*",
        help="registered logits processors to apply",
    )
    group.add_argument(
        "--speculative-config", "-sc", dest="speculative_config", default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\'',
    )
    group.add_argument(
        "--structured-outputs-config", dest="structured_outputs_config", default=None,
        help='structured outputs\' defaults as JSON (vLLM\'s), e.g. \'{"backend": "guidance", '
        '"disable_any_whitespace": true}\': backend (always llguidance), disable_fallback, '
        'disable_any_whitespace, disable_additional_properties, reasoning_parser, '
        'reasoning_parser_plugin, '
        'enable_in_reasoning',
    )


def _add_compat_args(group: argparse._ArgumentGroup) -> None:
    """vLLM's compilation flags (:mod:`mrv2.config_compat`) and its download-only flags."""
    group.add_argument(
        "--compilation-config", "-cc", dest="compilation_config", default=None,
        help="vLLM's compilation config as JSON (or a level): mrv2 takes cudagraph_mode (NONE: "
        "no CUDA graphs; FULL_DECODE_ONLY: decode graphs only; PIECEWISE, FULL, "
        "FULL_AND_PIECEWISE: mrv2's graphs), cudagraph_capture_sizes, "
        "max_cudagraph_capture_size, mode / level (no effect: no torch.compile)")
    group.add_argument(
        "--optimization-level", "-O", dest="optimization_level", default=None,
        action="append", metavar="LEVEL",
        help="vLLM's -O0 .. -O3: -O0 runs without CUDA graphs (--enforce-eager), the others "
        "change nothing; -O.key=value (or -cc.key=value) sets one --compilation-config key")
    group.add_argument("--hf-token", dest="hf_token", default=None, nargs="?", const=True,
                       help="vLLM's, accepted: no effect (mrv2 loads local checkpoints)")
    group.add_argument("--ignore-patterns", dest="ignore_patterns", default=None, nargs="+",
                       help="vLLM's, accepted: no effect (it filters only downloads)")
    group.add_argument("--max-parallel-loading-workers", dest="max_parallel_loading_workers",
                       default=None, type=int, help="vLLM's, accepted: no effect")


def _compat_given(args: argparse.Namespace) -> dict[str, Any]:
    """The compilation and download flags given, as :func:`config_compat.translate` takes
    them: ``-O`` values split into the level and ``-O.key=value`` entries over ``-cc``'s."""
    level, entries = dotted_entries(getattr(args, "optimization_level", None) or [])
    compilation = getattr(args, "compilation_config", None)
    given: dict[str, Any] = {"optimization_level": level}
    if entries:
        base = compilation_dict(compilation)
        given["compilation_config"] = {**base, **entries}
    else:
        given["compilation_config"] = compilation
    for name in NO_OP_ARGUMENTS:
        given[name] = getattr(args, name, None)
    return {k: v for k, v in given.items() if v is not None}


def _cli_type(annotation: Any) -> Any:
    """The argparse ``type`` of a field: int or float where every allowed value is one."""
    values = get_args(annotation) or (annotation,)
    if get_origin(annotation) is Literal and all(isinstance(v, int) for v in values):
        return int
    if get_origin(annotation) is dict:
        return _json_value
    kinds = {v for v in values if v is not type(None)}
    if kinds == {int}:
        return int
    if kinds == {float}:
        return float
    return str


def human_readable_int(text: str) -> int:
    """A token count as vLLM's ``--max-model-len`` takes it: ``4096``, or with a decimal
    (``32k`` = 32000, ``25.6k``) or binary (``32K`` = 32768, ``1M``) suffix."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    number, suffix = match.groups() if match else ("", "")
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if number.isdigit():
        return int(number) * 1024 ** ("KMGT".index(suffix) + 1 if suffix else 0)
    raise argparse.ArgumentTypeError(
        f"expected an integer such as 32768, 32k (32000) or 32K (32768), got {text!r}")


def max_model_len_arg(text: str) -> int:
    """``--max-model-len``: :func:`human_readable_int`, or vLLM's ``auto`` / ``-1``
    (:data:`AUTO_MAX_MODEL_LEN`)."""
    return AUTO_MAX_MODEL_LEN if _is_auto_length(text) else human_readable_int(text)


def _int_or_json(text: str) -> Any:
    """``--limit-mm-per-prompt``: a count, or vLLM's JSON object of counts."""
    try:
        return int(text)
    except ValueError:
        return _json_value(text)


def _json_value(text: str) -> Any:
    """A mapping flag's value (``--hf-overrides``), parsed as JSON; argparse names the flag
    on an error (a value of another JSON type is the field's ValidationError)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(
            f"not valid JSON ({error}): expected an object such as "
            f"'{{\"num_hidden_layers\": 40}}', got {text!r}") from None


#: The argparse ``type`` of the flags :func:`_cli_type` does not derive (vLLM's forms).
_CLI_TYPES: dict[str, Any] = {
    "max_model_len": max_model_len_arg, "max_num_batched_tokens": human_readable_int,
    "limit_mm_per_prompt": _int_or_json, "kv_cache_memory_bytes": human_readable_int,
}
#: List fields, given as several values after one flag: each value's argparse ``type``.
_LIST_FLAGS: dict[str, Any] = {"cuda_graph_sizes": int, "cudagraph_capture_sizes": int}


def config_from_cli(args: argparse.Namespace, model: str | None) -> EngineConfig:
    """Build the config from parsed CLI flags; flags given override the ``--config`` file."""
    given: dict[str, Any] = {
        name: getattr(args, name)
        for name in [*_FLAT_TO_SECTION, "logits_processors", "speculative_config",
                     "max_cudagraph_capture_size", "structured_outputs_config"]
        if name != "model" and getattr(args, name, None) is not None
    }
    given.update(_compat_given(args))
    if model is not None:
        given["model"] = model
    config_file = getattr(args, "config", None)
    if config_file:
        return EngineConfig.from_file(config_file, **given)
    return EngineConfig.from_kwargs(**given)


