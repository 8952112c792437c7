"""A model's sampling defaults from its ``generation_config.json``, as vLLM applies them.

Model authors ship the sampling settings their model is meant to run with (Qwen3: temperature
0.6, top-k 20, top-p 0.95). vLLM reads them by default (``--generation-config auto``) and uses
them for every sampling field a request leaves unset; so does mrv2. The fields taken, and the
:class:`~mrv2.contract.params.SamplingParams` field each sets, are vLLM's:
``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty`` and
``max_new_tokens`` (-> ``max_tokens``). ``do_sample`` is ignored, as vLLM ignores it: a request
is greedy when its temperature is 0.

``ModelConfig.generation_config`` picks the source: ``"auto"`` (the model directory's file),
``"none"`` or ``"vllm"`` (no model defaults: mrv2's / vLLM's own), or a directory holding a
``generation_config.json``. ``ModelConfig.override_generation_config`` replaces or adds fields
(the same names) on top of it.

As vLLM's server, ``mrv2 serve`` also takes the ``max_new_tokens`` of an override, or of a
directory's file, as a limit on every request's ``max_tokens`` (:func:`max_tokens_limit`); a
model's own file only sets the default.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from mrv2.contract.params import SamplingParams

logger = logging.getLogger(__name__)

#: generation_config.json field -> the SamplingParams field it sets a default for.
FIELDS: dict[str, str] = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
#: ``generation_config`` values meaning "no model defaults".
NO_DEFAULTS = ("none", "vllm")


def _read(model_dir: str | Path | None, setting: str) -> tuple[dict[str, Any], str]:
    """The generation config's fields, and where they came from (for messages)."""
    if setting in NO_DEFAULTS:
        return {}, ""
    if setting == "auto":
        if model_dir is None:
            return {}, ""
        path = Path(model_dir) / "generation_config.json"
        if not path.is_file():
            return {}, ""
    else:
        path = Path(setting) / "generation_config.json"
        if not path.is_file():
            raise ValueError(
                f"generation_config={setting!r} is invalid: expected 'auto', 'none', 'vllm' or "
                f"a directory holding a generation_config.json ({path} does not exist)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data, str(path)


def load_sampling_defaults(
    model_dir: str | Path | None, setting: str = "auto",
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The SamplingParams defaults (field -> value) of a model, from ``setting`` (see the
    module docstring) and ``overrides``. Raises ``ValueError`` naming the field for an
    override the engine does not take or a value SamplingParams refuses, before any work."""
    data, source = _read(model_dir, setting)
    unknown = sorted(set(overrides or {}) - set(FIELDS))
    if unknown:
        raise ValueError(
            f"override_generation_config has unknown fields {unknown}; allowed: "
            f"{', '.join(FIELDS)}")
    merged = {**{k: data[k] for k in FIELDS if data.get(k) is not None}, **(overrides or {})}
    defaults = {FIELDS[k]: v for k, v in merged.items() if v is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as error:
        where = source or "override_generation_config"
        raise ValueError(f"the sampling defaults of {where} are invalid: {error}") from None
    if defaults:
        logger.info("sampling defaults for requests that leave them unset: %s (from %s; "
                    "--generation-config none turns them off)", defaults,
                    source or "override_generation_config")
    return defaults


def max_tokens_limit(setting: str, overrides: dict[str, Any],
                     defaults: dict[str, Any]) -> int | None:
    """vLLM's server-wide limit on a request's ``max_tokens`` ("if max_new_tokens is specified
    in generation config, then it sets a server-wide limit on the number of output tokens for
    all requests"), as its server applies it: the ``max_new_tokens`` of ``overrides`` with
    ``setting`` ``"auto"`` / ``"none"`` / ``"vllm"`` (a model's own file sets the default
    only), else that of the directory's file and ``overrides`` (``defaults``: what
    :func:`load_sampling_defaults` returned). None: no limit."""
    if setting == "auto" or setting in NO_DEFAULTS:
        value = overrides.get("max_new_tokens")
    else:
        value = defaults.get("max_tokens")
    return None if value is None else int(value)
