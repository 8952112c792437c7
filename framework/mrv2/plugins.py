"""The plugin manager: entry-point loading, allow/block lists, and the registries.

Operators control loading with environment variables:

* ``MRV2_PLUGINS=qwen,llama``: allow-list; only these entry points load (``""``: none).
* ``MRV2_PLUGINS_BLOCK=glm``: never load these.
* ``MRV2_PLUGIN_AUTOLOAD=0``: load no entry point at all (tests register plugins by hand).

A plugin that fails to import, or whose registration hook raises, is skipped with a warning
naming it (its error is kept in :attr:`PluginManager.failed`): the other plugins' models still
load, and the "unknown architecture" error names the plugins that failed.

The core's own defaults (``mrv2.defaults``) always register, through the same hooks.
"""

from __future__ import annotations

import importlib.metadata as metadata
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pluggy

from mrv2 import hookspecs
from mrv2.registry import (
    DEFAULT_CACHE_KINDS,
    ModelEntry,
    NamedEntry,
    PluginError,
    Registries,
    _check_path,
    _check_unique,
)

__all__ = ["ENTRY_POINT_GROUP", "PluginError", "PluginInfo", "PluginManager",
           "get_plugin_manager", "plugins_registered_in_code"]

ENTRY_POINT_GROUP = "mrv2"

logger = logging.getLogger("mrv2.plugins")

@dataclass(frozen=True)
class PluginInfo:
    """What ``mrv2 plugins`` shows for one loaded plugin."""

    name: str
    version: str
    source: str
    hooks: tuple[str, ...]


