"""mrv2 plugin entry point of BigCode's code models: registers their architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``Starcoder2ForCausalLM`` (StarCoder2 3B / 7B / 15B: GQA, RoPE, a sliding window on
    every layer) and ``GPTBigCodeForCausalLM`` (StarCoder, StarCoderBase, SantaCoder,
    WizardCoder...: multi-query attention, learned absolute position embeddings); they use the
    core's default decoder-only ModelState."""
    register("Starcoder2ForCausalLM", "mrv2_starcoder.model:Starcoder2ForCausalLM")
    register("GPTBigCodeForCausalLM", "mrv2_starcoder.gpt_bigcode:GPTBigCodeForCausalLM")
