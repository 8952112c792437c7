"""mrv2 plugin entry point of IBM's Granite MoE / 4.0-H and Bamba: registers their
architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``GraniteMoeHybridForCausalLM`` (Granite 4.0-H Micro / Tiny / Small: Mamba-2 and attention
    layers, MoE or dense), ``BambaForCausalLM``, and Granite 3.x's attention-only
    ``GraniteMoeForCausalLM`` / ``GraniteMoeSharedForCausalLM`` (routed experts, plus a shared
    one) / ``GraniteMoeSWAForCausalLM`` (with sliding-window layers and attention sinks); all
    use the core's default decoder-only ModelState (which allocates the Mamba-2 mixers'
    per-request state)."""
    register("GraniteMoeHybridForCausalLM",
             "mrv2_granite_hybrid.model:GraniteMoeHybridForCausalLM")
    register("BambaForCausalLM", "mrv2_granite_hybrid.model:BambaForCausalLM")
    register("GraniteMoeForCausalLM", "mrv2_granite_hybrid.granite_moe:GraniteMoeForCausalLM")
    register("GraniteMoeSharedForCausalLM",
             "mrv2_granite_hybrid.granite_moe:GraniteMoeSharedForCausalLM")
    register("GraniteMoeSWAForCausalLM",
             "mrv2_granite_hybrid.granite_moe:GraniteMoeSWAForCausalLM")
