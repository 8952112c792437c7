"""The registries: what plugins registered, by name, as lazy ``"module:Class"`` paths.

Built by :class:`mrv2.plugins.PluginManager` from the registration hooks; read by the runner and
the model loader. This module imports nothing of mrv2, so every layer may use it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# Which package registers an architecture, for the "unknown architecture" error when that package
# is not installed. Only packages that exist and register the name (a test checks the bundled
# ones); a family package adds its line when it ships.
KNOWN_PACKAGES: dict[str, str] = {
    "Qwen2ForCausalLM": "mrv2-plugin-qwen",
    "Qwen3ForCausalLM": "mrv2-plugin-qwen",
    "Qwen3MoeForCausalLM": "mrv2-plugin-qwen",
    "Qwen2MoeForCausalLM": "mrv2-plugin-qwen",
    "Qwen3NextForCausalLM": "mrv2-plugin-qwen",
    "Qwen3_5ForCausalLM": "mrv2-plugin-qwen",
    "Qwen3_5MoeForCausalLM": "mrv2-plugin-qwen",
    "Qwen3_5ForConditionalGeneration": "mrv2-plugin-qwen",
    "Qwen3_5MoeForConditionalGeneration": "mrv2-plugin-qwen",
    "Glm4MoeForCausalLM": "mrv2-plugin-glm",
    "GlmForCausalLM": "mrv2-plugin-glm",
    "Glm4ForCausalLM": "mrv2-plugin-glm",
    "Glm4MoeLiteForCausalLM": "mrv2-plugin-glm",
    "SolarOpenForCausalLM": "mrv2-plugin-glm",
    "Glm4vForConditionalGeneration": "mrv2-plugin-glm",
    "Glm4vMoeForConditionalGeneration": "mrv2-plugin-glm",
    "GlmMoeDsaForCausalLM": "mrv2-plugin-glm",
    "DeepseekV2ForCausalLM": "mrv2-plugin-deepseek",
    "DeepseekV3ForCausalLM": "mrv2-plugin-deepseek",
    "DeepseekV32ForCausalLM": "mrv2-plugin-deepseek",
    "KimiLinearForCausalLM": "mrv2-plugin-kimi",
    "Step3p7ForConditionalGeneration": "mrv2-plugin-step",
    "Dots1ForCausalLM": "mrv2-plugin-deepseek",
    "AfmoeForCausalLM": "mrv2-plugin-deepseek",
    "YoutuForCausalLM": "mrv2-plugin-deepseek",
    "LongcatFlashForCausalLM": "mrv2-plugin-deepseek",
    "Qwen2_5_VLForConditionalGeneration": "mrv2-plugin-qwen-vl",
    "Qwen3VLForConditionalGeneration": "mrv2-plugin-qwen-vl",
    "Gemma3ForConditionalGeneration": "mrv2-plugin-gemma",
    "LlavaForConditionalGeneration": "mrv2-plugin-llava",
    "LlavaNextForConditionalGeneration": "mrv2-plugin-llava",
    "Idefics3ForConditionalGeneration": "mrv2-plugin-idefics3",
    "SmolVLMForConditionalGeneration": "mrv2-plugin-idefics3",
    "NemotronHForCausalLM": "mrv2-plugin-nemotron-h",
    "NemotronForCausalLM": "mrv2-plugin-nemotron-h",
    "GraniteMoeHybridForCausalLM": "mrv2-plugin-granite-hybrid",
    "BambaForCausalLM": "mrv2-plugin-granite-hybrid",
    "GraniteMoeForCausalLM": "mrv2-plugin-granite-hybrid",
    "GraniteMoeSharedForCausalLM": "mrv2-plugin-granite-hybrid",
    "GraniteMoeSWAForCausalLM": "mrv2-plugin-granite-hybrid",
    "FalconH1ForCausalLM": "mrv2-plugin-falcon-h1",
    "Mamba2ForCausalLM": "mrv2-plugin-mamba",
    "MambaForCausalLM": "mrv2-plugin-mamba",
    "FalconMambaForCausalLM": "mrv2-plugin-mamba",
    "JambaForCausalLM": "mrv2-plugin-mamba",
    "Zamba2ForCausalLM": "mrv2-plugin-mamba",
    "Llama4ForCausalLM": "mrv2-plugin-llama4",
    "Llama4ForConditionalGeneration": "mrv2-plugin-llama4",
    "HunYuanDenseV1ForCausalLM": "mrv2-plugin-hunyuan",
    "HunYuanMoEV1ForCausalLM": "mrv2-plugin-hunyuan",
    "Qwen2VLForConditionalGeneration": "mrv2-plugin-qwen-vl",
    "Qwen3VLMoeForConditionalGeneration": "mrv2-plugin-qwen-vl",
    "Gemma2ForCausalLM": "mrv2-plugin-gemma",
    "Gemma3ForCausalLM": "mrv2-plugin-gemma",
    "Gemma3nForCausalLM": "mrv2-plugin-gemma",
    "Gemma3nForConditionalGeneration": "mrv2-plugin-gemma",
    "Gemma4ForCausalLM": "mrv2-plugin-gemma",
    "Gemma4ForConditionalGeneration": "mrv2-plugin-gemma",
    "Mistral3ForConditionalGeneration": "mrv2-plugin-mistral3",
    "InternVLForConditionalGeneration": "mrv2-plugin-internvl",
    "PhiForCausalLM": "mrv2-plugin-phi",
    "Phi3ForCausalLM": "mrv2-plugin-phi",
    "PhiMoEForCausalLM": "mrv2-plugin-phi",
    "PhimoeForCausalLM": "mrv2-plugin-phi",
    "OlmoForCausalLM": "mrv2-plugin-olmo",
    "Olmo2ForCausalLM": "mrv2-plugin-olmo",
    "Olmo3ForCausalLM": "mrv2-plugin-olmo",
    "OlmoeForCausalLM": "mrv2-plugin-olmo",
    "FlexOlmoForCausalLM": "mrv2-plugin-olmo",
    "OlmoHybridForCausalLM": "mrv2-plugin-olmo",
    "MiniMaxM2ForCausalLM": "mrv2-plugin-minimax",
    "MiniMaxForCausalLM": "mrv2-plugin-minimax",
    "MiniMaxText01ForCausalLM": "mrv2-plugin-minimax",
    "MiniMaxM1ForCausalLM": "mrv2-plugin-minimax",
    "Exaone4ForCausalLM": "mrv2-plugin-exaone",
    "ExaoneMoeForCausalLM": "mrv2-plugin-exaone",
    "Ernie4_5ForCausalLM": "mrv2-plugin-ernie",
    "Ernie4_5_MoeForCausalLM": "mrv2-plugin-ernie",
    "GptOssForCausalLM": "mrv2-plugin-gpt-oss",
    "CohereForCausalLM": "mrv2-plugin-cohere",
    "Cohere2ForCausalLM": "mrv2-plugin-cohere",
    "Cohere2MoeForCausalLM": "mrv2-plugin-cohere",
    "AyaVisionForConditionalGeneration": "mrv2-plugin-cohere",
    "Cohere2VisionForConditionalGeneration": "mrv2-plugin-cohere",
    "Lfm2ForCausalLM": "mrv2-plugin-lfm2",
    "Lfm2MoeForCausalLM": "mrv2-plugin-lfm2",
    "Lfm2VlForConditionalGeneration": "mrv2-plugin-lfm2",
    "GPTNeoXForCausalLM": "mrv2-plugin-neox",
    "StableLmForCausalLM": "mrv2-plugin-neox",
    "GPTJForCausalLM": "mrv2-plugin-neox",
    "Starcoder2ForCausalLM": "mrv2-plugin-starcoder",
    "GPTBigCodeForCausalLM": "mrv2-plugin-starcoder",
    "LlamaForCausalLM": "mrv2-contrib-llama",
    "MistralForCausalLM": "mrv2-contrib-llama",
    "MixtralForCausalLM": "mrv2-contrib-llama",
    "SmolLM3ForCausalLM": "mrv2-contrib-llama",
    "GraniteForCausalLM": "mrv2-contrib-llama",
    "GraniteSWAForCausalLM": "mrv2-contrib-llama",
    "SeedOssForCausalLM": "mrv2-contrib-llama",
    "MinistralForCausalLM": "mrv2-contrib-llama",
    "Ministral3ForCausalLM": "mrv2-contrib-llama",
    "ArceeForCausalLM": "mrv2-contrib-llama",
    "ApertusForCausalLM": "mrv2-contrib-llama",
    "HeliumForCausalLM": "mrv2-contrib-llama",
    "Jais2ForCausalLM": "mrv2-contrib-llama",
    "NanoChatForCausalLM": "mrv2-contrib-llama",
}

#: Which package registers a speculative method, for the "unknown speculative method" error.
KNOWN_SPECULATOR_PACKAGES: dict[str, str] = {
    "eagle": "mrv2-plugin-eagle",
    "eagle3": "mrv2-plugin-eagle",
    "mtp": "mrv2-plugin-mtp",
}

#: The cache kind a backend serves when its registration names none (paged K/V per kv-head).
DEFAULT_CACHE_KINDS = ("paged_kv",)


class PluginError(RuntimeError):
    """A plugin failed to load or registered something invalid; the message names it."""


def import_object(path: str) -> Any:
    """Import ``"package.module:Attr"`` (the lazy form every registry stores)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:Attribute', got {path!r}")
    module = importlib.import_module(module_name)
    try:
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
    except AttributeError as error:
        raise ImportError(f"{module_name!r} has no attribute {attr!r}") from error
    return obj


