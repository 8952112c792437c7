"""Qwen3.5 (Qwen3-Next's hybrid with its projections laid out by kind, a dense MLP or the
experts on every layer, text M-RoPE) through the engine against HF transformers: dense and MoE,
causal-LM and vision-language checkpoints (text prompts here; images in test_qwen3_5_vl.py),
greedy tokens of several requests at once (HF's full forward per token) and every prompt position's
log-probability, with the whole prompts in one step through the chunked delta rule or split
across steps."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.config import EngineConfig
from mrv2.layers import MoEBlock
from mrv2.layers.linear import MergedColumnLinear
from mrv2.testing_engine import check_prompt_logprobs, tokens_at_tp
from mrv2_qwen.qwen3_5 import Qwen3_5GatedDeltaNet, Qwen3_5TextOnlyInputs
from mrv2_qwen.testing import save_tiny_qwen3_5

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 120], [1 + (7 * i) % 120 for i in range(29)]]


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
@pytest.mark.parametrize("variant", ["dense", "moe", "dense_vl", "moe_vl"])
def test_greedy_and_logprobs_match_hf(tmp_path: Path, variant: str, chunked: bool,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``whole``: every prompt in the first step, the 29-token one through the chunked delta
    rule (its threshold lowered); ``chunked``: prompts split across steps of 8 tokens (the
    recurrent and convolution states carried between them). The vision-language checkpoints
    (their vision tower loaded too) serve text prompts alike."""
    from mrv2_kernels import chunk_delta_rule

    monkeypatch.setattr(chunk_delta_rule, "CHUNKED_MIN_QUERY_LEN_DELTA", 16)
    hf = save_tiny_qwen3_5(tmp_path, moe=variant.startswith("moe"),
                           conditional=variant.endswith("_vl"))
    want = [_hf_greedy(hf, p, 10) for p in PROMPTS]
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4,
              **({"max_num_batched_tokens": 8} if chunked else {}))
    model = llm.engine.runner.model
    deltas = [m for m in model.modules() if isinstance(m, Qwen3_5GatedDeltaNet)]
    assert len(deltas) == 3 and isinstance(deltas[0].in_proj_qkvz, MergedColumnLinear)
    moe = [m for m in model.modules() if isinstance(m, MoEBlock)]
    assert len(moe) == (4 if variant.startswith("moe") else 0)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want

    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    check_prompt_logprobs(llm, {"prompt_token_ids": ids}, ids, logits)


def test_without_the_vl_plugin_images_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ``mrv2-plugin-qwen-vl`` is not installed, the vision-language checkpoints
    register as text-only models whose input processor refuses media before any work,
    naming ``multi_modal_data`` and the plugin to install; where it is, they register with
    its model state and input processor."""
    import importlib.util

    from mrv2_qwen import plugin

    def registered(installed: bool) -> dict[str, tuple[str, dict[str, str]]]:
        found = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
            found(name, *a) if installed or name != "mrv2_qwen_vl" else None))
        table: dict[str, tuple[str, dict[str, str]]] = {}
        plugin.mrv2_register_models(lambda arch, model, **kw: table.__setitem__(
            arch, (model, kw)))
        monkeypatch.undo()
        return table

    with_vl, without = registered(True), registered(False)
    for arch in ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"):
        assert with_vl[arch] == (
            "mrv2_qwen.qwen3_5_vl:Qwen3_5VLForConditionalGeneration",
            {"model_state": "mrv2_qwen_vl.model_state:Qwen3VLModelState",
             "input_processor": "mrv2_qwen_vl.processor:QwenVLInputProcessor"})
        assert without[arch] == (f"mrv2_qwen.qwen3_5:{arch}", {
            "input_processor": "mrv2_qwen.qwen3_5:Qwen3_5TextOnlyInputs"})
    hf_config = SimpleNamespace(architectures=["Qwen3_5MoeForConditionalGeneration"])
    processor = Qwen3_5TextOnlyInputs("", hf_config, None, EngineConfig())
    with pytest.raises(ValueError, match=r"multi_modal_data \(image, video\): "
                                         r"Qwen3_5MoeForConditionalGeneration takes images and "
                                         r"videos where mrv2-plugin-qwen-vl is installed"):
        processor.process([1, 2], {"video": [], "image": []})


def test_tensor_parallel_matches_hf(tmp_path: Path) -> None:
    """Two ranks (processes on the CPU) of the vision-language MoE checkpoint: each holds its
    heads' rows of every shard of the fused projections (q, k, v, z; b, a), one key-head group
    of conv channels, decays and states, half the attention heads and of each expert; greedy
    tokens equal HF's, prompts split across steps."""
    hf = save_tiny_qwen3_5(tmp_path, moe=True, conditional=True)
    want = [_hf_greedy(hf, p, 8) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for tp, got in tokens_at_tp(tmp_path, PROMPTS, params, (2,),
                                max_num_batched_tokens=8).items():
        assert got == want, tp