class PluginManager:
    """pluggy's manager for project ``"mrv2"`` plus the registries built from it."""

    def __init__(
        self,
        *,
        autoload: bool | None = None,
        allow: Sequence[str] | None = None,
        block: Sequence[str] | None = None,
    ) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self._sources: dict[str, tuple[str, str]] = {}
        #: Each plugin skipped because it failed to import or to register: name -> why.
        self.failed: dict[str, str] = {}
        from mrv2 import defaults

        self.register(defaults, name="mrv2.defaults", source="built-in", version=_core_version())
        if autoload is None:
            autoload = os.environ.get("MRV2_PLUGIN_AUTOLOAD", "1") not in ("0", "false", "no")
        if allow is None and "MRV2_PLUGINS" in os.environ:
            allow = [n.strip() for n in os.environ["MRV2_PLUGINS"].split(",") if n.strip()]
        if block is None:
            block = [n.strip() for n in os.environ.get("MRV2_PLUGINS_BLOCK", "").split(",")]
        for name in block:
            if name:
                self.pm.set_blocked(name)
        if autoload:
            self._load_entry_points(allow)
        self._registries: Registries | None = None

    @property
    def hook(self) -> Any:
        """The hook relay: ``manager.hook.mrv2_make_sampler(...)``."""
        return self.pm.hook

    def register(
        self, plugin: object, name: str | None = None, *, source: str = "registered by code",
        version: str = "",
    ) -> None:
        """Register a plugin object; a misspelled hook name raises ``PluginError`` at once."""
        try:
            registered = self.pm.register(plugin, name=name)
            self.pm.check_pending()
        except pluggy.PluginValidationError as error:
            raise PluginError(f"plugin {name or plugin!r} is invalid: {error}") from error
        if registered is not None:
            self._sources[registered] = (source, version)
        self._registries = None

    def _load_entry_points(self, allow: Sequence[str] | None) -> None:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allow is not None and ep.name not in allow:
                continue
            if self.pm.is_blocked(ep.name) or self.pm.has_plugin(ep.name):
                continue
            dist = ep.dist
            version = dist.version if dist is not None else ""
            source = f"{dist.metadata['Name']} (entry point {ep.value})" if dist else ep.value
            try:
                plugin = ep.load()
            except Exception as error:  # (the other plugins still load: vLLM's behaviour)
                self._fail(ep.name, f"plugin {ep.name!r} ({source}) failed to load: "
                                    f"{type(error).__name__}: {error}")
                continue
            try:
                self.register(plugin, name=ep.name, source=source, version=version)
            except PluginError as error:  # (a misspelled hook: skipped as a failed import)
                if self.pm.has_plugin(ep.name):
                    self.pm.unregister(name=ep.name)
                self._fail(ep.name, f"{error} ({source})")

    def _fail(self, name: str, why: str) -> None:
        self.failed[name] = why
        logger.warning("%s; skipped (the other plugins still load; MRV2_PLUGINS_BLOCK=%s "
                       "silences this)", why, name)

    def list_plugins(self) -> list[PluginInfo]:
        """Name, version, source and implemented hooks of each registered plugin."""
        infos = []
        for name, plugin in self.pm.list_name_plugin():
            hooks = tuple(sorted(caller.name for caller in self.pm.get_hookcallers(plugin) or []))
            source, version = self._sources.get(name, ("registered by code", ""))
            infos.append(PluginInfo(name, version, source, hooks))
        return infos

    def registered_in_code(self) -> list[tuple[str, object]]:
        """Name and object of each plugin registered in code (not the core's defaults nor an
        entry point's): what a spawned process must be handed, as it loads only the others."""
        return [(name, plugin) for name, plugin in self.pm.list_name_plugin()
                if self._sources.get(name, ("registered by code", ""))[0] == "registered by code"]

    @property
    def registries(self) -> Registries:
        """The registries, built on first use by calling every registration hook once."""
        if self._registries is None:
            self._registries = self._collect()
        return self._registries

    def _collect(self) -> Registries:
        reg = Registries()
        failed = dict(self.failed)

        def each(hook_name: str, make: Callable[[str], Callable[..., None]]) -> None:
            # Call implementations one by one so every entry records which plugin made it.
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin_name in failed:
                    continue
                try:
                    impl.function(register=make(impl.plugin_name))
                except PluginError:
                    raise
                except Exception as error:
                    failed[impl.plugin_name] = (
                        f"plugin {impl.plugin_name!r} failed in {hook_name}: "
                        f"{type(error).__name__}: {error}")
                    self._fail(impl.plugin_name, failed[impl.plugin_name])
                    for table in (reg.models, reg.attention_backends, reg.speculators,
                                  reg.logits_processors):  # (what it registered before)
                        for key in [k for k, e in table.items() if e.plugin == impl.plugin_name]:
                            del table[key]

        def models(plugin: str) -> Callable[..., None]:
            def register(architecture: str, model: str, model_state: str | None = None,
                         input_processor: str | None = None) -> None:
                _check_path(plugin, model)
                for path in (model_state, input_processor):
                    if path is not None:
                        _check_path(plugin, path)
                _check_unique(reg.models, architecture, plugin, "architecture")
                reg.models[architecture] = ModelEntry(architecture, model, model_state, plugin,
                                                      input_processor)

            return register

        def named(table: dict[str, NamedEntry], kind: str) -> Callable[[str], Any]:
            def bind(plugin: str) -> Callable[..., None]:
                def register(name: str, target: str, devices: Sequence[str] = ()) -> None:
                    _check_path(plugin, target)
                    _check_unique(table, name, plugin, kind)
                    table[name] = NamedEntry(name, target, plugin, tuple(devices), kind=kind)

                return register

            return bind

        def backends(plugin: str) -> Callable[..., None]:
            def register(name: str, backend: str, devices: Sequence[str] = ("cuda",),
                         cache_kinds: Sequence[str] = DEFAULT_CACHE_KINDS) -> None:
                _check_path(plugin, backend)
                _check_unique(reg.attention_backends, name, plugin, "backend")
                reg.attention_backends[name] = NamedEntry(name, backend, plugin, tuple(devices),
                                                          tuple(cache_kinds), kind="backend")

            return register

        each("mrv2_register_models", models)
        each("mrv2_register_attention_backends", backends)
        each("mrv2_register_speculators", named(reg.speculators, "speculator"))
        each("mrv2_register_logits_processors", named(reg.logits_processors, "processor"))
        for name in failed:  # (nor do its other hooks run)
            if self.pm.has_plugin(name):
                self.pm.unregister(name=name)
        reg.failed_plugins = failed
        return reg


def _core_version() -> str:
    try:
        return metadata.version("mrv2")
    except metadata.PackageNotFoundError:
        return "dev"


_DEFAULT_MANAGER: PluginManager | None = None


def get_plugin_manager() -> PluginManager:
    """The process-wide manager, built on first use from the environment's settings."""
    global _DEFAULT_MANAGER
    if _DEFAULT_MANAGER is None:
        _DEFAULT_MANAGER = PluginManager()
    return _DEFAULT_MANAGER


def plugins_registered_in_code() -> list[tuple[str, object]]:
    """:meth:`PluginManager.registered_in_code` of the process-wide manager; none (and no
    entry point loaded here) while it has not been built."""
    return [] if _DEFAULT_MANAGER is None else _DEFAULT_MANAGER.registered_in_code()
