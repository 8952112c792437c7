"""mrv2 plugin entry point of Idefics3 and SmolVLM: registers their architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``Idefics3ForConditionalGeneration`` (Idefics3-8B-Llama3: a SigLIP-style tower over
    image tiles, the pixel-shuffle connector, a Llama 3 decoder) and
    ``SmolVLMForConditionalGeneration`` (SmolVLM / SmolVLM2, the same model; images only),
    with their model state (the encoder cache, each step's image rows) and input processor
    (the checkpoint's image processor, HF's tile layout of row/column tags)."""
    for architecture in ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"):
        register(architecture, f"mrv2_idefics3.model:{architecture}",
                 model_state="mrv2_idefics3.inputs:Idefics3ModelState",
                 input_processor="mrv2_idefics3.inputs:Idefics3InputProcessor")
