"""mrv2 plugin entry point of Llama 4: registers its architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``Llama4ForCausalLM`` (a text-only Llama 4 checkpoint) and
    ``Llama4ForConditionalGeneration`` (Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E:
    their text model; images are refused by the input processor). Both with the model state
    that sizes the RoPE table to ``max_model_len``."""
    state = "mrv2_llama4.state:Llama4ModelState"
    register("Llama4ForCausalLM", "mrv2_llama4.model:Llama4ForCausalLM", model_state=state)
    register("Llama4ForConditionalGeneration",
             "mrv2_llama4.model:Llama4ForConditionalGeneration", model_state=state,
             input_processor="mrv2_llama4.state:Llama4InputProcessor")
