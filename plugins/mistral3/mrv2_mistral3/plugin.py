"""mrv2 plugin entry point of Mistral 3: registers its architecture, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``Mistral3ForConditionalGeneration`` (Mistral Small 3.1 / 3.2 24B: Mistral's text
    decoder and the Pixtral vision tower), with its model state (the encoder cache, each
    step's image rows) and input processor (the checkpoint's Pixtral image processor)."""
    register("Mistral3ForConditionalGeneration",
             "mrv2_mistral3.model:Mistral3ForConditionalGeneration",
             model_state="mrv2_mistral3.inputs:Mistral3ModelState",
             input_processor="mrv2_mistral3.inputs:Mistral3InputProcessor")
