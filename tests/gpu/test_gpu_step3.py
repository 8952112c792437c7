"""GPU: Step-3.7's text decoder (``Step3p7ForConditionalGeneration``: gated grouped-query
attention, sliding layers with their own head count and full RoPE beside full layers with
partial RoPE, sigmoid-routed and clamped experts with a shared expert) through the engine on
the Triton kernels: fp32 greedy tokens are HF's with CUDA graphs and without, prompts split
across steps and requests preempted; bf16 graphs on and off agree and mostly start with HF's
tokens; a step never synchronizes. Images (the 2-D RoPE tower over each image's crops and
global view, HF's ``<patch_start>`` / ``<im_start>`` layout): fp32 greedy tokens and prompt
log-probabilities (image rows included) are HF's with graphs on and off, images split across
steps, beside a text prompt past the window; HF is fed the engine's own pixels (the image
processor is checked against HF's plan on the CPU).

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mrv2 import LLM, EngineConfig, Runner, SamplingParams
from mrv2.testing import random_image, run_steps_without_sync

pytestmark = pytest.mark.gpu

#: Two prompts longer than the sliding window (32), one of several windows.
PROMPTS = [[5, 17, 42, 9, 100, 3, 77] * 6, [8, 8, 120], [2 + (7 * i) % 120 for i in range(97)],
           [64], [2 + (11 * i + 3) % 120 for i in range(130)]]
#: The published head size (128), half of it rotated on the full layers; few heads, a window
#: short enough for the prompts to cross it; every MoE layer's experts clamped.
ARCH = {"hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "share_expert_dim": 128, "head_dim": 128, "num_attention_heads": 2,
        "num_sliding_attention_heads": 4, "num_key_value_heads": 1, "sliding_window": 32,
        "query_pre_attn_scalar": 128, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "swiglu_limits": [0, 3.0, 3.0, 3.0], "swiglu_limits_shared": [0, 0, 0, 4.0]}


@pytest.fixture(autouse=True)
def _registered() -> None:
    """The plugin's registration where it is not installed (its entry point then loads it)."""
    from mrv2.plugins import get_plugin_manager

    manager = get_plugin_manager()
    if not manager.pm.has_plugin("step"):
        import mrv2_step.plugin

        manager.register(mrv2_step.plugin, name="step")


def _save(path: Path) -> None:
    from mrv2_step.testing import save_tiny_step3p7

    save_tiny_step3p7(path, **ARCH)


