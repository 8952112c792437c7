"""vLLM's compilation and CUDA graph arguments, translated to mrv2's engine fields.

mrv2 has no ``torch.compile``: its speed-ups are full CUDA graphs of uniform decode steps
(``cuda_graph_sizes`` / ``cudagraph_capture_sizes``) and of small mixed steps
(``max_mixed_graph_tokens``). vLLM's ``compilation_config`` (``--compilation-config`` /
``-cc`` JSON, ``-O.key=value``), ``optimization_level`` (``-O0`` .. ``-O3``) and
``cudagraph_capture_sizes`` map onto those; the compiler's own settings (``mode``, ``level``)
are accepted and change nothing, and any other key is refused naming it.
"""

from __future__ import annotations

import json
from typing import Any

#: vLLM's ``cudagraph_mode`` values. ``NONE``: no graphs (``enforce_eager``);
#: ``FULL_DECODE_ONLY``: decode graphs only (``max_mixed_graph_tokens=0``); the others: mrv2's
#: graphs as they are (full graphs of decode steps and of small mixed steps; mrv2 has no
#: piecewise graphs, its full graphs serve the steps vLLM's piecewise ones would).
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
#: vLLM's compilation ``mode`` / ``level`` names (or 0..3): accepted, mrv2 compiles nothing.
COMPILATION_MODES = ("NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE", "VLLM_COMPILE",
                     "NO_COMPILATION", "DYNAMO_AS_IS", "DYNAMO_ONCE", "PIECEWISE")
#: ``compilation_config`` keys mrv2 takes.
COMPILATION_KEYS = ("cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size",
                    "mode", "level")
#: vLLM's engine arguments for downloading checkpoints, accepted with no effect: mrv2 loads a
#: local directory and never downloads (``ignore_patterns`` filters only a download in vLLM;
#: ``max_parallel_loading_workers`` batches the loading of its V0 workers).
NO_OP_ARGUMENTS = ("hf_token", "ignore_patterns", "max_parallel_loading_workers")
#: The flat names :func:`translate` consumes (for ``EngineConfig.from_kwargs``' error list).
COMPAT_ARGUMENTS = ("compilation_config", "optimization_level", *NO_OP_ARGUMENTS)
#: vLLM's other names of mrv2's fields, which :func:`translate` renames (``policy``, one
#: ``cuda_graph_sizes`` value).
RENAMED_ARGUMENTS = ("scheduling_policy", "max_cudagraph_capture_size")


