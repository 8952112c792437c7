"""mrv2 plugin entry point of LFM2: registers its architecture, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``Lfm2ForCausalLM`` (LFM2-350M / 700M / 1.2B / 2.6B: short gated convolution and
    attention layers); it uses the core's default decoder-only ModelState (which allocates
    the convolution layers' per-request state)."""
    register("Lfm2ForCausalLM", "mrv2_lfm2.model:Lfm2ForCausalLM")