def import_registered(path: str, plugin: str, what: str) -> Any:
    """:func:`import_object` of a path ``plugin`` registered as ``what``; a path that does not
    import raises :class:`PluginError` naming the plugin, what it registered and the path."""
    try:
        return import_object(path)
    except Exception as error:
        raise PluginError(
            f"plugin {plugin!r} registered {what} {path!r}, which does not import: "
            f"{type(error).__name__}: {error}"
        ) from error


@dataclass(frozen=True)
class ModelEntry:
    """A registered architecture: lazy model and ModelState paths, and who registered it."""

    architecture: str
    model: str
    model_state: str | None
    plugin: str
    input_processor: str | None = None
    """Lazy path of the family's :class:`~mrv2.contract.input_processor.InputProcessor`
    (multimodal prompts), or None: the model takes text only."""

    def load(self, part: str = "model") -> Any:
        """The class registered as ``part`` (``"model"``, ``"model_state"`` or
        ``"input_processor"``), imported; :class:`PluginError` naming the plugin and the
        architecture where its path does not import."""
        path = getattr(self, part)
        return import_registered(path, self.plugin, f"{self.architecture!r} with {part}")


@dataclass(frozen=True)
class NamedEntry:
    """A registered backend, speculator or logits processor."""

    name: str
    target: str
    plugin: str
    devices: tuple[str, ...] = ()
    cache_kinds: tuple[str, ...] = ()
    """Attention backends only: the :class:`~mrv2.contract.kv_cache.KVCacheSpec` kinds served."""
    kind: str = "name"
    """What was registered (``"backend"``, ``"speculator"``, ``"processor"``), for errors."""

    def load(self) -> Any:
        """The registered class, imported; :class:`PluginError` naming the plugin and the name
        where its path does not import."""
        return import_registered(self.target, self.plugin, f"{self.kind} {self.name!r} with")


