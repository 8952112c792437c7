"""mrv2 plugin entry point of LLaVA: registers its architecture, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``LlavaForConditionalGeneration`` (LLaVA-1.5 style in transformers' format: a CLIP or
    SigLIP vision tower, the two-layer projector, a Llama, Mistral, Qwen2 or Qwen3 text
    decoder), with its model state (the encoder cache, each step's image rows) and input
    processor (the checkpoint's CLIP image processor); ``LlavaNextForConditionalGeneration``
    (LLaVA-1.6: the same parts with anyres tiles, unpadding and ``image_newline``)."""
    register("LlavaForConditionalGeneration",
             "mrv2_llava.model:LlavaForConditionalGeneration",
             model_state="mrv2_llava.inputs:LlavaModelState",
             input_processor="mrv2_llava.inputs:LlavaInputProcessor")
    register("LlavaNextForConditionalGeneration",
             "mrv2_llava.llava_next:LlavaNextForConditionalGeneration",
             model_state="mrv2_llava.llava_next_inputs:LlavaNextModelState",
             input_processor="mrv2_llava.llava_next_inputs:LlavaNextInputProcessor")
