"""mrv2 plugin entry point of the Llama models: registers the architecture, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``LlamaForCausalLM`` (Llama 2/3, SmolLM2...) with its ModelState, and ``MistralForCausalLM``
    (Mistral 7B, Mistral-Nemo, Ministral...: Llama's layers, the config's ``sliding_window`` on
    every layer where it is set), ``MixtralForCausalLM`` (its layers with routed experts),
    ``SmolLM3ForCausalLM`` (NoPE layers), ``GraniteForCausalLM`` (its four multipliers;
    ``GraniteSWAForCausalLM``: with sliding-window layers, attention sinks and a RoPE base per
    layer), ``SeedOssForCausalLM`` (Llama's decoder, the output projection's bias set apart),
    ``MinistralForCausalLM`` (Llama's decoder, ``layer_types``' sliding and full layers), and
    the variants of :mod:`mrv2_llama.variants`: ``ArceeForCausalLM`` (squared-ReLU dense MLPs),
    ``Jais2ForCausalLM`` (Arcee's layers under biased LayerNorms),
    ``ApertusForCausalLM`` (xIELU dense MLPs, q/k norms), ``HeliumForCausalLM`` (interleaved
    RoPE), ``Ministral3ForCausalLM`` (queries scaled by position); and
    ``NanoChatForCausalLM`` (:mod:`mrv2_llama.nanochat`: weightless norms, RoPE the other way,
    soft-capped logits)."""
    for arch in ("LlamaForCausalLM", "MistralForCausalLM"):
        register(arch, "mrv2_llama.model:LlamaForCausalLM",
                 model_state="mrv2_llama.state:LlamaModelState")
    register("MixtralForCausalLM", "mrv2_llama.mixtral:MixtralForCausalLM")
    register("SmolLM3ForCausalLM", "mrv2_llama.model:SmolLM3ForCausalLM")
    register("GraniteForCausalLM", "mrv2_llama.granite:GraniteForCausalLM")
    register("GraniteSWAForCausalLM", "mrv2_llama.granite:GraniteSWAForCausalLM")
    register("SeedOssForCausalLM", "mrv2_llama.model:LlamaForCausalLM")
    register("MinistralForCausalLM", "mrv2_llama.model:LlamaForCausalLM")
    for arch in ("ArceeForCausalLM", "ApertusForCausalLM", "HeliumForCausalLM",
                 "Ministral3ForCausalLM", "Jais2ForCausalLM"):
        register(arch, f"mrv2_llama.variants:{arch}")
    register("NanoChatForCausalLM", "mrv2_llama.nanochat:NanoChatForCausalLM")
