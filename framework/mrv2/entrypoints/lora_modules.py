"""``mrv2 serve --lora-modules``: the LoRA adapters a server offers under their own model
names, as vLLM's flag of that name (``NAME=PATH``, or JSON ``{"name": ..., "path": ...}``).

A request whose ``model`` names an adapter runs through it; ``/v1/models`` lists each adapter
with its base model as ``parent``. With ``MRV2_ALLOW_RUNTIME_LORA_UPDATING=1`` (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) ``POST /v1/load_lora_adapter`` (``{"lora_name",
"lora_path"}``) and ``POST /v1/unload_lora_adapter`` (``{"lora_name"}``) add and remove
adapters while the server runs; each loaded adapter gets an id never used before, so a name
loaded again from another path shares nothing (slots, prefix-cache blocks) with its past.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from mrv2.contract.lora import LoRARequest

#: ``1`` turns on the runtime load/unload routes.
RUNTIME_UPDATING_ENV = "MRV2_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating() -> bool:
    """Whether ``MRV2_ALLOW_RUNTIME_LORA_UPDATING`` allows the load/unload routes."""
    return os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true")


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


class LoRAModules:
    """The adapters a server offers, by name (see the module's docstring)."""

    def __init__(self, engine: Any, loras: Sequence[LoRARequest], names: Sequence[str]
                 ) -> None:
        """Check each of ``loras`` before the server starts: the engine must serve adapters,
        names must not be the base model's (``names``), each adapter must be readable (and,
        with the engine in this process, fit the model). ValueError otherwise."""
        if loras and not engine.config.lora.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        self.engine = engine
        self.names = list(names)
        self.by_name: dict[str, LoRARequest] = {}
        for lora in loras:
            self._check(lora)
            self.by_name[lora.lora_name] = lora
        self._ids = itertools.count(max((lora.lora_int_id for lora in loras), default=0) + 1)
        # loads run on worker threads: two of one name must not both pass the name's check
        self._loading = threading.Lock()

    def _check(self, lora: LoRARequest) -> None:
        if lora.lora_name in self.names:
            raise ValueError(f"{lora.lora_name!r} is the base model's name "
                             "(--served-model-name)")
        check = getattr(getattr(getattr(self.engine, "runner", None), "lora", None), "check",
                        None)
        if check is not None:
            check(lora)
        else:  # the engine in its own process: its config here, the rest at the first request
            from mrv2.lora.adapter import read_adapter_config

            read_adapter_config(lora.lora_path, self.engine.config.lora.max_lora_rank)

    def get(self, model: str | None) -> LoRARequest | None:
        """The adapter named ``model`` (None: the base model, or no such adapter)."""
        return self.by_name.get(model) if model is not None else None

    def load(self, name: Any, path: Any) -> LoRARequest:
        """Add adapter ``name`` from ``path`` (checked first); ValueError naming the field."""
        if not self.engine.config.lora.enable_lora:
            raise ValueError("lora_name: this server serves no adapters (start it with "
                             "--enable-lora)")
        if not isinstance(name, str) or not name:
            raise ValueError("lora_name: a non-empty string is required")
        if not isinstance(path, str) or not path:
            raise ValueError("lora_path: the adapter's directory is required")
        if name in self.names:
            raise ValueError(f"lora_name: {name!r} is the base model's name")
        with self._loading:
            if name in self.by_name:
                raise ValueError(f"lora_name: the adapter {name!r} is loaded already (unload "
                                 "it first)")
            lora = LoRARequest(name, next(self._ids), path)
            try:
                self._check(lora)
            except ValueError as error:
                raise ValueError(f"lora_path: {error}") from None
            self.by_name[name] = lora
        return lora

    def unload(self, name: Any) -> None:
        """Remove adapter ``name`` (requests running through it finish); KeyError if none."""
        if not isinstance(name, str) or name not in self.by_name:
            raise KeyError(name)
        del self.by_name[name]


def model_cards(loras: Sequence[LoRARequest], parent: str, created: int, max_model_len: int
                ) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the adapters (vLLM's: ``root`` the adapter's path,
    ``parent`` the base model)."""
    return [{"id": lora.lora_name, "object": "model", "created": created, "owned_by": "mrv2",
             "root": lora.lora_path, "parent": parent, "max_model_len": max_model_len}
            for lora in loras]
