"""Reading a PEFT LoRA adapter: its ``adapter_config.json`` checked, its tensors by module.

A PEFT checkpoint directory holds ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``...) and ``adapter_model.safetensors`` (or
``adapter_model.bin``) with, per adapted linear module ``M`` of the base model,
``base_model.model.M.lora_A.weight`` ``[r, in]`` and ``base_model.model.M.lora_B.weight``
``[out, r]``. The module's output becomes ``W x + scaling * B (A x)`` with ``scaling =
lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).

What the engine does not serve is refused here, by name, before a request runs: DoRA,
trained biases, ``modules_to_save`` (full copies of some modules), per-module rank or alpha
patterns, embedding adapters, a rank over ``max_lora_rank``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_CONFIG = "adapter_config.json"
#: ``lora_alpha`` when the config has none: PEFT's ``LoraConfig`` default, as PEFT loads it.
_PEFT_DEFAULT_ALPHA = 8
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of ``adapter_config.json`` the engine uses."""

    rank: int
    scaling: float


@dataclass
class AdapterWeights:
    """An adapter's ``(A [r, in], B [out, r] * scaling)`` pairs, by the base model's module
    name as the checkpoint spells it (``model.layers.0.self_attn.q_proj``)."""

    config: AdapterConfig
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _refuse(path: Path, field: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"LoRA adapter {str(path)!r}: {_CONFIG} field {field!r} is {value!r}; "
                      f"allowed: {allowed}")


def read_adapter_config(path: str | Path, max_lora_rank: int) -> AdapterConfig:
    """``adapter_config.json`` of the adapter directory ``path``, checked: a ValueError names
    the field and what is allowed."""
    path = Path(path)
    file = path / _CONFIG
    if not file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r}: no {_CONFIG} there (a PEFT adapter "
                         "directory holds adapter_config.json and adapter_model.safetensors)")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"LoRA adapter {str(path)!r}: {_CONFIG} is not JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"LoRA adapter {str(path)!r}: {_CONFIG} holds a JSON "
                         f"{type(data).__name__}; allowed: an object of PEFT's fields")
    peft_type = data.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _refuse(path, "peft_type", peft_type, "'LORA'")
    rank = data.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= max_lora_rank:
        raise _refuse(path, "r", rank, f"an int in 1..{max_lora_rank} (max_lora_rank)")
    alpha = data.get("lora_alpha", _PEFT_DEFAULT_ALPHA)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or (
            isinstance(alpha, float) and not math.isfinite(alpha)):
        raise _refuse(path, "lora_alpha", alpha, "a finite number")
    use_rslora = data.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _refuse(path, "use_rslora", use_rslora, "true or false")
    for field, allowed_value, allowed in (
            ("use_dora", False, "false (DoRA is not served)"),
            ("bias", "none", "'none' (trained biases are not served)"),
            ("fan_in_fan_out", False, "false"),
    ):
        value = data.get(field, allowed_value)
        if value != allowed_value:
            raise _refuse(path, field, value, allowed)
    for field in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if data.get(field):
            raise _refuse(path, field, data[field], "empty (not served)")
    scaling = alpha / (math.sqrt(rank) if use_rslora else rank)
    return AdapterConfig(rank, float(scaling))


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    safetensors_file = path / "adapter_model.safetensors"
    if safetensors_file.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors_file))
    bin_file = path / "adapter_model.bin"
    if bin_file.is_file():
        loaded = torch.load(str(bin_file), map_location="cpu", weights_only=True)
        return dict(loaded)
    raise ValueError(f"LoRA adapter {str(path)!r}: no adapter_model.safetensors (or "
                     "adapter_model.bin) there")


def read_adapter(path: str | Path, max_lora_rank: int) -> AdapterWeights:
    """The adapter at ``path``: its config checked, its tensors paired by module (fp32, the
    scaling folded into ``B``). A ValueError names a tensor that is not a LoRA pair's or a
    pair whose shapes do not fit the rank."""
    path = Path(path)
    config = read_adapter_config(path, max_lora_rank)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in _read_tensors(path).items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise ValueError(f"LoRA adapter {str(path)!r}: tensor {name!r} is not a LoRA "
                             "A/B weight (embedding adapters, biases and saved modules are "
                             "not served)")
        halves.setdefault(match.group(1), {})[match.group(2)] = tensor
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {str(path)!r}: module {module!r} has only "
                             f"lora_{''.join(pair)}")
        a, b = pair["A"].float(), pair["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or (
                a.shape[0] != config.rank):
            raise ValueError(f"LoRA adapter {str(path)!r}: module {module!r} has lora_A "
                             f"{tuple(a.shape)} and lora_B {tuple(b.shape)}; expected "
                             f"[r, in] and [out, r] with {_CONFIG}'s r = {config.rank}")
        modules[module] = (a, b * config.scaling)
    if not modules:
        raise ValueError(f"LoRA adapter {str(path)!r} holds no LoRA weights")
    return AdapterWeights(config, modules)


def save_adapter(path: str | Path, modules: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 alpha: float, use_rslora: bool = False) -> Path:
    """Write a PEFT LoRA adapter as ``peft``'s ``save_pretrained`` does (what
    :func:`read_adapter` reads): for each module of the base model (its checkpoint name,
    ``model.layers.0.self_attn.q_proj``) its ``(A [r, in], B [out, r])``. Returns ``path``."""
    from safetensors.torch import save_file

    if not modules:
        raise ValueError("an adapter needs at least one module")
    rank = next(iter(modules.values()))[0].shape[0]
    tensors = {}
    for module, (a, b) in modules.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / _CONFIG).write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": use_rslora,
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}), "bias": "none",
        "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
        "task_type": "CAUSAL_LM"}))
    return path
