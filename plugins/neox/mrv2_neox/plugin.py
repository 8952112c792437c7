"""mrv2 plugin entry point of the GPT-NeoX, GPT-J and StableLM families: registers their
architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``GPTNeoXForCausalLM`` (Pythia 70M-12B, GPT-NeoX-20B and their fine-tunes),
    ``GPTJForCausalLM`` (GPT-J-6B and its fine-tunes) and ``StableLmForCausalLM`` (StableLM-2
    1.6B / 12B, StableLM-3B-4E1T, StableCode); they use the core's default decoder-only
    ModelState."""
    register("GPTNeoXForCausalLM", "mrv2_neox.model:GPTNeoXForCausalLM")
    register("GPTJForCausalLM", "mrv2_neox.gptj:GPTJForCausalLM")
    register("StableLmForCausalLM", "mrv2_neox.model:StableLmForCausalLM")
