"""mrv2 plugin entry point of Nemotron-H and Nemotron-4: registers their architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``NemotronHForCausalLM`` (Nemotron-H 8B/47B, Nemotron Nano 2 9B/12B: Mamba-2, attention
    and MLP layers); it uses the core's default decoder-only ModelState (which allocates the
    Mamba-2 mixers' per-request state); ``NemotronForCausalLM`` (Nemotron-4, Minitron,
    Nemotron-Mini: the dense decoder with ``1 + weight`` LayerNorms, squared-ReLU MLPs and
    partial RoPE)."""
    register("NemotronHForCausalLM", "mrv2_nemotron_h.model:NemotronHForCausalLM")
    register("NemotronForCausalLM", "mrv2_nemotron_h.nemotron:NemotronForCausalLM")
