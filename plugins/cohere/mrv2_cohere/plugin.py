"""mrv2 plugin entry point of Cohere's Command models: registers their architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``CohereForCausalLM`` (Command R, Command R+) and ``Cohere2ForCausalLM`` (Command R7B,
    Command A: sliding-window layers with RoPE, global layers without) and
    ``Cohere2MoeForCausalLM`` (Cohere2's layers with routed experts); they use the core's
    default decoder-only ModelState. ``AyaVisionForConditionalGeneration`` (Aya Vision 8B /
    32B: a SigLIP tower over image tiles, the pixel-shuffle SwiGLU projector, Command R7B's
    decoder) with its model state (the encoder cache) and input processor (the checkpoint's
    GOT-OCR2 tiling, HF's ``TILE_i`` / ``<|IMG_PATCH|>`` layout);
    ``Cohere2VisionForConditionalGeneration`` (Command A Vision: Aya's pieces with the whole
    SigLIP tower, a projector without LayerNorm, its own tiling and layout) likewise."""
    register("CohereForCausalLM", "mrv2_cohere.model:CohereForCausalLM")
    register("Cohere2ForCausalLM", "mrv2_cohere.model:Cohere2ForCausalLM")
    register("Cohere2MoeForCausalLM", "mrv2_cohere.cohere2_moe:Cohere2MoeForCausalLM")
    register("AyaVisionForConditionalGeneration",
             "mrv2_cohere.aya_vision:AyaVisionForConditionalGeneration",
             model_state="mrv2_cohere.aya_vision_inputs:AyaVisionModelState",
             input_processor="mrv2_cohere.aya_vision_inputs:AyaVisionInputProcessor")
    register("Cohere2VisionForConditionalGeneration",
             "mrv2_cohere.cohere2_vision:Cohere2VisionForConditionalGeneration",
             model_state="mrv2_cohere.aya_vision_inputs:AyaVisionModelState",
             input_processor="mrv2_cohere.cohere2_vision:Cohere2VisionInputProcessor")
