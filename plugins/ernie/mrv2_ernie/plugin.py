"""mrv2 plugin entry point of ERNIE 4.5: registers its architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``Ernie4_5ForCausalLM`` (ERNIE-4.5-0.3B) and ``Ernie4_5_MoeForCausalLM``
    (ERNIE-4.5-21B-A3B, 300B-A47B); they use the core's default decoder-only ModelState."""
    register("Ernie4_5ForCausalLM", "mrv2_ernie.model:Ernie4_5ForCausalLM")
    register("Ernie4_5_MoeForCausalLM", "mrv2_ernie.model:Ernie4_5_MoeForCausalLM")
