"""GPU: Gemma 4's text decoder (per-layer embeddings, KV sharing, keys as values, proportional
RoPE, soft-capped logits; and the MoE block on the fused kernels' GeGLU) through the engine
with CUDA graphs and the Triton kernels: fp32 greedy tokens are HF's, graphs on and off; bf16
graphs on and off agree. Prompts and outputs run past the local window.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.testing import redraw_weights

pytestmark = pytest.mark.gpu

S, F = "sliding_attention", "full_attention"
PROMPTS = [[5, 17, 42, 9, 100, 3, 77] * 6, [8, 8, 250], [1 + i % 200 for i in range(97)], [64]]
BASE: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "global_head_dim": 64, "num_hidden_layers": 6,
    "layer_types": [S, S, F, S, S, F], "sliding_window": 24, "max_position_embeddings": 512,
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 256,
    "num_kv_shared_layers": 2, "attention_k_eq_v": True, "num_global_key_value_heads": 1,
    "use_double_wide_mlp": True, "final_logit_softcapping": 30.0, "eos_token_id": 1,
    "bos_token_id": 2}
MOE: dict[str, Any] = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2,
                       "moe_intermediate_size": 64}


def _checkpoint(path: Path, **extra: Any) -> Any:
    config = transformers.Gemma4TextConfig(**{**BASE, **extra})
    config.architectures = ["Gemma4ForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.Gemma4ForCausalLM(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(path)
    return hf


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return [int(t) for t in out[0, len(prompt):]]


def _generate(path: Path, dtype: str, **kwargs: Any) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, max_num_batched_tokens=64, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("moe", [False, True])
def test_gemma4_with_graphs(tmp_path: Path, moe: bool) -> None:
    hf = _checkpoint(tmp_path, **(MOE if moe else {}))
    expected = [_hf_greedy(hf, p, 40) for p in PROMPTS]
    assert _generate(tmp_path, "float32") == expected
    assert _generate(tmp_path, "float32", enforce_eager=True) == expected
    graphs = _generate(tmp_path, "bfloat16")
    eager = _generate(tmp_path, "bfloat16", enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]


def test_gemma4_images_with_graphs(tmp_path: Path) -> None:
    """Images (aspect ratios giving different soft-token counts, two in a prompt) beside text
    prompts, chunked prefill whose budget would end steps inside images: fp32 greedy tokens
    are HF's (``mm_token_type_ids``: two-way attention on the sliding layers), graphs on and
    off."""
    from mrv2.testing import random_image

    image_token, boi, eoi = 250, 251, 252
    text = {**BASE, "use_bidirectional_attention": "vision", "pad_token_id": 0}
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32,
              "patch_size": 4, "pooling_kernel_size": 2, "position_embedding_size": 64}
    config = transformers.Gemma4Config(
        text_config=text, vision_config=vision, audio_config=None, image_token_id=image_token,
        boi_token_id=boi, eoi_token_id=eoi, video_token_id=253, audio_token_id=254,
        boa_token_id=255, eoa_token_index=249)
    config.architectures = ["Gemma4ForConditionalGeneration"]
    torch.manual_seed(0)
    hf = transformers.Gemma4ForConditionalGeneration(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(tmp_path)
    transformers.Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70,
                                         pooling_kernel_size=2).save_pretrained(tmp_path)
    a, b = random_image(40, 24, seed=1), random_image(32, 32, seed=2)
    requests = [{"prompt_token_ids": [5, 17, image_token, 9] * 2,
                 "multi_modal_data": {"image": [a, b]}},
                {"prompt_token_ids": [image_token, 64, 8], "multi_modal_data": {"image": [a]}},
                {"prompt_token_ids": PROMPTS[2]}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = []
    for eager in (False, True):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", block_size=16,
                  gpu_memory_utilization=0.3, max_num_batched_tokens=96, enforce_eager=eager)
        if not got:
            expected = []
            hf.generation_config.eos_token_id = None
            for request in requests:
                ids, items = llm.engine.input_processor.process(
                    request["prompt_token_ids"], request.get("multi_modal_data", {}))
                kwargs: dict[str, Any] = {}
                if items:
                    kwargs = {
                        "pixel_values": torch.stack([i.data["pixel_values"] for i in items]),
                        "image_position_ids": torch.stack([i.data["position_ids"]
                                                           for i in items]),
                        "mm_token_type_ids": (torch.tensor([ids]) == image_token).long()}
                with torch.no_grad():
                    out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                                      max_new_tokens=24, do_sample=False, **kwargs)
                expected.append([int(t) for t in out[0, len(ids):]])
        outs = llm.generate(requests, params, use_tqdm=False)
        llm.shutdown()
        got.append([o.outputs[0].token_ids for o in outs])
    assert got[0] == expected and got[1] == expected
