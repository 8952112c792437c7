"""mrv2 plugin entry point of MiniMax-M2: registers its architecture, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``MiniMaxM2ForCausalLM`` (MiniMax-M2, M2.1); it uses the core's default decoder-only
    ModelState."""
    register("MiniMaxM2ForCausalLM", "mrv2_minimax.model:MiniMaxM2ForCausalLM")
