"""mrv2 plugin entry point of InternVL: registers its architecture, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``InternVLForConditionalGeneration`` (InternVL3 / 3.5 in transformers' format: a Qwen2,
    Qwen3 or Llama text decoder and the InternViT vision tower), with its model state (the
    encoder cache, each step's image rows) and input processor (the checkpoint's tiling image
    processor)."""
    register("InternVLForConditionalGeneration",
             "mrv2_internvl.model:InternVLForConditionalGeneration",
             model_state="mrv2_internvl.inputs:InternVLModelState",
             input_processor="mrv2_internvl.inputs:InternVLInputProcessor")
