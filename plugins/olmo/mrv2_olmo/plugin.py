"""mrv2 plugin entry point of the OLMo family: registers its architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``OlmoForCausalLM`` (OLMo 1B / 7B, 7B-0424 / 0724), ``Olmo2ForCausalLM`` (OLMo 2
    1B-32B), ``Olmo3ForCausalLM`` (OLMo 3 7B / 32B: OLMo 2's layers with sliding-window local
    layers), ``OlmoeForCausalLM`` (OLMoE-1B-7B) and ``FlexOlmoForCausalLM`` (FlexOlmo: OLMo 2's
    layers with OLMoE's experts) and ``OlmoHybridForCausalLM`` (Olmo-Hybrid-7B: Gated DeltaNet
    and attention layers, the former keeping per-request state); they use the core's default
    decoder-only ModelState."""
    register("OlmoForCausalLM", "mrv2_olmo.model:OlmoForCausalLM")
    register("Olmo2ForCausalLM", "mrv2_olmo.model:Olmo2ForCausalLM")
    register("Olmo3ForCausalLM", "mrv2_olmo.model:Olmo3ForCausalLM")
    register("OlmoeForCausalLM", "mrv2_olmo.olmoe:OlmoeForCausalLM")
    register("FlexOlmoForCausalLM", "mrv2_olmo.olmoe:FlexOlmoForCausalLM")
    register("OlmoHybridForCausalLM", "mrv2_olmo.olmo_hybrid:OlmoHybridForCausalLM")
