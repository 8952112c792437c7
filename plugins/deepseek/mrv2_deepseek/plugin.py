"""mrv2 plugin entry point of the DeepSeek family: registers its architectures, lazily. (The
``mla`` attention backend of their ``"latent"`` KV cache is the core's: :mod:`mrv2.defaults`.)"""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """DeepSeek-V2 / V2-Lite (``DeepseekV2ForCausalLM``), V3 (``DeepseekV3ForCausalLM``), V3.2
    (``DeepseekV32ForCausalLM``: the core's sparse MLA), rednote's dots.llm1
    (``Dots1ForCausalLM``: V3's MoE under GQA attention), Arcee's AFMoE (``AfmoeForCausalLM``:
    V3's router, one group, under gated attention) and Tencent's Youtu-LLM
    (``YoutuForCausalLM``: V3's MLA with dense MLPs) and Meituan's LongCat-Flash
    (``LongcatFlashForCausalLM``: paired MLA sublayers, a shortcut MoE with zero experts);
    the core's default decoder-only ModelState serves them all."""
    register("DeepseekV2ForCausalLM", "mrv2_deepseek.model:DeepseekV2ForCausalLM")
    register("DeepseekV3ForCausalLM", "mrv2_deepseek.model:DeepseekV3ForCausalLM")
    register("DeepseekV32ForCausalLM", "mrv2_deepseek.v32:DeepseekV32ForCausalLM")
    register("Dots1ForCausalLM", "mrv2_deepseek.dots1:Dots1ForCausalLM")
    register("AfmoeForCausalLM", "mrv2_deepseek.afmoe:AfmoeForCausalLM")
    register("YoutuForCausalLM", "mrv2_deepseek.youtu:YoutuForCausalLM")
    register("LongcatFlashForCausalLM", "mrv2_deepseek.longcat:LongcatFlashForCausalLM")
