"""mrv2 plugin entry point of Mamba-2: registers its architecture, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``Mamba2ForCausalLM`` (Mamba-Codestral-7B, state-spaces mamba2-*: Mamba-2 layers only);
    it uses the core's default decoder-only ModelState, which allocates the mixers'
    per-request state, and declares no KV cache layer (the blocks are bookkeeping only)."""
    register("Mamba2ForCausalLM", "mrv2_mamba.model:Mamba2ForCausalLM")
