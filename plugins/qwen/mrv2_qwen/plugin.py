"""mrv2 plugin entry point of the Qwen family: registers its architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """Qwen2/2.5, Qwen3 dense and Qwen3-MoE models; they use the core's default decoder-only
    ModelState."""
    register("Qwen2ForCausalLM", "mrv2_qwen.model:Qwen2ForCausalLM")
    register("Qwen3ForCausalLM", "mrv2_qwen.model:Qwen3ForCausalLM")
    register("Qwen3MoeForCausalLM", "mrv2_qwen.qwen3_moe:Qwen3MoeForCausalLM")
