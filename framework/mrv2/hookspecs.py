"""Every hook of project ``"mrv2"``, grouped by phase.

A plugin is a module or object with functions marked ``@mrv2.hookimpl`` whose names match these
specs; it reaches the engine through the ``"mrv2"`` entry-point group (or
``PluginManager.register`` in tests). Only the arguments a plugin names are passed, so an
implementation may take fewer parameters than the spec.

Phases:

* **Registration** (once, at start, in the engine process): plugins hand the engine lazy
  ``"module:Class"`` paths through a ``register`` callback. Nothing is imported until used.
* **Sampler stage** and **speculator stage** (once, when the runner is built): which sampler and
  which speculator run after the forward. The built-in sampler is the default.

Per-request and per-step model behaviour is *not* a hook: it is the methods of the model's
:class:`~mrv2.contract.model_state.ModelState` subclass, registered with its architecture, so
one family's code never runs for another family's model and the step path pays no hook
dispatch (CONTRIBUTING.md, "Why ModelState methods, not hooks").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    import torch

    from mrv2.config import EngineConfig
    from mrv2.contract.model_state import ModelState
    from mrv2.contract.speculator import Speculator
    from mrv2.registry import Registries
    from mrv2.sample.sampler import Sampler

PROJECT = "mrv2"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ---------------------------------------------------------------------------------------------
# Registration: called once when the plugin manager is built.
# ---------------------------------------------------------------------------------------------


@hookspec
def mrv2_register_models(register: Callable[..., None]) -> None:
    """Register model architectures.

    Call ``register(architecture, model, model_state=None, input_processor=None)`` once per
    architecture: ``architecture`` is the HF ``config.json`` ``architectures`` name
    (``"Qwen3ForCausalLM"``), ``model`` the lazy ``"module:Class"`` path of the ``nn.Module``,
    ``model_state`` the lazy path of its :class:`~mrv2.contract.model_state.ModelState` subclass
    (``None``: the core's default decoder-only state), ``input_processor`` the lazy path of its
    :class:`~mrv2.contract.input_processor.InputProcessor` (multimodal families: turns prompts
    with ``multi_modal_data`` into token ids and multimodal items; ``None``: text only).
    Registering a name twice is an error naming both plugins.

    Called once, at start, in the engine process.
    """


@hookspec
def mrv2_register_attention_backends(register: Callable[..., None]) -> None:
    """Register attention backends.

    Call ``register(name, backend, devices=("cuda",), cache_kinds=("paged_kv",))``: ``backend``
    is the lazy ``"module:Class"`` path of an :class:`~mrv2.contract.attention.AttentionBackend`,
    ``devices`` the device types it runs on, ``cache_kinds`` the
    :class:`~mrv2.contract.kv_cache.KVCacheSpec` kinds it serves (a plugin whose layers declare
    a new kind registers its backend here). Each KV cache group gets the first backend
    registered for its device and kind by the plugin that registered the model, else the first
    registered by any (the core's ``triton``, ``torch`` and ``mla`` come first);
    ``--attention-backend NAME`` picks another for the groups whose kind it serves. Called
    once, at start.
    """


@hookspec
def mrv2_register_speculators(register: Callable[..., None]) -> None:
    """Register speculative-decoding methods.

    Call ``register(name, speculator)`` with the lazy ``"module:Class"`` path of a
    :class:`~mrv2.contract.speculator.Speculator` subclass, built as
    ``cls(config, model_state, device)``; ``speculative_config={"method": NAME, ...}`` selects
    it. The core registers ``"ngram"``. Called once, at start.
    """


@hookspec
def mrv2_register_logits_processors(register: Callable[..., None]) -> None:
    """Register logits processors.

    Call ``register(name, processor)`` with the lazy ``"module:Class"`` path of a
    :class:`~mrv2.sample.logits_processor.LogitsProcessor`; the engine argument
    ``logits_processors=[NAME, ...]`` turns it on. Called once, at start.
    """


# ---------------------------------------------------------------------------------------------
# Sampler and speculator stages: called once when the runner is built.
# ---------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def mrv2_make_sampler(
    config: EngineConfig, registries: Registries, vocab_size: int, device: torch.device
) -> Sampler | None:
    """The sampler that turns each step's logits into tokens.

    ``registries`` holds the registered logits processors (``config.logits_processors`` names
    those to apply). A sampler that overrides ``__call__`` applies the plan's structured-output
    masks itself (``SamplePlan.bitmasks``: ``Sampler.apply_bitmasks``).
    First non-``None`` result wins; the core's built-in sampler is registered ``trylast``.
    Called once when the runner is built.
    """


@hookspec(firstresult=True)
def mrv2_make_speculator(
    config: EngineConfig, registries: Registries, model_state: ModelState, device: torch.device
) -> Speculator | None:
    """The speculator that proposes draft tokens after sampling, or ``None`` for none.

    ``registries`` holds the registered speculators; ``model_state`` is the target model's
    state (its ``model`` shares embeddings and LM head with model-based drafters).
    First non-``None`` result wins; the core's default builds the registered speculator named
    by ``speculative.method`` (``None`` when no method is set). Called once when the runner is
    built, after the model and before the KV cache is sized.
    """
