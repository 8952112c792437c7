"""``mrv2 serve --lora-modules``: the LoRA adapters a server offers under their own model
names, as vLLM's flag of that name (``NAME=PATH``, or JSON ``{"name": ..., "path": ...}``).

A request whose ``model`` names an adapter runs through it; ``/v1/models`` lists each adapter
with its base model as ``parent``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from mrv2.contract.lora import LoRARequest


def parse_lora_modules(items: Sequence[str]) -> list[LoRARequest]:
    """``NAME=PATH`` or ``{"name": NAME, "path": PATH}`` items as LoRA requests (ids 1, 2...
    in order); a ValueError names a malformed item or a repeated name."""
    loras: list[LoRARequest] = []
    for item in items:
        text = item.strip()
        if text.startswith("{"):
            try:
                data = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"--lora-modules: {item!r} is not valid JSON: {error}") from None
            if not isinstance(data, dict) or not isinstance(data.get("name"), str) or (
                    not isinstance(data.get("path"), str)):
                raise ValueError(f"--lora-modules: {item!r} needs string fields 'name' and "
                                 "'path'")
            name, path = data["name"], data["path"]
        else:
            name, sep, path = text.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {item!r} is not NAME=PATH (or JSON with "
                                 "'name' and 'path')")
        if any(lora.lora_name == name for lora in loras):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        loras.append(LoRARequest(name, len(loras) + 1, path))
    return loras


def check_lora_modules(engine: Any, loras: Sequence[LoRARequest], names: Sequence[str]
                       ) -> dict[str, LoRARequest]:
    """The adapters by name, each checked before the server starts: the engine must serve
    adapters, names must not be the base model's, each adapter must be readable (and, with
    the engine in this process, fit the model). ValueError otherwise."""
    if loras and not engine.config.lora.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    by_name: dict[str, LoRARequest] = {}
    for lora in loras:
        if lora.lora_name in names:
            raise ValueError(f"--lora-modules: {lora.lora_name!r} is the base model's name "
                             "(--served-model-name)")
        check = getattr(getattr(getattr(engine, "runner", None), "lora", None), "check", None)
        if check is not None:
            check(lora)
        else:  # the engine in its own process: its config here, the rest at the first request
            from mrv2.lora.adapter import read_adapter_config

            read_adapter_config(lora.lora_path, engine.config.lora.max_lora_rank)
        by_name[lora.lora_name] = lora
    return by_name


def model_cards(loras: Sequence[LoRARequest], parent: str, created: int, max_model_len: int
                ) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the adapters (vLLM's: ``root`` the adapter's path,
    ``parent`` the base model)."""
    return [{"id": lora.lora_name, "object": "model", "created": created, "owned_by": "mrv2",
             "root": lora.lora_path, "parent": parent, "max_model_len": max_model_len}
            for lora in loras]
