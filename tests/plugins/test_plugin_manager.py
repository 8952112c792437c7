"""The plugin system: throwaway plugins, fake and real entry points, allow/block lists."""

from __future__ import annotations

import importlib.metadata as metadata
import inspect
import re
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from mrv2 import hookimpl, hookspecs
from mrv2.plugins import PluginError, PluginManager
from mrv2.registry import import_object

TESTS_DIR = Path(__file__).parent


def _plugin(name: str, **hooks: Callable[..., object]) -> types.ModuleType:
    module = types.ModuleType(name)
    for hook_name, function in hooks.items():
        setattr(module, hook_name, hookimpl(function))
    return module


def test_core_defaults_register_through_hooks() -> None:
    manager = PluginManager(autoload=False)
    names = [info.name for info in manager.list_plugins()]
    assert names == ["mrv2.defaults"]
    backends = manager.registries.attention_backends
    assert set(backends) == {"triton", "torch"}
    assert manager.registries.attention_backend_for("cpu", "paged_kv").name == "torch"
    assert manager.registries.attention_backend_for("cuda", "paged_kv").name == "triton"
    assert manager.registries.attention_backend_for("cuda", "paged_kv", "torch").name == "torch"
    with pytest.raises(ValueError, match="no attention backend registered for KV cache kind "
                                         "'latent' on device 'cpu'"):
        manager.registries.attention_backend_for("cpu", "latent")
    assert set(manager.registries.speculators) == {"draft_model", "ngram"}
    assert manager.registries.models == {}


def test_known_packages_register_what_they_advertise() -> None:
    from mrv2.registry import KNOWN_PACKAGES

    manager = PluginManager(autoload=True, allow=None, block=[])
    for architecture, package in KNOWN_PACKAGES.items():
        entry = manager.registries.models[architecture]
        dist = next(info.source for info in manager.list_plugins() if info.name == entry.plugin)
        assert dist.startswith(package), (architecture, package, dist)


def test_throwaway_plugin_registers_a_model() -> None:
    def mrv2_register_models(register: Callable[..., None]) -> None:
        register("ToyForCausalLM", "toy.model:Toy", model_state="toy.state:ToyState")

    manager = PluginManager(autoload=False)
    manager.register(_plugin("toy", mrv2_register_models=mrv2_register_models), name="toy")
    entry = manager.registries.resolve_model(["Nope", "ToyForCausalLM"])
    assert (entry.model, entry.model_state, entry.plugin) == (
        "toy.model:Toy", "toy.state:ToyState", "toy")


def test_misspelled_hook_fails_loudly() -> None:
    manager = PluginManager(autoload=False)
    bad = _plugin("bad", mrv2_register_modles=lambda register: None)
    with pytest.raises(PluginError, match="mrv2_register_modles"):
        manager.register(bad, name="bad")


def test_duplicate_and_malformed_registrations_name_the_plugins() -> None:
    def one(register: Callable[..., None]) -> None:
        register("XForCausalLM", "a.b:X")

    manager = PluginManager(autoload=False)
    manager.register(_plugin("first", mrv2_register_models=one), name="first")
    manager.register(_plugin("second", mrv2_register_models=one), name="second")
    with pytest.raises(PluginError, match="'first' and by 'second'"):
        _ = manager.registries

    manager = PluginManager(autoload=False)
    manager.register(_plugin("lazy", mrv2_register_models=lambda register: register(
        "Y", "no_colon_here")), name="lazy")
    with pytest.raises(PluginError, match="'lazy' registered 'no_colon_here'"):
        _ = manager.registries


def test_unknown_architecture_lists_registered_and_hint() -> None:
    manager = PluginManager(autoload=False)
    with pytest.raises(ValueError, match="pip install mrv2-plugin-qwen"):
        manager.registries.resolve_model(["Qwen3ForCausalLM"])
    with pytest.raises(ValueError, match="write one"):
        manager.registries.resolve_model(["MyPrivateLM"])


class _FakeEntryPoint:
    def __init__(self, name: str, load: Callable[[], object]) -> None:
        self.name, self.value, self.dist = name, f"fake_{name}:plugin", None
        self._load = load

    def load(self) -> object:
        return self._load()


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, eps: list[_FakeEntryPoint]) -> None:
    monkeypatch.setattr(metadata, "entry_points", lambda group: eps if group == "mrv2" else [])


