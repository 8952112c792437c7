"""mrv2 plugin entry point of LFM2: registers its architectures, lazily."""

from collections.abc import Callable

from mrv2 import hookimpl


@hookimpl
def mrv2_register_models(register: Callable[..., None]) -> None:
    """``Lfm2ForCausalLM`` (LFM2-350M / 700M / 1.2B / 2.6B: short gated convolution and
    attention layers) and ``Lfm2MoeForCausalLM`` (LFM2-8B-A1B: the same layers, sparse MoE
    feed-forwards after the first ``num_dense_layers``); they use the core's default
    decoder-only ModelState (which allocates the convolution layers' per-request state)."""
    register("Lfm2ForCausalLM", "mrv2_lfm2.model:Lfm2ForCausalLM")
    register("Lfm2MoeForCausalLM", "mrv2_lfm2.moe:Lfm2MoeForCausalLM")
    # LFM2-VL (450M / 1.6B / 3B): a SigLIP2 NaFlex tower, the pixel-unshuffle projector and
    # LFM2's decoder, with its model state (the encoder cache, each step's image rows, the
    # convolution state) and input processor (HF's tiles and thumbnail, its prompt layout)
    register("Lfm2VlForConditionalGeneration", "mrv2_lfm2.vl:Lfm2VlForConditionalGeneration",
             model_state="mrv2_lfm2.vl_inputs:Lfm2VlModelState",
             input_processor="mrv2_lfm2.vl_inputs:Lfm2VlInputProcessor")
