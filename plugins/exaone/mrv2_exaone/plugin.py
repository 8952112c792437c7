"""mrv2 plugin entry point of EXAONE 4 and K-EXAONE: registers their architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``Exaone4ForCausalLM`` (LG EXAONE 4.0 1.2B / 32B) and ``ExaoneMoeForCausalLM`` (LG
    K-EXAONE); they use the core's default decoder-only ModelState."""
    register("Exaone4ForCausalLM", "mrv2_exaone.model:Exaone4ForCausalLM")
    register("ExaoneMoeForCausalLM", "mrv2_exaone.exaone_moe:ExaoneMoeForCausalLM")
