"""mrv2 plugin entry point of EXAONE 4: registers its architecture, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``Exaone4ForCausalLM`` (LG EXAONE 4.0 1.2B / 32B); it uses the core's default
    decoder-only ModelState."""
    register("Exaone4ForCausalLM", "mrv2_exaone.model:Exaone4ForCausalLM")
