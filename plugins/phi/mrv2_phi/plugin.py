"""mrv2 plugin entry point of the Phi family: registers its architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``PhiForCausalLM``: phi-1, phi-1.5, phi-2; ``Phi3ForCausalLM``: Phi-3 / Phi-3.5 mini
    and medium, Phi-4, Phi-4-mini;
    ``PhiMoEForCausalLM`` (the published config's name; transformers' ``PhimoeForCausalLM``):
    Phi-3.5-MoE. They use the core's default decoder-only ModelState."""
    register("PhiForCausalLM", "mrv2_phi.phi:PhiForCausalLM")
    register("Phi3ForCausalLM", "mrv2_phi.model:Phi3ForCausalLM")
    register("PhiMoEForCausalLM", "mrv2_phi.phimoe:PhiMoEForCausalLM")
    register("PhimoeForCausalLM", "mrv2_phi.phimoe:PhimoeForCausalLM")
