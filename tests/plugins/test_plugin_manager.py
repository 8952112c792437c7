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
    assert list(backends) == ["triton", "torch", "mla"]
    assert manager.registries.attention_backend_for("cpu", "paged_kv").name == "torch"
    assert manager.registries.attention_backend_for("cuda", "paged_kv").name == "triton"
    assert manager.registries.attention_backend_for("cuda", "paged_kv", "torch").name == "torch"
    # multi-head latent attention's cache is the core's, whichever family uses it
    for device in ("cpu", "cuda"):
        entry = manager.registries.attention_backend_for(device, "latent")
        assert (entry.name, entry.plugin) == ("mla", "mrv2.defaults")
    assert entry.load().__module__ == "mrv2.attention.mla_backend"
    with pytest.raises(ValueError, match="no attention backend registered for KV cache kind "
                                         "'toy' on device 'cpu' \\(kinds with a backend: "
                                         "latent, paged_kv\\)"):
        manager.registries.attention_backend_for("cpu", "toy")
    assert set(manager.registries.speculators) == {"draft_model", "ngram"}
    assert manager.registries.models == {}


def test_a_models_own_backend_serves_its_cache_kind_before_the_cores() -> None:
    """A plugin that brings a model and a backend for a kind the core serves too (``"latent"``,
    the core's ``mla``) gets its own for its model; other models keep the core's; the
    ``attention_backend`` setting still wins."""

    def backends(register: Callable[..., None]) -> None:
        register("own", "pkg:OwnLatent", devices=("cpu",), cache_kinds=("latent",))

    manager = PluginManager(autoload=False)
    manager.register(_plugin("mine", mrv2_register_attention_backends=backends), name="mine")
    registries = manager.registries
    assert list(registries.attention_backends) == ["triton", "torch", "mla", "own"]
    assert registries.attention_backend_for("cpu", "latent", owner="mine").name == "own"
    assert registries.attention_backend_for("cpu", "latent", owner="other").name == "mla"
    assert registries.attention_backend_for("cpu", "latent").name == "mla"
    assert registries.attention_backend_for("cuda", "latent", owner="mine").name == "mla"
    assert registries.attention_backend_for("cpu", "latent", "mla", owner="mine").name == "mla"
    assert registries.attention_backend_for("cpu", "paged_kv", owner="mine").name == "torch"


def test_known_packages_register_what_they_advertise() -> None:
    from mrv2.registry import KNOWN_PACKAGES

    manager = PluginManager(autoload=True, allow=None, block=[])
    for architecture, package in KNOWN_PACKAGES.items():
        entry = manager.registries.models[architecture]
        dist = next(info.source for info in manager.list_plugins() if info.name == entry.plugin)
        assert dist.startswith(package), (architecture, package, dist)


def test_every_bundled_architecture_has_its_install_hint() -> None:
    """The "unknown architecture" error names the package to install for every architecture a
    bundled package registers (CONTRIBUTING: a bundled plugin joins ``KNOWN_PACKAGES``)."""
    from mrv2.registry import KNOWN_PACKAGES

    manager = PluginManager(autoload=True, allow=None, block=[])
    bundled = {info.name for info in manager.list_plugins()
               if info.source.startswith(("mrv2-plugin-", "mrv2-contrib-"))}
    registered = {arch for arch, entry in manager.registries.models.items()
                  if entry.plugin in bundled}
    assert registered - set(KNOWN_PACKAGES) == set()
    empty = PluginManager(autoload=False).registries
    with pytest.raises(ValueError, match=r"pip install mrv2-plugin-phi\b"):
        empty.resolve_model(["Phi3ForCausalLM"])


