"""mrv2 plugin entry point of the Qwen family: registers its architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """Qwen2/2.5, Qwen3 dense, Qwen2-MoE, Qwen3-MoE and Qwen3-Next models; they use the
    core's default decoder-only ModelState (Qwen3-Next's per-request linear-attention state
    included)."""
    register("Qwen2ForCausalLM", "mrv2_qwen.model:Qwen2ForCausalLM")
    register("Qwen3ForCausalLM", "mrv2_qwen.model:Qwen3ForCausalLM")
    register("Qwen3MoeForCausalLM", "mrv2_qwen.qwen3_moe:Qwen3MoeForCausalLM")
    register("Qwen2MoeForCausalLM", "mrv2_qwen.qwen3_moe:Qwen2MoeForCausalLM")
    register("Qwen3NextForCausalLM", "mrv2_qwen.qwen3_next:Qwen3NextForCausalLM")