def translate(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with vLLM's compilation arguments replaced by mrv2's fields
    (``enforce_eager``, ``max_mixed_graph_tokens``, ``cudagraph_capture_sizes``,
    ``cuda_graph_sizes``), vLLM's other names (:data:`RENAMED_ARGUMENTS`) by mrv2's and the
    no-op ones dropped. ValueError naming the key on a
    value mrv2 cannot honour or on arguments that disagree."""
    out = {k: v for k, v in kwargs.items() if k not in COMPAT_ARGUMENTS}
    derived: dict[str, Any] = {}
    level = kwargs.get("optimization_level")
    if level is not None and _level(level, "optimization_level") == 0:
        derived["enforce_eager"] = True  # vLLM's -O0: no compilation, no CUDA graphs
    compilation = compilation_dict(kwargs.get("compilation_config"))
    for key, value in compilation.items():
        if key not in COMPILATION_KEYS:
            raise ValueError(f"compilation_config key {key!r} is not supported (mrv2 has no "
                             f"torch.compile); supported keys: {', '.join(COMPILATION_KEYS)}")
        if key in ("mode", "level"):
            _level(value, f"compilation_config.{key}", COMPILATION_MODES)
        elif key == "cudagraph_mode":
            mode = str(value).upper()
            if mode not in CUDAGRAPH_MODES:
                raise ValueError(f"compilation_config.cudagraph_mode={value!r}: allowed: "
                                 f"{', '.join(CUDAGRAPH_MODES)}")
            if mode == "NONE":
                derived["enforce_eager"] = True
            elif mode == "FULL_DECODE_ONLY":
                derived["max_mixed_graph_tokens"] = 0
        elif value is not None:
            derived[key] = value
    for key, value in derived.items():
        if out.get(key) is not None and out[key] != value:
            raise ValueError(f"{key}={out[key]!r} disagrees with vLLM's compilation arguments "
                             f"(which mean {key}={value!r}): give one of them")
        out[key] = value
    sizes, largest = out.get("cudagraph_capture_sizes"), out.get("max_cudagraph_capture_size")
    if sizes is not None and out.get("cuda_graph_sizes") is not None:
        raise ValueError("give cudagraph_capture_sizes (the exact sizes) or cuda_graph_sizes "
                         "(one value: the largest), not both")
    if sizes is not None and largest is not None:
        if not sizes or max(sizes) != largest:
            raise ValueError(f"max_cudagraph_capture_size={largest} must be the largest of "
                             f"cudagraph_capture_sizes={sizes}: give one of them")
        del out["max_cudagraph_capture_size"]
    if "scheduling_policy" in out:  # vLLM's name of ``policy``
        policy = out.pop("scheduling_policy")
        if out.get("policy", policy) != policy:
            raise ValueError(f"policy={out['policy']!r} and scheduling_policy={policy!r} "
                             "disagree: give one of them")
        out["policy"] = policy
    largest = out.pop("max_cudagraph_capture_size", None)
    if largest is not None:  # vLLM's: cuda_graph_sizes' one value
        if out.get("cuda_graph_sizes") is not None:
            raise ValueError("give cuda_graph_sizes or max_cudagraph_capture_size, not both")
        out["cuda_graph_sizes"] = [largest]
    return out


def compilation_dict(value: Any) -> dict[str, Any]:
    """vLLM's ``compilation_config``: a mapping, its JSON text, or a bare level (``3``)."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"compilation_config is not valid JSON: {error}") from None
    if isinstance(value, int) and not isinstance(value, bool):
        return {"level": value}
    if not isinstance(value, dict):
        raise ValueError("compilation_config must be a mapping such as "
                         f"{{\"cudagraph_mode\": \"FULL_DECODE_ONLY\"}}; got {value!r}")
    return value


def _level(value: Any, name: str, names: tuple[str, ...] = ()) -> int | str:
    """An optimization level / compilation mode: 0..3 (``"O2"`` too), or one of ``names``."""
    text = str(value).strip().upper()
    if text.isdigit() and int(text) <= 3:
        return int(text)
    if text[:1] == "O" and text[1:].isdigit() and int(text[1:]) <= 3:
        return int(text[1:])
    if text in names:
        return text
    allowed = ", ".join(("0", "1", "2", "3", *names))
    raise ValueError(f"{name}={value!r}: allowed: {allowed}")


def expand_dotted_args(argv: list[str]) -> list[str]:
    """vLLM's dotted compilation flags (``-cc.cudagraph_mode=NONE``,
    ``--compilation-config.cudagraph_capture_sizes [1,2]``, ``-O.mode 0``) as ``-O.key=value``,
    the form the CLI's ``-O`` option takes whole."""
    out: list[str] = []
    index = 0
    while index < len(argv):
        arg = argv[index]
        index += 1
        for prefix in ("--compilation-config.", "-cc.", "-O."):
            if arg.startswith(prefix) and len(arg) > len(prefix):
                rest = arg[len(prefix):]
                if "=" not in rest and index < len(argv):  # ``-O.key value``
                    rest, index = f"{rest}={argv[index]}", index + 1
                arg = "-O." + rest
                break
        out.append(arg)
    return out


def dotted_entries(values: list[str]) -> tuple[Any, dict[str, Any]]:
    """The CLI's ``-O`` values: the last level (``3``; None if none) and the compilation
    config entries (``.key=value``; a value that parses as JSON is that JSON's value)."""
    level: Any = None
    entries: dict[str, Any] = {}
    for value in values:
        if not value.startswith("."):
            level = value
            continue
        key, sep, text = value[1:].partition("=")
        if not sep or not key:
            raise ValueError(f"-O{value}: expected -O.key=value, such as -O.cudagraph_mode=NONE")
        try:
            entries[key] = json.loads(text)
        except json.JSONDecodeError:
            entries[key] = text
    return level, entries
