"""mrv2 plugin entry point of Cohere's Command models: registers their architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``CohereForCausalLM`` (Command R, Command R+) and ``Cohere2ForCausalLM`` (Command R7B,
    Command A: sliding-window layers with RoPE, global layers without); they use the core's
    default decoder-only ModelState."""
    register("CohereForCausalLM", "mrv2_cohere.model:CohereForCausalLM")
    register("Cohere2ForCausalLM", "mrv2_cohere.model:Cohere2ForCausalLM")
