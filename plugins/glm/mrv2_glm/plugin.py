"""mrv2 plugin entry point of the GLM family: registers its architecture, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """GLM-4.5 / 4.5-Air / 4.6 / 4.7 (``Glm4MoeForCausalLM``); the core's default decoder-only
    ModelState serves it."""
    register("Glm4MoeForCausalLM", "mrv2_glm.model:Glm4MoeForCausalLM")
