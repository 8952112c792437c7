"""mrv2 plugin entry point of the Qwen-VL family: registers its architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """Qwen2-VL (``Qwen2VLForConditionalGeneration``), Qwen2.5-VL
    (``Qwen2_5_VLForConditionalGeneration``), Qwen3-VL
    (``Qwen3VLForConditionalGeneration``) and Qwen3-VL-MoE
    (``Qwen3VLMoeForConditionalGeneration``), each with its model state (M-RoPE positions, image
    embeddings; Qwen3-VL's also the deepstack features) and the input processor (the
    checkpoint's image processor), which both share."""
    register("Qwen2VLForConditionalGeneration",
             "mrv2_qwen_vl.model:Qwen2VLForConditionalGeneration",
             model_state="mrv2_qwen_vl.model_state:QwenVLModelState",
             input_processor="mrv2_qwen_vl.processor:QwenVLInputProcessor")
    register("Qwen2_5_VLForConditionalGeneration",
             "mrv2_qwen_vl.model:Qwen25VLForConditionalGeneration",
             model_state="mrv2_qwen_vl.model_state:QwenVLModelState",
             input_processor="mrv2_qwen_vl.processor:QwenVLInputProcessor")
    register("Qwen3VLForConditionalGeneration",
             "mrv2_qwen_vl.model_qwen3:Qwen3VLForConditionalGeneration",
             model_state="mrv2_qwen_vl.model_state:Qwen3VLModelState",
             input_processor="mrv2_qwen_vl.processor:QwenVLInputProcessor")
    register("Qwen3VLMoeForConditionalGeneration",
             "mrv2_qwen_vl.model_qwen3:Qwen3VLMoeForConditionalGeneration",
             model_state="mrv2_qwen_vl.model_state:Qwen3VLModelState",
             input_processor="mrv2_qwen_vl.processor:QwenVLInputProcessor")
