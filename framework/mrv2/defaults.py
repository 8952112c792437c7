"""The core's own plugin: the defaults, registered through the same hooks as any plugin.

The stage hooks are ``trylast``, so a plugin's implementation runs first and wins by returning
a value. (Model-specific per-step behaviour is not here: it lives in ``ModelState`` methods,
see :mod:`mrv2.contract.model_state`.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mrv2.config import EngineConfig
from mrv2.contract.model_state import ModelState
from mrv2.contract.speculator import Speculator
from mrv2.hookspecs import hookimpl
from mrv2.registry import KNOWN_SPECULATOR_PACKAGES, Registries
from mrv2.sample.sampler import Sampler

# -- registration ------------------------------------------------------------------------------


@hookimpl
def mrv2_register_attention_backends(register: Callable[..., None]) -> None:
    """Paged K/V caches: Triton on CUDA, the plain-torch reference everywhere (the CPU's
    default). ``"latent"`` caches (multi-head latent attention, :mod:`mrv2.layers.mla`):
    ``mla``, the absorbed form (Triton on CUDA, the torch reference on the CPU), whichever
    family's layers use it."""
    register("triton", "mrv2.attention.triton_backend:TritonAttentionBackend", devices=("cuda",),
             cache_kinds=("paged_kv",))
    register("torch", "mrv2.attention.torch_backend:TorchAttentionBackend",
             devices=("cpu", "cuda"), cache_kinds=("paged_kv",))
    register("mla", "mrv2.attention.mla_backend:MLABackend", devices=("cuda", "cpu"),
             cache_kinds=("latent",))


@hookimpl
def mrv2_register_speculators(register: Callable[..., None]) -> None:
    """n-gram (prompt lookup) speculation, proposed on the device."""
    register("ngram", "mrv2.spec_decode.ngram:NgramSpeculator")
    register("draft_model", "mrv2.spec_decode.draft_model:DraftModelSpeculator")


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
        processors.append(registry[name].load()(vocab_size, device))
    method = config.speculative.rejection_sample_method
    return Sampler(config.scheduler.max_num_seqs, vocab_size, device, processors,
                   verify_method=None if method == "strict" else method,
                   synthetic_rate=config.speculative.synthetic_acceptance_rate,
                   logprobs_mode=config.model.logprobs_mode)


@hookimpl(trylast=True)
def mrv2_make_speculator(
    config: EngineConfig, registries: Registries, model_state: ModelState, device: torch.device
) -> Speculator | None:
    """The registered speculator named by ``speculative.method``, or ``None``."""
    method = config.speculative.method
    if method is None:
        return None
    registry = registries.speculators
    if method not in registry:
        known = ", ".join(sorted(registry)) or "none"
        package = KNOWN_SPECULATOR_PACKAGES.get(method)
        hint = f" ({method!r} is provided by '{package}': pip install {package})" if package else ""
        failed = "; ".join(registries.failed_plugins.values())
        hint += f"; these plugins failed to load, and may register it: {failed}" if failed else ""
        raise ValueError(f"unknown speculative method {method!r}; registered: {known}{hint}")
    speculator: Speculator = registry[method].load()(config, model_state, device)
    speculator.build(registries)
    return speculator