def _model_plugin(arch: str) -> types.ModuleType:
    return _plugin(arch, mrv2_register_models=lambda register: register(arch, f"m.{arch}:M"))


def test_fake_entry_points_allow_and_block(monkeypatch: pytest.MonkeyPatch) -> None:
    eps = [_FakeEntryPoint("alpha", lambda: _model_plugin("A")),
           _FakeEntryPoint("beta", lambda: _model_plugin("B"))]
    _fake_entry_points(monkeypatch, eps)
    monkeypatch.delenv("MRV2_PLUGINS", raising=False)
    assert set(PluginManager(autoload=True).registries.models) == {"A", "B"}
    assert set(PluginManager(autoload=True, allow=["beta"]).registries.models) == {"B"}
    assert set(PluginManager(autoload=True, block=["beta"]).registries.models) == {"A"}
    assert PluginManager(autoload=False).registries.models == {}
    monkeypatch.setenv("MRV2_PLUGINS", "alpha")
    assert set(PluginManager().registries.models) == {"A"}
    monkeypatch.setenv("MRV2_PLUGINS_BLOCK", "alpha")
    assert PluginManager().registries.models == {}
    monkeypatch.delenv("MRV2_PLUGINS")
    monkeypatch.delenv("MRV2_PLUGINS_BLOCK")
    monkeypatch.setenv("MRV2_PLUGIN_AUTOLOAD", "0")
    assert PluginManager().registries.models == {}


def test_broken_plugin_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def explode() -> object:
        raise ImportError("No module named 'torch_npu'")

    _fake_entry_points(monkeypatch, [_FakeEntryPoint("npu", explode)])
    with pytest.raises(PluginError, match=r"plugin 'npu'.*torch_npu.*MRV2_PLUGINS_BLOCK=npu"):
        PluginManager(autoload=True, allow=None, block=[])

    def failing(register: Callable[..., None]) -> None:
        raise KeyError("oops")

    manager = PluginManager(autoload=False)
    manager.register(_plugin("flaky", mrv2_register_models=failing), name="flaky")
    with pytest.raises(PluginError, match="'flaky' failed in mrv2_register_models"):
        _ = manager.registries


def test_installed_plugins_found_through_real_entry_points() -> None:
    names = {ep.name: ep.value for ep in metadata.entry_points(group="mrv2")}
    assert names.get("qwen") == "mrv2_qwen.plugin"
    assert names.get("llama") == "mrv2_llama.plugin"
    manager = PluginManager(autoload=True, allow=None, block=[])
    models = manager.registries.models
    assert models["Qwen3ForCausalLM"].plugin == "qwen"
    assert models["LlamaForCausalLM"].plugin == "llama"
    infos = {info.name: info for info in manager.list_plugins()}
    assert infos["qwen"].version == metadata.version("mrv2-plugin-qwen")
    assert "mrv2-plugin-qwen" in infos["qwen"].source
    for entry in models.values():  # the lazy paths really import
        assert isinstance(import_object(entry.model), type)


def test_cli_lists_plugins(capsys: pytest.CaptureFixture[str]) -> None:
    from mrv2.entrypoints.cli import main

    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^qwen \S+\s+\[mrv2-plugin-qwen", out, re.M)
    assert re.search(r"^llama \S+\s+\[mrv2-contrib-llama", out, re.M)
    assert "Qwen3ForCausalLM" in out and "LlamaForCausalLM" in out


def _spec_names() -> list[str]:
    return [name for name, obj in inspect.getmembers(hookspecs, inspect.isfunction)
            if name.startswith("mrv2_")]


def test_every_hook_spec_is_documented() -> None:
    for name in _spec_names():
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        assert len(doc) > 80 and "Called" in doc, f"{name} needs a docstring saying when it runs"


def test_every_hook_spec_has_a_test() -> None:
    tested = "\n".join(p.read_text() for p in TESTS_DIR.glob("test_*.py"))
    untested = [name for name in _spec_names() if f"def {name}(" not in tested]
    assert not untested, f"hooks without a test implementing them: {untested}"
