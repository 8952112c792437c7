"""Step-3.7's block-FP8 checkpoints (as Step-3.5-Flash-FP8 is published: the stacked routed
experts ``moe.{gate,up,down}_proj.weight`` ``[E, N, K]`` in e4m3 with stacked
``weight_scale_inv`` ``[E, ceil(N/bn), ceil(K/bk)]``, the attention, ``g_proj`` and shared
expert per layer; the router in fp32) through the engine on the CPU against HF on the
dequantized checkpoint, the MTP layers' too; a quantized router refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from safetensors import safe_open

from mrv2 import LLM, SamplingParams
from mrv2.plugins import get_plugin_manager
from mrv2.testing_checkpoints import fp8_checkpoint
from mrv2_step.testing import (
    hf_greedy_step3p7,
    make_mtp_layers_agree,
    save_tiny_step3p7,
    save_tiny_step3p7_mtp,
)

#: The third is longer than the sliding window (8).
PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [2 + (7 * i) % 120 for i in range(23)]]
#: Step's stacked expert weights, quantized expert by expert and saved stacked.
STACKED = (".moe.gate_proj.weight", ".moe.up_proj.weight", ".moe.down_proj.weight")


@pytest.fixture(autouse=True)
def _registered() -> None:
    """The plugin's registration where it is not installed (its entry point then loads it)."""
    manager = get_plugin_manager()
    if not manager.pm.has_plugin("step"):
        import mrv2_step.plugin

        manager.register(mrv2_step.plugin, name="step")


@pytest.mark.parametrize(("block", "mtp"), [((16, 16), False), ((128, 128), False),
                                           ((16, 16), True)], ids=["16x16", "128x128", "mtp"])
def test_fp8_stacked_experts_match_hf_dequantized(tmp_path: Path, block: tuple[int, int],
                                                   mtp: bool) -> None:
    """Greedy tokens of several requests are HF's on the dequantized checkpoint: the
    stacked expert scales split per expert (MoE layers 1-3, layer 3's experts clamped), the
    attention, ``g_proj`` (4 rows: a partial block) and the shared expert in FP8; blocks
    smaller than the layers or larger than every one (the published 128 x 128); with MTP
    layers (a dense one, one with stacked FP8 experts: quantized as the main layers) drafting
    two tokens a step, accepted at times."""
    src = tmp_path / "src"
    if mtp:
        save_tiny_step3p7_mtp(src, [("sliding_attention", "dense"), ("full_attention", "sparse")])
        make_mtp_layers_agree(src, scale=300.0)
    else:
        save_tiny_step3p7(src)
    fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", block, stacked=STACKED,
                   keep=("vision_model.", "vit_large_projector."))
    with safe_open(str(tmp_path / "fp8" / "model.safetensors"), "pt") as f:
        names = set(f.keys())  # noqa: SIM118 (safe_open is no mapping)
        scale = f.get_slice("model.layers.1.moe.gate_proj.weight_scale_inv").get_shape()
        assert scale == [4, -(-32 // block[0]), -(-64 // block[1])]  # stacked per layer
        assert "model.layers.1.self_attn.g_proj.weight_scale_inv" in names
        assert not mtp or "model.layers.5.moe.down_proj.weight_scale_inv" in names
    want = hf_greedy_step3p7(tmp_path / "ref", PROMPTS, 6)
    kwargs: dict[str, Any] = (
        {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}} if mtp else {})
    llm = LLM(str(tmp_path / "fp8"), device="cpu", dtype="float32", block_size=4, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    if mtp:
        assert llm.engine.stats()["spec_num_accepted_tokens"] > 0


def test_fp8_router_refused(tmp_path: Path) -> None:
    """A checkpoint whose MoE router is fp8 (``moe.gate.weight`` with a scale) is refused
    naming ``quantization_config`` and the tensor, before anything loads (the router runs
    in fp32)."""
    save_tiny_step3p7(tmp_path / "src")
    fp8_checkpoint(tmp_path / "src", tmp_path / "fp8", tmp_path / "ref", (16, 16),
                   also=(".moe.gate.weight",), stacked=STACKED,
                   keep=("vision_model.", "vit_large_projector."))
    with pytest.raises(ValueError, match=r"quantization_config.*moe\.gate\.weight_scale_inv"):
        LLM(str(tmp_path / "fp8"), device="cpu", dtype="float32", block_size=4)
