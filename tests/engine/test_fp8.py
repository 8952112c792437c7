"""FP8 block-quantized weights on the CPU: a checkpoint saved as FP8 checkpoints are published
(e4m3 weights, ``weight_scale_inv`` per block, ``quantization_config``) generates HF's greedy
tokens on the dequantized weights, blocks of 128 over layers narrower than that included; a
bf16 checkpoint with ``quantization="fp8"`` runs quantized; bad quantization configs name the
field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.layers.fp8 import FP8, Fp8LinearMixin, apply_fp8, fp8_config_of
from mrv2.layers.linear import LinearBase
from mrv2.testing import hf_greedy, make_tiny_checkpoint
from mrv2.testing_checkpoints import fp8_checkpoint

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250], [1 + i % 200 for i in range(21)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def _greedy(path: Path, **kwargs: object) -> list[list[int]]:
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(("block", "tied"), [((128, 128), False), ((16, 32), True)])
def test_fp8_checkpoint_matches_hf_on_dequantized_weights(tmp_path: Path,
                                                          block: tuple[int, int],
                                                          tied: bool) -> None:
    """Blocks of 128 cover a whole tiny layer; blocks of 16 x 32 make the fused q/k/v and
    gate/up shards start mid-block of the fused weight (per-row scales place them). ``tied``:
    the LM head is the embedding (Qwen3-0.6B-FP8), one tensor after the meta-device build."""
    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3ForCausalLM", tie_word_embeddings=tied)
    fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "ref", block)
    expected = [hf_greedy(tmp_path / "ref", p, 10) for p in PROMPTS]
    assert _greedy(tmp_path / "fp8") == expected
    assert _greedy(tmp_path / "ref") == expected
    llm = LLM(str(tmp_path / "fp8"), device="cpu", dtype="float32", load_format="dummy")
    model = llm.engine.runner.model
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_quantization_fp8_quantizes_a_bf16_checkpoint(tmp_path: Path) -> None:
    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3ForCausalLM")
    llm = LLM(str(src), device="cpu", dtype="float32", block_size=4, quantization="fp8")
    # on the CPU the quantized weights are dequantized once: the layers are plain again,
    # holding exactly fp8 values times their block scales
    proj = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert type(proj) is not Fp8LinearMixin and isinstance(proj, LinearBase)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 10 for o in outs)


def test_fp8_layers_keep_fp8_weights_through_to_dtype() -> None:
    """``model.to(dtype)`` moves an fp8 layer's weight and fp32 scales without casting."""
    layer = LinearBase(64, 48)
    torch.nn.init.normal_(layer.weight)
    config = fp8_config_of(object(), "fp8")
    assert config is not None
    model = torch.nn.Sequential(layer)
    apply_fp8(model, config, dummy=True)
    fp8 = model[0]
    assert isinstance(fp8, Fp8LinearMixin) and fp8.weight.dtype == FP8
    model.to(torch.bfloat16)
    assert fp8.weight.dtype == FP8 and fp8.weight_scale_inv.dtype == torch.float32


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "bitsandbytes"}, r"quant_method = 'bitsandbytes'"),
    ({"quant_method": "fp8"}, r"weight_block_size = None"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     r"activation_scheme = 'static'"),
])
def test_bad_quantization_config_names_the_field(tmp_path: Path, qc: dict[str, object],
                                                  match: str) -> None:
    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3ForCausalLM")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qc
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        LLM(str(src), device="cpu", dtype="float32")


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization"):
        LLM(device="cpu", quantization="int4")