def _generate(path: Path, dtype: str, **kwargs: object) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def test_step3p7_with_graphs(tmp_path: Path) -> None:
    """fp32: HF's greedy tokens in graphs, eager, with prompts split across steps and with
    preemption; bf16: graphs and eager agree on the first tokens, which mostly equal HF's."""
    from mrv2_step.testing import hf_greedy_step3p7

    _save(tmp_path)
    # (HF's reference on the CPU: HF's own CUDA run parted from its CPU run at the 24th token
    # of the first prompt by a margin of 1.5, where the engine on CUDA kept the CPU's tokens)
    expected = hf_greedy_step3p7(tmp_path, PROMPTS, 40)
    assert _generate(tmp_path, "float32") == expected
    assert _generate(tmp_path, "float32", enforce_eager=True) == expected
    assert _generate(tmp_path, "float32", max_num_batched_tokens=32) == expected
    assert _generate(tmp_path, "float32", num_gpu_blocks_override=24) == expected
    graphs = _generate(tmp_path, "bfloat16")
    eager = _generate(tmp_path, "bfloat16", enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
    assert sum(g[0] == e[0] for g, e in zip(graphs, expected, strict=True)) >= len(PROMPTS) - 1


def test_step3p7_steps_never_synchronize(tmp_path: Path) -> None:
    _save(tmp_path)
    config = EngineConfig.from_kwargs(model=str(tmp_path), device="cuda", dtype="bfloat16",
                                      gpu_memory_utilization=0.3)
    runner = Runner.from_config(config)
    assert runner.graphs is not None
    assert run_steps_without_sync(runner, PROMPTS)
    runner.shutdown()


def _image_inputs(items: list[Any]) -> dict[str, Any]:
    """HF's image arguments for the engine's items (its pixels, on the CPU)."""
    if not items:
        return {}
    crops = torch.cat([item.data["pixel_values_local"] for item in items]).cpu()
    return {"pixel_values": torch.cat([item.data["pixel_values"] for item in items]).cpu(),
            "pixel_values_local": crops if crops.shape[0] else None,
            "num_local_patches": [item.data["pixel_values_local"].shape[0] for item in items]}


def test_step3p7_images_fp32_graphs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32, graphs on and off, steps of 32 tokens: HF's greedy tokens for two prompts with
    images (3 x 2 crops and a newline; no crops) and a text prompt; the two-image prompt's
    log-probabilities (image rows included) within 2e-3 of HF's forward (on the CPU; the
    tower's convolutions without cuDNN's TF32, torch's default, which put an image row 7e-3
    off)."""
    from mrv2_step.testing import save_tiny_step3p7_vl

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model, patch = save_tiny_step3p7_vl(tmp_path, **ARCH)
    hf: Any = model.eval()
    hf.generation_config.eos_token_id = None
    a, b = random_image(168, 336, seed=1), random_image(130, 120, seed=2)
    requests: list[dict[str, Any]] = [
        {"prompt_token_ids": [5, 17, patch, 9, 3, patch, 7], "multi_modal_data": {"image": [a, b]}},
        {"prompt_token_ids": [patch, 64, 8], "multi_modal_data": {"image": [a]}},
        {"prompt_token_ids": PROMPTS[2]}]
    for eager in (False, True):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", block_size=16,
                  gpu_memory_utilization=0.3, max_num_batched_tokens=32, enforce_eager=eager)
        processor = llm.engine.input_processor
        assert processor is not None
        expanded = [processor.process(r["prompt_token_ids"],
                                      {"image": r.get("multi_modal_data", {}).get("image", [])})
                    for r in requests]
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        got = [list(o.outputs[0].token_ids)
               for o in llm.generate(requests, params, use_tqdm=False)]
        lp = llm.generate([requests[0]], SamplingParams(max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)[0].prompt_logprobs
        llm.shutdown()
        want = []
        for ids, items in expanded:
            with torch.no_grad():
                out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                  max_new_tokens=16, do_sample=False, **_image_inputs(items))
            want.append([int(t) for t in out[0, len(ids):]])
        assert got == want, eager
        ids, items = expanded[0]
        assert len(ids) > 32  # (split across steps)
        with torch.no_grad():
            logits = hf(torch.tensor([ids]), **_image_inputs(items)).logits[0]
        ref = torch.log_softmax(logits.float(), dim=-1)
        assert lp is not None and len(lp) == len(ids)
        for pos in range(1, len(ids)):
            mine = lp[pos]
            assert mine is not None
            assert mine[ids[pos]].logprob == pytest.approx(float(ref[pos - 1, ids[pos]]),
                                                           abs=2e-3), (eager, pos)


def test_step3p7_mtp_speculation_with_graphs(tmp_path: Path) -> None:
    """fp32, CUDA graphs on (the drafting steps' too): greedy tokens with the checkpoint's
    two MTP layers drafting two tokens a step (a sliding dense layer, then a full one with
    the experts), prompts split across steps or not, are those without speculation; drafts
    are accepted (MTP layers made to agree with the model about half the time) and
    rejected."""
    from mrv2_step.testing import make_mtp_layers_agree, save_tiny_step3p7_mtp

    save_tiny_step3p7_mtp(tmp_path, [("sliding_attention", "dense"),
                                     ("full_attention", "sparse")], **ARCH)
    make_mtp_layers_agree(tmp_path, scale=2000.0)
    plain = _generate(tmp_path, "float32")
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    for chunk in (None, 32):
        kwargs: dict[str, Any] = {} if chunk is None else {"max_num_batched_tokens": chunk}
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", block_size=16,
                  gpu_memory_utilization=0.3, speculative_config=spec, **kwargs)
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        stats = llm.engine.stats()
        graphs = llm.engine.runner.graphs
        assert graphs is not None and graphs.draft_graphs
        llm.shutdown()
        assert [o.outputs[0].token_ids for o in outs] == plain, chunk
        assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats


def test_step3p7_fp8_checkpoint(tmp_path: Path) -> None:
    """Block FP8 as Step-3.5-Flash-FP8 is published (128 x 128 blocks; the routed experts
    stacked per layer with stacked ``weight_scale_inv``, split per expert as they load): the
    experts run on the fused MoE's FP8 path and the projections on the FP8 GEMM; in bf16
    (activations quantized per token group) graphs on and off agree and start with HF's
    greedy tokens on the dequantized checkpoint."""
    from mrv2.layers.fp8 import Fp8FusedMoE, Fp8LinearMixin
    from mrv2.testing_checkpoints import fp8_checkpoint
    from mrv2_step.testing import hf_greedy_step3p7

    src, fp8, ref = tmp_path / "src", tmp_path / "fp8", tmp_path / "ref"
    _save(src)
    fp8_checkpoint(src, fp8, ref, stacked=(".moe.gate_proj.weight", ".moe.up_proj.weight",
                                           ".moe.down_proj.weight"),
                   keep=("vision_model.", "vit_large_projector."))
    expected = hf_greedy_step3p7(ref, PROMPTS, 40)  # (HF on the CPU, as above)
    llm = LLM(str(fp8), device="cuda", dtype="bfloat16", block_size=16,
              gpu_memory_utilization=0.3)
    modules = list(llm.engine.runner.model.modules())
    assert sum(isinstance(m, Fp8FusedMoE) for m in modules) == 3  # layers 1-3
    assert all(isinstance(m.g_proj, Fp8LinearMixin) for m in modules if hasattr(m, "g_proj"))
    llm.shutdown()
    del llm  # (its KV cache counts as in use for the next engine's budget until freed)
    graphs = _generate(fp8, "bfloat16")
    eager = _generate(fp8, "bfloat16", enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
    assert sum(g[0] == e[0] for g, e in zip(graphs, expected, strict=True)) >= len(PROMPTS) - 1
