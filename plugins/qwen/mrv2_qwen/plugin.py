"""mrv2 plugin entry point of the Qwen family: registers its architectures, lazily."""

import importlib.util
from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """Qwen2/2.5, Qwen3 dense, Qwen2-MoE, Qwen3-MoE, Qwen3-Next and Qwen3.5 (dense and MoE)
    models; they use the core's default decoder-only ModelState (Qwen3-Next's and Qwen3.5's
    per-request linear-attention state included). Qwen3.5's vision-language checkpoints
    (``*ForConditionalGeneration``) take images and videos where ``mrv2-plugin-qwen-vl`` is
    installed (its tower, model state and input processor); without it they serve text
    prompts, and their input processor refuses media, naming the plugin to install."""
    register("Qwen2ForCausalLM", "mrv2_qwen.model:Qwen2ForCausalLM")
    register("Qwen3ForCausalLM", "mrv2_qwen.model:Qwen3ForCausalLM")
    register("Qwen3MoeForCausalLM", "mrv2_qwen.qwen3_moe:Qwen3MoeForCausalLM")
    register("Qwen2MoeForCausalLM", "mrv2_qwen.qwen3_moe:Qwen2MoeForCausalLM")
    register("Qwen3NextForCausalLM", "mrv2_qwen.qwen3_next:Qwen3NextForCausalLM")
    register("Qwen3_5ForCausalLM", "mrv2_qwen.qwen3_5:Qwen3_5ForCausalLM")
    register("Qwen3_5MoeForCausalLM", "mrv2_qwen.qwen3_5:Qwen3_5MoeForCausalLM")
    if importlib.util.find_spec("mrv2_qwen_vl") is not None:  # images and videos
        for arch in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
            register(arch, "mrv2_qwen.qwen3_5_vl:Qwen3_5VLForConditionalGeneration",
                     model_state="mrv2_qwen_vl.model_state:Qwen3VLModelState",
                     input_processor="mrv2_qwen_vl.processor:QwenVLInputProcessor")
        return
    register("Qwen3_5ForConditionalGeneration", "mrv2_qwen.qwen3_5:Qwen3_5ForConditionalGeneration",
             input_processor="mrv2_qwen.qwen3_5:Qwen3_5TextOnlyInputs")
    register("Qwen3_5MoeForConditionalGeneration",
             "mrv2_qwen.qwen3_5:Qwen3_5MoeForConditionalGeneration",
             input_processor="mrv2_qwen.qwen3_5:Qwen3_5TextOnlyInputs")
