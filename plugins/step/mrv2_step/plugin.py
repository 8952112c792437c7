"""mrv2 plugin entry point of StepFun's Step family: registers its architecture, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """Step-3.7 (``Step3p7ForConditionalGeneration``: the Step-3.5 MoE text decoder with
    sliding-window and full attention layers); text prompts only, so no input processor: a
    prompt's ``multi_modal_data`` is refused by name. The core's default decoder-only
    ModelState serves it."""
    register("Step3p7ForConditionalGeneration",
             "mrv2_step.model:Step3p7ForConditionalGeneration")
