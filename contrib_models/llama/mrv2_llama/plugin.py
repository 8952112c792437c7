"""mrv2 plugin entry point of the Llama models: registers the architecture, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``LlamaForCausalLM`` (Llama 2/3, SmolLM2...) with its ModelState."""
    register(
        "LlamaForCausalLM",
        "mrv2_llama.model:LlamaForCausalLM",
        model_state="mrv2_llama.state:LlamaModelState",
    )
