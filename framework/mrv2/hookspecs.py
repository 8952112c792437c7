"""Every hook of project ``"mrv2"``, grouped by phase.

A plugin is a module or object with functions marked ``@mrv2.hookimpl`` whose names match these
specs; it reaches the engine through the ``"mrv2"`` entry-point group (or
``PluginManager.register`` in tests). Only the arguments a plugin names are passed, so an
implementation may take fewer parameters than the spec.

Phases:

* **Registration** (once, at start, in the engine process): plugins hand the engine lazy
  ``"module:Class"`` paths through a ``register`` callback. Nothing is imported until used.
* **ModelState lifecycle** (in the runner, per request and per step): the core's default
  implementation (registered ``trylast``) delegates to the methods of the runner's ``ModelState``;
  a plugin adds to or overrides it for the model states it knows. The runner resolves these hooks
  once at start.
* **Sampler stage** and **speculator stage** (once, when the runner is built): which sampler and
  which speculator run after the forward. The built-in sampler is the default.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import torch

    from mrv2.attention.backend import AttentionMetadata
    from mrv2.config import EngineConfig
    from mrv2.plugins import Registries
    from mrv2.runner.input_batch import InputBatch
    from mrv2.runner.model_state import ModelState
    from mrv2.runner.scheduler_output import NewRequest
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

    Call ``register(architecture, model, model_state=None)`` once per architecture:
    ``architecture`` is the HF ``config.json`` ``architectures`` name (``"Qwen3ForCausalLM"``),
    ``model`` the lazy ``"module:Class"`` path of the ``nn.Module``, ``model_state`` the lazy path
    of its :class:`~mrv2.runner.model_state.ModelState` subclass (``None``: the core's default
    decoder-only state). Registering a name twice is an error naming both plugins.

    Called once, at start, in the engine process.
    """


@hookspec
def mrv2_register_attention_backends(register: Callable[..., None]) -> None:
    """Register attention backends.

    Call ``register(name, backend, devices=("cuda",))``: ``backend`` is the lazy
    ``"module:Class"`` path of an :class:`~mrv2.attention.backend.AttentionBackend`, ``devices``
    the device types it runs on; the first registered backend for a device is its default,
    ``--attention-backend NAME`` picks another. Called once, at start.
    """


@hookspec
def mrv2_register_speculators(register: Callable[..., None]) -> None:
    """Register speculative-decoding methods.

    Call ``register(name, speculator)`` with the lazy ``"module:Class"`` path of a speculator;
    ``speculative.method=NAME`` in the config selects it. Called once, at start.
    """


@hookspec
def mrv2_register_logits_processors(register: Callable[..., None]) -> None:
    """Register logits processors.

    Call ``register(name, processor)`` with the lazy ``"module:Class"`` path of a
    :class:`~mrv2.sample.logits_processor.LogitsProcessor`; the engine argument
    ``logits_processors=[NAME, ...]`` turns it on. Called once, at start.
    """


# ---------------------------------------------------------------------------------------------
# ModelState lifecycle: called by the runner, per request and per step.
# ---------------------------------------------------------------------------------------------


@hookspec
def mrv2_add_request(model_state: ModelState, request: NewRequest, row: int) -> None:
    """A request entered the state table at ``row``: set up per-request model state.

    Every implementation runs. Called on the CPU thread that schedules, before the step that first
    computes the request; must not synchronize with the device.
    """


@hookspec
def mrv2_remove_request(model_state: ModelState, req_id: str, row: int) -> None:
    """A request left ``row`` (finished, aborted or preempted): free what it held.

    Every implementation runs. Called before the step that reuses the row.
    """


@hookspec(firstresult=True)
def mrv2_get_mm_embeddings(model_state: ModelState, batch: InputBatch) -> torch.Tensor | None:
    """Multimodal embeddings to splice into this step's input embeddings, or ``None``.

    First non-``None`` result wins. Called each step before the forward; text-only models return
    ``None`` (the default).
    """


@hookspec
def mrv2_prepare_inputs(model_state: ModelState, batch: InputBatch) -> dict[str, Any] | None:
    """Keyword arguments for this step's ``model.forward``.

    Every implementation runs and the dicts are merged (later plugins may add inputs, e.g.
    M-RoPE positions); the default returns ``input_ids`` and ``positions`` from ``batch``.
    Called each step after the prep kernels; must only launch device work, never read it back.
    """


@hookspec(firstresult=True)
def mrv2_prepare_attn(model_state: ModelState, batch: InputBatch) -> AttentionMetadata | None:
    """The step's attention metadata, built from ``batch``'s device tensors.

    First non-``None`` result wins; the default builds paged-attention metadata. Called each
    step (and at CUDA-graph capture, over the persistent buffers).
    """


@hookspec(firstresult=True)
def mrv2_prepare_dummy_inputs(
    model_state: ModelState, num_reqs: int, num_tokens: int
) -> InputBatch | None:
    """An input batch of ``num_reqs`` requests and ``num_tokens`` tokens of harmless values.

    Called at start: for the profiling forward that sizes the KV cache (on CUDA) and for
    CUDA-graph capture. The batch must point at the same persistent buffers that real steps use.
    First non-``None`` result wins.
    """


@hookspec(firstresult=True)
def mrv2_capture_cuda_graph(
    model_state: ModelState, batch: InputBatch, forward: Callable[[], torch.Tensor]
) -> Any:
    """Capture ``forward`` over ``batch`` into a replayable graph, or return ``None`` to refuse.

    First non-``None`` result wins; the default captures a ``torch.cuda.CUDAGraph``. A model
    whose forward cannot be captured returns ``None`` here and runs eager. Called at start, once
    per padded batch size.
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
    those to apply).
    First non-``None`` result wins; the core's built-in sampler is registered ``trylast``.
    Called once when the runner is built.
    """


@hookspec(firstresult=True)
def mrv2_make_speculator(
    config: EngineConfig, registries: Registries, model: Any, device: torch.device
) -> Any:
    """The speculator that proposes draft tokens after sampling, or ``None`` for none.

    ``registries`` holds the registered speculators.
    First non-``None`` result wins; the core's default looks ``speculative.method`` up among the
    registered speculators. Called once when the runner is built.
    """
