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


#: The delta-net projections Qwen3.5's quantized checkpoints quantize beside every
#: ``*_proj.weight`` (Qwen3.5-FP8: ``in_proj_qkv`` and ``in_proj_z``; ``in_proj_b`` /
#: ``in_proj_a``, a few rows, stay in bf16).
_QUANTIZED = (".in_proj_qkv.weight", ".in_proj_z.weight")


@pytest.mark.parametrize(("fmt", "variant"), [
    ("fp8", "moe_vl"), ("fp8_ba", "dense"), ("gptq", "dense"), ("awq", "moe"),
    ("compressed_tensors", "dense_vl")])
def test_quantized_checkpoint_matches_hf_on_dequantized_weights(
        tmp_path: Path, fmt: str, variant: str) -> None:
    """A quantized Qwen3.5 checkpoint whose delta-net ``in_proj_qkv`` (one fused tensor, split
    into q, k and v as it loads) and ``in_proj_z`` are quantized with the other projections
    (block FP8 as Qwen publishes Qwen3.5-*-FP8, 16 x 16 blocks here, ``fp8_ba`` with
    ``in_proj_b`` / ``in_proj_a`` too; GPTQ with act-order; AWQ; compressed-tensors): it
    loads, and HF's greedy tokens on the dequantized weights match."""
    from safetensors import safe_open

    from mrv2 import testing_quant
    from mrv2.testing import hf_greedy
    from mrv2.testing_checkpoints import fp8_checkpoint

    save_tiny_qwen3_5(tmp_path / "src", moe=variant.startswith("moe"),
                      conditional=variant.endswith("_vl"))
    src, dst, ref = tmp_path / "src", tmp_path / "q", tmp_path / "ref"
    if fmt.startswith("fp8"):
        also = (*_QUANTIZED, ".in_proj_b.weight", ".in_proj_a.weight") if fmt == "fp8_ba" \
            else _QUANTIZED
        fp8_checkpoint(src, dst, ref, (16, 16), also=also)
    elif fmt == "gptq":
        testing_quant.gptq_checkpoint(src, dst, ref, group_size=16, sym=False, desc_act=True,
                                      also=_QUANTIZED)
    else:
        getattr(testing_quant, f"{fmt}_checkpoint")(src, dst, ref, group_size=16,
                                                    also=_QUANTIZED)
    packed = {"fp8": "weight_scale_inv", "fp8_ba": "weight_scale_inv", "gptq": "qweight",
              "awq": "qweight", "compressed_tensors": "weight_packed"}[fmt]
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    stem = ("model.language_model" if variant.endswith("_vl") else "model") + \
        ".layers.0.linear_attn."
    assert {f"{stem}in_proj_qkv.{packed}", f"{stem}in_proj_z.{packed}"} <= names
    assert (f"{stem}in_proj_b.{packed}" in names) == (fmt == "fp8_ba")

    prompts = PROMPTS[:2]
    want = [hf_greedy(ref, p, 8) for p in prompts]
    llm = LLM(str(dst), device="cpu", dtype="float32", block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_split_rows_refuses_parts_off_the_packed_words() -> None:
    """``in_proj_qkv``'s tensors split by output rows along their own axis (GPTQ's
    ``qweight`` ``[K / 8, N]``, its ``qzeros`` ``[G, N / 8]``; ``g_idx`` whole to each part);
    a part that would end inside a packed word or a scale block is refused naming the
    tensor."""
    from mrv2_qwen.qwen3_5 import split_rows

    parts = split_rows("l.in_proj_qkv.qzeros", torch.arange(12).view(2, 6), [16, 16, 16])
    assert [tuple(p.shape) for p in parts] == [(2, 2)] * 3
    assert [tuple(p.shape) for p in split_rows("l.in_proj_qkv.qweight", torch.ones(8, 48),
                                               [16, 16, 16])] == [(8, 16)] * 3
    g_idx = torch.arange(64)
    assert all(p is g_idx for p in split_rows("l.in_proj_qkv.g_idx", g_idx, [16, 16, 16]))
    with pytest.raises(ValueError, match=r"l\.in_proj_qkv\.weight_scale_inv: \(3, 2\) does "
                                         r"not split into parts of \[8, 8, 32\] output rows"):
        split_rows("l.in_proj_qkv.weight_scale_inv", torch.ones(3, 2), [8, 8, 32])


@pytest.mark.parametrize(("variant", "tp"), [("dense", 1), ("moe_vl", 2)])
def test_lora_on_the_delta_net_and_attention_matches_merged(tmp_path: Path, variant: str,
                                                            tp: int) -> None:
    """A LoRA adapter on every Gated DeltaNet projection as Qwen3.5 names them
    (``in_proj_qkv``: shards q, k, v of the fused ``in_proj_qkvz``; ``in_proj_z``;
    ``in_proj_b`` / ``in_proj_a`` of ``in_proj_ba``; ``out_proj``) and on the gated
    attention's ``q_proj`` / ``o_proj``: greedy tokens equal HF's on the adapter merged into
    the base (``moe_vl``: the vision-language MoE checkpoint over two ranks, each its rows of
    every shard)."""
    from mrv2_qwen.testing import lora_against_merged

    save_tiny_qwen3_5(tmp_path / "base", moe=variant.startswith("moe"),
                      conditional=variant.endswith("_vl"))
    got, want, plain = lora_against_merged(
        tmp_path / "base", tmp_path, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                      "out_proj", "q_proj", "o_proj"),
        PROMPTS[:2], tensor_parallel_size=tp)
    assert want != plain  # (the adapter changes the tokens)
    assert got == want
