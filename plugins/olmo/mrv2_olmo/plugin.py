"""mrv2 plugin entry point of OLMo 2: registers its architecture, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``Olmo2ForCausalLM`` (OLMo 2 1B-32B); it uses the core's default decoder-only
    ModelState."""
    register("Olmo2ForCausalLM", "mrv2_olmo.model:Olmo2ForCausalLM")
