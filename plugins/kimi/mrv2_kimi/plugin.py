"""mrv2 plugin entry point of the Kimi-Linear family: registers its architecture, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """Kimi-Linear (``KimiLinearForCausalLM``: Kimi Delta Attention + MLA without RoPE + MoE);
    the core's default decoder-only ModelState serves it (its per-request KDA state
    included), and the core's ``mla`` backend its latent KV cache."""
    register("KimiLinearForCausalLM", "mrv2_kimi.model:KimiLinearForCausalLM")
