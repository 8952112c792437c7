"""mrv2 plugin entry point of StepFun's Step family: registers its architecture, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """Step-3.7 (``Step3p7ForConditionalGeneration``: the Step-3.5 MoE text decoder with
    sliding-window and full attention layers, a 2-D RoPE vision tower over a global view and
    local crops of each image) with its model state (the encoder cache) and input processor
    (HF's crops, the ``<patch_start>`` / ``<im_start>`` layout)."""
    register("Step3p7ForConditionalGeneration",
             "mrv2_step.model:Step3p7ForConditionalGeneration",
             model_state="mrv2_step.vision_inputs:Step3p7ModelState",
             input_processor="mrv2_step.vision_inputs:Step3p7InputProcessor")