@dataclass
class Registries:
    """Everything the registration hooks handed over, keyed by name."""

    models: dict[str, ModelEntry] = field(default_factory=dict)
    attention_backends: dict[str, NamedEntry] = field(default_factory=dict)
    speculators: dict[str, NamedEntry] = field(default_factory=dict)
    logits_processors: dict[str, NamedEntry] = field(default_factory=dict)
    failed_plugins: dict[str, str] = field(default_factory=dict)
    """Plugins skipped because they failed to import or to register: name -> why."""

    def resolve_model(self, architectures: Sequence[str]) -> ModelEntry:
        """The entry of the first registered name in ``architectures``, or a helpful error.
        An unregistered ``XForSequenceClassification`` or ``XForTokenClassification`` resolves
        to its family's registered ``XForCausalLM`` (the loader adds the classifier's head:
        :mod:`mrv2.model_loader.classification`)."""
        for name in architectures:
            if name in self.models:
                return self.models[name]
            for suffix in ("ForSequenceClassification", "ForTokenClassification"):
                causal = name.removesuffix(suffix) + "ForCausalLM"
                if name.endswith(suffix) and causal in self.models:
                    return self.models[causal]
        hints = []
        for name in architectures:  # (a classifier: its causal LM's package)
            known = next((n for n in (name, name.removesuffix("ForSequenceClassification")
                                      + "ForCausalLM", name.removesuffix("ForTokenClassification")
                                      + "ForCausalLM") if n in KNOWN_PACKAGES), None)
            if known is not None:
                package = KNOWN_PACKAGES[known]
                hints.append(f"{name} is provided by '{package}' (pip install {package})")
        registered = ", ".join(sorted(self.models)) or "none"
        message = (
            f"unknown model architecture {list(architectures)}; registered architectures: "
            f"{registered}."
        )
        if self.failed_plugins:
            message += (" These plugins failed to load, and may register it: "
                        + "; ".join(self.failed_plugins.values()) + ".")
        if hints:
            message += " " + "; ".join(hints) + "."
        elif not self.failed_plugins:
            message += " Install a plugin that registers it, or write one (see CONTRIBUTING.md)."
        raise ValueError(message)

    def attention_backend_for(
        self, device_type: str, cache_kind: str, name: str | None = None,
        owner: str | None = None,
    ) -> NamedEntry:
        """The backend for layers of ``cache_kind`` on ``device_type``.

        ``name`` (the ``attention_backend`` setting) wins where it serves ``cache_kind``; else
        the first backend that plugin ``owner`` (the one that registered the model) registered
        for that device and kind, as a plugin bringing a model and the backend its layers call
        expects; else the first backend registered for them (the core's come first).
        """
        if name is not None:
            if name not in self.attention_backends:
                known = ", ".join(sorted(self.attention_backends))
                raise ValueError(f"unknown attention backend {name!r}; registered: {known}")
            entry = self.attention_backends[name]
            if cache_kind in entry.cache_kinds:
                return entry
        entries = list(self.attention_backends.values())
        if owner is not None:  # (a stable sort: the owner's first, each side in order)
            entries.sort(key=lambda e: e.plugin != owner)
        for entry in entries:
            if device_type in entry.devices and cache_kind in entry.cache_kinds:
                return entry
        served = sorted({k for e in self.attention_backends.values() for k in e.cache_kinds})
        raise ValueError(
            f"no attention backend registered for KV cache kind {cache_kind!r} on device "
            f"{device_type!r} (kinds with a backend: {', '.join(served) or 'none'}); a plugin "
            "registers one with register(name, backend, devices=..., cache_kinds=(kind,))"
        )


def _check_path(plugin: str, path: str) -> None:
    if not isinstance(path, str) or ":" not in path:
        raise PluginError(f"plugin {plugin!r} registered {path!r}; expected 'module:Class'")


def _check_unique(table: dict[str, Any], name: str, plugin: str, kind: str) -> None:
    if name in table:
        raise PluginError(
            f"{kind} {name!r} registered twice: by {table[name].plugin!r} and by {plugin!r}"
        )