def test_every_bundled_multimodal_model_names_its_media_encoders() -> None:
    """A model that takes media (an input processor) names the submodules that run only on
    media items (``CausalLM.media_encoders``): the byte floor leaves them out of a text step's
    bytes, and a name that is not one of the model's attributes would leave them in. A
    processor that refuses all media (``InputProcessor.text_only``) has none to name."""
    manager = PluginManager(autoload=True, allow=None, block=[])
    media = {arch: entry for arch, entry in manager.registries.models.items()
             if entry.input_processor is not None
             and not entry.load("input_processor").text_only}
    assert len(media) >= 10
    for arch, entry in media.items():
        model_cls = entry.load("model")
        names = getattr(model_cls, "media_encoders", ())
        assert names, arch
        init = "\n".join(inspect.getsource(c) for c in model_cls.__mro__
                         if c.__module__.startswith("mrv2_") and "__init__" in vars(c))
        assert all(f"self.{name} = " in init for name in names), (arch, names)


def test_plugins_that_load_image_processors_depend_on_pillow() -> None:
    """transformers' image processors need pillow (its PIL backend where torchvision is absent,
    and the torchvision one too): a family whose input processor loads one declares it, or an
    engine for its vision checkpoints fails at start where pillow is not installed."""
    import tomllib

    root = TESTS_DIR.parents[1]
    users = []
    for pyproject in sorted(root.glob("plugins/*/pyproject.toml")):
        sources = "\n".join(p.read_text() for p in pyproject.parent.glob("mrv2_*/*.py"))
        if "load_images(" in sources or "load_image_processor(" in sources:
            users.append(pyproject.parent.name)
            deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
            assert "pillow" in deps, pyproject
    assert {"llava", "qwen_vl"} <= set(users)


