"""GPU: FP8 linear layers (block-FP8 GEMM) and DeepSeek's MLA (Triton latent-cache kernels;
Youtu-LLM's too) through the engine with CUDA graphs.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from mrv2 import LLM, SamplingParams
from mrv2.layers.fp8 import FP8, Fp8LinearMixin, apply_fp8, fp8_config_of
from mrv2.layers.linear import LinearBase
from mrv2.testing import hf_greedy, make_tiny_checkpoint, redraw_weights
from mrv2.testing_checkpoints import fp8_checkpoint

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250], [1 + i % 200 for i in range(37)], [64],
           [3, 1, 4, 1, 5]]
ARCH = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64}


def _generate(path: Path, dtype: str, **kwargs: object) -> list[list[int]]:
    llm = LLM(str(path), device="cuda", dtype=dtype, block_size=16,
              gpu_memory_utilization=0.3, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_fp8_linear_layer_close_to_its_dequantized_weight() -> None:
    torch.manual_seed(0)
    layer = LinearBase(1024, 768, bias=True).cuda().to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight, std=0.02)
    torch.nn.init.normal_(layer.bias, std=0.02)
    config = fp8_config_of(object(), "fp8")
    assert config is not None
    model = torch.nn.Sequential(layer)
    apply_fp8(model, config, dummy=False)
    fp8 = model[0]
    assert isinstance(fp8, Fp8LinearMixin)
    fp8.process_weights_after_loading()
    assert fp8.weight.dtype == FP8
    for rows in (1, 7, 300):
        x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ fp8.dequantized(torch.float32).t() + fp8.bias.float()
        got = fp8(x).float()
        assert (got - want).norm() / want.norm() < 0.05


def test_fp8_checkpoint_with_graphs(tmp_path: Path) -> None:
    """Activations are quantized too, so tokens may part from HF's on the dequantized weights
    late; the first ones agree, graphs on and off agree."""
    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3ForCausalLM", **ARCH)
    fp8_checkpoint(src, tmp_path / "fp8", tmp_path / "ref")
    expected = [hf_greedy(tmp_path / "ref", p, 16) for p in PROMPTS]
    graphs = _generate(tmp_path / "fp8", "bfloat16")
    eager = _generate(tmp_path / "fp8", "bfloat16", enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
    agree = sum(g[0] == e[0] for g, e in zip(graphs, expected, strict=True))
    assert agree >= len(PROMPTS) - 1


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("deepseek")
    config = transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=96,
        kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=512,
        tie_word_embeddings=False)
    config.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    redraw_weights(hf)
    hf.save_pretrained(path)
    return path


def test_mla_fp32_greedy_matches_hf_with_graphs_on_and_off(deepseek: Path) -> None:
    expected = [hf_greedy(deepseek, p, 16) for p in PROMPTS]
    assert _generate(deepseek, "float32") == expected
    assert _generate(deepseek, "float32", enforce_eager=True) == expected


def test_mla_bf16_graphs_on_off_agree(deepseek: Path) -> None:
    graphs = _generate(deepseek, "bfloat16")
    eager = _generate(deepseek, "bfloat16", enforce_eager=True)
    assert [g[:6] for g in graphs] == [e[:6] for e in eager]


def test_deepseek_fp8_checkpoint_with_graphs(deepseek: Path, tmp_path: Path) -> None:
    """MLA projections, dense MLP and routed experts in FP8 (per-expert tensors, as published):
    the first tokens agree with HF's on the dequantized weights, graphs on and off agree."""
    fp8_checkpoint(deepseek, tmp_path / "fp8", tmp_path / "ref")
    expected = [hf_greedy(tmp_path / "ref", p, 16) for p in PROMPTS]
    graphs = _generate(tmp_path / "fp8", "bfloat16")
    eager = _generate(tmp_path / "fp8", "bfloat16", enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
    agree = sum(g[0] == e[0] for g, e in zip(graphs, expected, strict=True))
    assert agree >= len(PROMPTS) - 1


def test_youtu_mla_dense_fp32_greedy_matches_hf_with_graphs_on_and_off(tmp_path: Path
                                                                        ) -> None:
    """Youtu-LLM: DeepSeek-V3's MLA (q LoRA, interleaved RoPE) over dense MLPs, tied
    embeddings, on the latent-cache kernels."""
    path = make_tiny_checkpoint(
        tmp_path / "youtu", "YoutuForCausalLM", std=0.15, vocab_size=512, hidden_size=256,
        intermediate_size=512, num_hidden_layers=3, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=96, kv_lora_rank=128, qk_nope_head_dim=32,
        qk_rope_head_dim=64, v_head_dim=32, max_position_embeddings=512)
    expected = [hf_greedy(path, p, 16) for p in PROMPTS]
    assert _generate(path, "float32") == expected
    assert _generate(path, "float32", enforce_eager=True) == expected
