"""mrv2 plugin entry point of the DeepSeek family: registers its architectures and the MLA
attention backend of its ``"latent"`` KV cache, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """DeepSeek-V2 / V2-Lite (``DeepseekV2ForCausalLM``) and V3 (``DeepseekV3ForCausalLM``);
    the core's default decoder-only ModelState serves both."""
    register("DeepseekV2ForCausalLM", "mrv2_deepseek.model:DeepseekV2ForCausalLM")
    register("DeepseekV3ForCausalLM", "mrv2_deepseek.model:DeepseekV3ForCausalLM")


@hookimpl
def mrv2_register_attention_backends(register: Callable[..., None]) -> None:
    """``mla``: the absorbed-form paged MLA attention (Triton on CUDA, the torch reference on
    the CPU) for ``"latent"`` caches."""
    register("mla", "mrv2_deepseek.mla:MLABackend", devices=("cuda", "cpu"),
             cache_kinds=("latent",))
