"""The core's own plugin: the defaults, registered through the same hooks as any plugin.

ModelState lifecycle hooks delegate to the runner's ``ModelState`` and are ``trylast``, so a
plugin's implementation runs first and, for ``firstresult`` hooks, wins by returning a value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mrv2.attention.backend import AttentionMetadata
from mrv2.config import EngineConfig
from mrv2.hookspecs import hookimpl
from mrv2.plugins import Registries, import_object
from mrv2.runner.input_batch import InputBatch
from mrv2.runner.model_state import ModelState
from mrv2.runner.scheduler_output import NewRequest
from mrv2.sample.sampler import Sampler

# -- registration ------------------------------------------------------------------------------


@hookimpl
def mrv2_register_attention_backends(register: Callable[..., None]) -> None:
    """Triton on CUDA, the plain-torch reference everywhere (the CPU's default)."""
    register("triton", "mrv2.attention.triton_backend:TritonAttentionBackend", devices=("cuda",))
    register("torch", "mrv2.attention.torch_backend:TorchAttentionBackend",
             devices=("cpu", "cuda"))


# -- ModelState lifecycle ----------------------------------------------------------------------


@hookimpl(trylast=True)
def mrv2_add_request(model_state: ModelState, request: NewRequest, row: int) -> None:
    """Delegate to ``ModelState.add_request``."""
    model_state.add_request(request, row)


@hookimpl(trylast=True)
def mrv2_remove_request(model_state: ModelState, req_id: str, row: int) -> None:
    """Delegate to ``ModelState.remove_request``."""
    model_state.remove_request(req_id, row)


@hookimpl(trylast=True)
def mrv2_get_mm_embeddings(model_state: ModelState, batch: InputBatch) -> torch.Tensor | None:
    """Delegate to ``ModelState.get_mm_embeddings``."""
    return model_state.get_mm_embeddings(batch)


@hookimpl(trylast=True)
def mrv2_prepare_inputs(model_state: ModelState, batch: InputBatch) -> dict[str, Any]:
    """Delegate to ``ModelState.prepare_inputs``."""
    return model_state.prepare_inputs(batch)


@hookimpl(trylast=True)
def mrv2_prepare_attn(model_state: ModelState, batch: InputBatch) -> AttentionMetadata:
    """Delegate to ``ModelState.prepare_attn``."""
    return model_state.prepare_attn(batch)


@hookimpl(trylast=True)
def mrv2_prepare_dummy_inputs(
    model_state: ModelState, num_reqs: int, num_tokens: int
) -> InputBatch:
    """Delegate to ``ModelState.prepare_dummy_inputs``."""
    return model_state.prepare_dummy_inputs(num_reqs, num_tokens)


@hookimpl(trylast=True)
def mrv2_capture_cuda_graph(
    model_state: ModelState, batch: InputBatch, forward: Callable[[], torch.Tensor]
) -> Any:
    """Delegate to ``ModelState.capture_cuda_graph``."""
    return model_state.capture_cuda_graph(batch, forward)


# -- sampler and speculator stages -------------------------------------------------------------


@hookimpl(trylast=True)
def mrv2_make_sampler(
    config: EngineConfig, registries: Registries, vocab_size: int, device: torch.device
) -> Sampler:
    """The built-in sampler, with the logits processors the config turns on."""
    registry = registries.logits_processors
    processors = []
    for name in config.logits_processors:
        if name not in registry:
            known = ", ".join(sorted(registry)) or "none"
            raise ValueError(f"unknown logits processor {name!r}; registered: {known}")
        processors.append(import_object(registry[name].target)(vocab_size, device))
    return Sampler(processors)


@hookimpl(trylast=True)
def mrv2_make_speculator(
    config: EngineConfig, registries: Registries, model: Any, device: torch.device
) -> Any:
    """The registered speculator named by ``speculative.method``, or ``None``."""
    method = config.speculative.method
    if method is None:
        return None
    registry = registries.speculators
    if method not in registry:
        known = ", ".join(sorted(registry)) or "none"
        raise ValueError(f"unknown speculative method {method!r}; registered: {known}")
    return import_object(registry[method].target)(config, model, device)
