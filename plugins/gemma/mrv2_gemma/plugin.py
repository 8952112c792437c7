"""mrv2 plugin entry point of the Gemma family: registers its architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """Gemma 3's text decoder (Gemma 3 1B, and any ``Gemma3ForCausalLM`` checkpoint) and
    Gemma 2; they use the core's default decoder-only ModelState. Gemma 3's vision-language
    checkpoints (``Gemma3ForConditionalGeneration``: 4B, 12B, 27B) serve text and images:
    the text decoder plus the SigLIP encoder, with their model state (encoder cache, image
    spans that attend both ways) and input processor (the checkpoint's image processor).
    Gemma 4's text decoder (``Gemma4ForCausalLM``), and its multimodal checkpoints
    (``Gemma4ForConditionalGeneration``) with text, images and audio (video refused by their
    input processor). Gemma 3n's text decoder (``Gemma3nForCausalLM``) and its multimodal
    checkpoints (``Gemma3nForConditionalGeneration``) for text prompts (media refused by their
    input processor)."""
    register("Gemma3ForCausalLM", "mrv2_gemma.model:Gemma3ForCausalLM")
    register("Gemma2ForCausalLM", "mrv2_gemma.model:Gemma2ForCausalLM")
    register("Gemma3ForConditionalGeneration", "mrv2_gemma.vl:Gemma3ForConditionalGeneration",
             model_state="mrv2_gemma.vl_inputs:Gemma3VLModelState",
             input_processor="mrv2_gemma.vl_inputs:Gemma3InputProcessor")
    register("Gemma4ForCausalLM", "mrv2_gemma.gemma4:Gemma4ForCausalLM")
    register("Gemma4ForConditionalGeneration",
             "mrv2_gemma.gemma4_vl:Gemma4ForConditionalGeneration",
             model_state="mrv2_gemma.gemma4_inputs:Gemma4VLModelState",
             input_processor="mrv2_gemma.gemma4_inputs:Gemma4InputProcessor")
    register("Gemma3nForCausalLM", "mrv2_gemma.gemma3n:Gemma3nForCausalLM")
    register("Gemma3nForConditionalGeneration",
             "mrv2_gemma.gemma3n:Gemma3nForConditionalGeneration",
             input_processor="mrv2_gemma.gemma3n:Gemma3nTextOnlyInputs")
