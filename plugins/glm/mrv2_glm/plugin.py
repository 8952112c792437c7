"""mrv2 plugin entry point of the GLM family: registers its architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """GLM-4.5 / 4.5-Air / 4.6 / 4.7 (``Glm4MoeForCausalLM``), GLM-4-9B-chat-hf
    (``GlmForCausalLM``), GLM-4-0414 / GLM-Z1 (``Glm4ForCausalLM``) and GLM-4.7-Flash
    (``Glm4MoeLiteForCausalLM``, on the core's multi-head latent attention), GLM-5
    (``GlmMoeDsaForCausalLM``, on the core's sparse MLA), Upstage's Solar Open
    (``SolarOpenForCausalLM``: GLM-4.5's MoE under Llama's attention), which the core's
    default decoder-only ModelState serves; and the vision-language GLM-4.1V
    (``Glm4vForConditionalGeneration``) and GLM-4.5V / 4.6V
    (``Glm4vMoeForConditionalGeneration``) with their model state (M-RoPE positions, image
    embeddings) and input processor."""
    register("Glm4MoeForCausalLM", "mrv2_glm.model:Glm4MoeForCausalLM")
    register("GlmForCausalLM", "mrv2_glm.dense:GlmForCausalLM")
    register("Glm4ForCausalLM", "mrv2_glm.dense:Glm4ForCausalLM")
    register("Glm4MoeLiteForCausalLM", "mrv2_glm.lite:Glm4MoeLiteForCausalLM")
    register("GlmMoeDsaForCausalLM", "mrv2_glm.dsa:GlmMoeDsaForCausalLM")
    register("SolarOpenForCausalLM", "mrv2_glm.solar_open:SolarOpenForCausalLM")
    register("Glm4vForConditionalGeneration", "mrv2_glm.glm4v:Glm4vForConditionalGeneration",
             model_state="mrv2_glm.glm4v:Glm4vModelState",
             input_processor="mrv2_glm.glm4v_inputs:Glm4vInputProcessor")
    register("Glm4vMoeForConditionalGeneration",
             "mrv2_glm.glm4v:Glm4vMoeForConditionalGeneration",
             model_state="mrv2_glm.glm4v:Glm4vModelState",
             input_processor="mrv2_glm.glm4v_inputs:Glm4vInputProcessor")
