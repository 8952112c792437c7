"""mrv2 plugin entry point of the MiniMax family: registers its architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``MiniMaxM2ForCausalLM`` (MiniMax-M2, M2.1; the core's default decoder-only
    ModelState) and ``MiniMaxForCausalLM`` (MiniMax-Text-01, MiniMax-M1: lightning attention
    layers keep per-request state; also under the original remote-code names)."""
    register("MiniMaxM2ForCausalLM", "mrv2_minimax.model:MiniMaxM2ForCausalLM")
    for name in ("MiniMaxForCausalLM", "MiniMaxText01ForCausalLM", "MiniMaxM1ForCausalLM"):
        register(name, "mrv2_minimax.text01:MiniMaxForCausalLM")