def test_unknown_speculative_method_names_its_package() -> None:
    import torch

    from mrv2 import EngineConfig
    from mrv2.registry import KNOWN_SPECULATOR_PACKAGES

    everything = PluginManager(autoload=True, allow=None, block=[]).registries.speculators
    for method, package in KNOWN_SPECULATOR_PACKAGES.items():
        dist = metadata.distribution(package)
        assert everything[method].plugin in {ep.name for ep in dist.entry_points}
    manager = PluginManager(autoload=False)
    config = EngineConfig.from_kwargs(speculative_config={"method": "mtp",
                                                          "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match=r"unknown speculative method 'mtp'; registered: "
                                         r"draft_model, ngram \('mtp' is provided by "
                                         r"'mrv2-plugin-mtp': pip install mrv2-plugin-mtp\)"):
        manager.hook.mrv2_make_speculator(config=config, registries=manager.registries,
                                          model_state=None, device=torch.device("cpu"))


def test_code_registered_plugin_refused_with_spawned_tensor_parallel_workers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Spawned tensor-parallel workers load plugins from entry points only: a plugin registered
    in code on the process-wide manager is refused before any worker starts (the workers would
    fail on an architecture rank 0 knows)."""
    from mrv2 import EngineConfig
    from mrv2.executor import make_runner

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    manager = PluginManager(autoload=False)
    manager.register(_model_plugin("InHouseForCausalLM"), name="in-house")
    monkeypatch.setattr("mrv2.plugins._DEFAULT_MANAGER", manager)
    config = EngineConfig.from_kwargs(model=str(TESTS_DIR), tensor_parallel_size=2,
                                      device="cpu")
    with pytest.raises(ValueError, match=r"registered in code \('in-house'\).*entry point"):
        make_runner(config)


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


def test_registered_path_that_does_not_import_names_plugin_and_architecture(
        tmp_path: Path) -> None:
    """A model / ModelState path that does not import fails naming the plugin, the architecture
    and the path, not with a bare ``No module named ...``."""
    import json

    from mrv2 import LLM
    from mrv2.testing import make_tiny_checkpoint

    model_dir = make_tiny_checkpoint(tmp_path, "LlamaForCausalLM")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["InHouseForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(config))
    for model, state, bad in [("no_such_pkg.model:M", None, "model 'no_such_pkg.model:M'"),
                              ("mrv2_llama.model:LlamaForCausalLM", "mrv2_llama.state:Nope",
                               "model_state 'mrv2_llama.state:Nope'")]:
        def register_models(register: Callable[..., None], model: str = model,
                            state: str | None = state) -> None:
            register("InHouseForCausalLM", model, model_state=state)

        manager = PluginManager(autoload=False)
        manager.register(_plugin("inhouse", mrv2_register_models=register_models),
                         name="inhouse")
        with pytest.raises(PluginError, match=rf"plugin 'inhouse' registered "
                                              rf"'InHouseForCausalLM' with {re.escape(bad)}"):
            LLM(str(model_dir), device="cpu", max_model_len=64, load_format="dummy",
                plugins=manager)

    manager = PluginManager(autoload=False)
    manager.register(_plugin("procs", mrv2_register_logits_processors=lambda register: register(
        "gone", "no_such_pkg.procs:P")), name="procs")
    with pytest.raises(PluginError, match=r"plugin 'procs' registered processor 'gone' with "
                                          r"'no_such_pkg.procs:P'.*no_such_pkg"):
        manager.registries.logits_processors["gone"].load()


def test_unknown_architecture_lists_registered_and_hint() -> None:
    manager = PluginManager(autoload=False)
    with pytest.raises(ValueError, match="pip install mrv2-plugin-qwen"):
        manager.registries.resolve_model(["Qwen3ForCausalLM"])
    with pytest.raises(ValueError, match="write one"):
        manager.registries.resolve_model(["MyPrivateLM"])
    with pytest.raises(ValueError, match=r"Qwen3ForSequenceClassification is provided by "
                                         r"'mrv2-plugin-qwen' \(pip install mrv2-plugin-qwen\)"):
        manager.registries.resolve_model(["Qwen3ForSequenceClassification"])


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


def test_broken_plugin_is_named_and_others_still_load(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A plugin that fails to import, or whose registration raises, is skipped with a warning
    naming it; the other plugins' models still resolve, and an architecture no loaded plugin
    registers names the failed plugins (it may be theirs)."""
    def explode() -> object:
        raise ImportError("No module named 'torch_npu'")

    def failing(register: Callable[..., None]) -> None:
        register("HalfForCausalLM", "m.half:M")
        raise KeyError("oops")

    _fake_entry_points(monkeypatch, [
        _FakeEntryPoint("npu", explode), _FakeEntryPoint("alpha", lambda: _model_plugin("A")),
        _FakeEntryPoint("flaky", lambda: _plugin("flaky", mrv2_register_models=failing)),
        _FakeEntryPoint("typo", lambda: _plugin("typo", mrv2_register_modles=failing)),
        _FakeEntryPoint("half", lambda: _model_plugin("HalfForCausalLM"))])
    with caplog.at_level("WARNING", logger="mrv2.plugins"):
        manager = PluginManager(autoload=True, allow=None, block=[])
        registries = manager.registries
    assert re.search(r"plugin 'npu'.*torch_npu.*MRV2_PLUGINS_BLOCK=npu", caplog.text)
    assert "'flaky' failed in mrv2_register_models: KeyError" in caplog.text
    assert "plugin 'typo' is invalid" in caplog.text and "mrv2_register_modles" in caplog.text
    assert registries.resolve_model(["A"]).plugin == "alpha"
    # (nothing of the failed registration stays, nor clashes with a later plugin's)
    assert set(registries.models) == {"A", "HalfForCausalLM"}
    assert registries.models["HalfForCausalLM"].plugin == "half"
    assert [info.name for info in manager.list_plugins()] == ["mrv2.defaults", "alpha", "half"]
    with pytest.raises(ValueError, match=r"unknown model architecture \['NpuForCausalLM'\].*"
                                         r"failed to load.*'npu'.*torch_npu.*'flaky'.*oops"):
        registries.resolve_model(["NpuForCausalLM"])

    monkeypatch.setattr("mrv2.plugins._DEFAULT_MANAGER", manager)
    from mrv2.entrypoints.cli import main

    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^failed to load:\n    npu: .*torch_npu", out, re.M)


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
