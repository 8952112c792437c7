"""mrv2 plugin entry point of the Mamba families (Mamba-2, Mamba-1, FalconMamba, Jamba,
Zamba2):
registers their architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``Mamba2ForCausalLM`` (Mamba-Codestral-7B, state-spaces mamba2-*: Mamba-2 layers only);
    it uses the core's default decoder-only ModelState, which allocates the mixers'
    per-request state, and declares no KV cache layer (the blocks are bookkeeping only)."""
    register("Mamba2ForCausalLM", "mrv2_mamba.model:Mamba2ForCausalLM")
    # Mamba-1 mixers (the core's Mamba1Mixer): state-spaces mamba-*-hf and Falcon-Mamba (no
    # KV cache layer, as Mamba-2), and Jamba (Mamba-1 layers, attention layers, MoE)
    register("MambaForCausalLM", "mrv2_mamba.mamba1:MambaForCausalLM")
    register("FalconMambaForCausalLM", "mrv2_mamba.mamba1:FalconMambaForCausalLM")
    register("JambaForCausalLM", "mrv2_mamba.jamba:JambaForCausalLM")
    # Zamba2: Mamba-2 layers and shared attention blocks, a KV cache layer per invocation
    register("Zamba2ForCausalLM", "mrv2_mamba.zamba2:Zamba2ForCausalLM")
