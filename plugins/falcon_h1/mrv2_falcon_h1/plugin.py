"""mrv2 plugin entry point of Falcon-H1: registers its architecture, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``FalconH1ForCausalLM`` (Falcon-H1 0.5B / 1.5B / 1.5B-Deep / 3B / 7B / 34B: attention
    and a Mamba-2 mixer in parallel in every layer); it uses the core's default decoder-only
    ModelState (which allocates the Mamba-2 mixers' per-request state)."""
    register("FalconH1ForCausalLM", "mrv2_falcon_h1.model:FalconH1ForCausalLM")
