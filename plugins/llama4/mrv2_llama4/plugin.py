"""mrv2 plugin entry point of Llama 4: registers its architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``Llama4ForCausalLM`` (a text-only Llama 4 checkpoint), with the model state that sizes
    the RoPE table to ``max_model_len``, and ``Llama4ForConditionalGeneration``
    (Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E: the text model and the image encoder),
    with its model state (the same sizing, the encoder cache, each step's image rows) and
    input processor (HF's tiles and prompt layout, preprocessed without torchvision)."""
    register("Llama4ForCausalLM", "mrv2_llama4.model:Llama4ForCausalLM",
             model_state="mrv2_llama4.state:Llama4ModelState")
    register("Llama4ForConditionalGeneration",
             "mrv2_llama4.model:Llama4ForConditionalGeneration",
             model_state="mrv2_llama4.inputs:Llama4ImageModelState",
             input_processor="mrv2_llama4.inputs:Llama4InputProcessor")
