"""mrv2 plugin entry point of the DeepSeek family: registers its architectures, lazily. (The
``mla`` attention backend of their ``"latent"`` KV cache is the core's: :mod:`mrv2.defaults`.)"""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """DeepSeek-V2 / V2-Lite (``DeepseekV2ForCausalLM``) and V3 (``DeepseekV3ForCausalLM``);
    the core's default decoder-only ModelState serves both."""
    register("DeepseekV2ForCausalLM", "mrv2_deepseek.model:DeepseekV2ForCausalLM")
    register("DeepseekV3ForCausalLM", "mrv2_deepseek.model:DeepseekV3ForCausalLM")
