"""GPU: GPTQ / AWQ integer-weight layers (the W4A16 / W8A16 Triton GEMM) alone, with every
tile plan (split-K decode rows, prefill rows), and through the engine with CUDA graphs.

Run on a CUDA machine with ``MRV2_TEST_GPU=1 python -m pytest -m gpu``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mrv2 import LLM, SamplingParams
from mrv2.layers.int_model import apply_int_quant
from mrv2.layers.int_quant import IntLinearMixin
from mrv2.layers.int_quant_config import int_quant_config_of
from mrv2.layers.linear import MergedColumnLinear
from mrv2.testing import TINY_FAMILIES, hf_greedy, make_tiny_checkpoint
from mrv2.testing_quant import (
    awq_checkpoint,
    compressed_tensors_checkpoint,
    gptq_checkpoint,
    mxfp4_checkpoint,
)
from mrv2_kernels.wna16_gemm import pack_along_k, wna16_linear_ref, wna16_linear_triton

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
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


def _check_with_graphs(path: Path, expected: list[list[int]]) -> list[list[int]]:
    """fp32 tokens are ``expected`` (HF's on the dequantized weights) with graphs on and off;
    bf16 graphs on and off agree on the first tokens. Returns bf16's tokens with graphs."""
    assert _generate(path, "float32") == expected
    assert _generate(path, "float32", enforce_eager=True) == expected
    graphs = _generate(path, "bfloat16")
    eager = _generate(path, "bfloat16", enforce_eager=True)
    assert [g[:4] for g in graphs] == [e[:4] for e in eager]
    return graphs


@pytest.mark.parametrize("bits,group,asym", [(4, 128, False), (4, 64, True), (8, 128, True)])
@pytest.mark.parametrize("rows", [1, 7, 16, 40, 300])
def test_kernel_matches_reference_at_every_tile_plan(bits: int, group: int, asym: bool,
                                                     rows: int) -> None:
    """The default tiles (split-K up to 16 rows) against the fp32 reference, bf16 input, at
    Qwen3-8B-like widths; outputs start as NaN where the kernel allocates them."""
    torch.manual_seed(rows)
    k, n = 4096, 1536
    q = torch.randint(0, 2**bits, (k, n), device="cuda")
    qweight = pack_along_k(q, bits)
    scales = (torch.rand(k // group, n, device="cuda") * 0.002 + 0.0005).half()
    zeros = (torch.randint(0, 2**bits, (k // group, n), device="cuda").to(torch.uint8)
             if asym else None)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    got = wna16_linear_triton(x, qweight, scales, zeros, bits, group, bias)
    want = wna16_linear_ref(x, qweight, scales, zeros, bits, group, bias).float()
    assert not got.isnan().any()
    assert (got.float() - want).norm() / want.norm() < 1e-2


def test_desc_act_layer_matches_its_dequantized_weight(tmp_path: Path) -> None:
    """A fused gate/up with GPTQ's ``desc_act`` input order, loaded shard by shard."""
    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3ForCausalLM", **ARCH)
    gptq_checkpoint(src, tmp_path / "q", tmp_path / "ref", group_size=64, desc_act=True,
                    sym=False)
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    ref = load_file(tmp_path / "ref" / "model.safetensors")
    qc: dict[str, Any] = {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": False,
                          "desc_act": True}
    quant = int_quant_config_of(type("C", (), {"quantization_config": qc})(), None)
    assert quant is not None
    model = torch.nn.Sequential(MergedColumnLinear(256, [512, 512])).cuda()
    apply_int_quant(model, quant, ["0"], torch.bfloat16)
    layer = model[0]
    assert isinstance(layer, IntLinearMixin)
    for shard, part in enumerate(("gate_proj", "up_proj")):
        for t in ("qweight", "qzeros", "scales", "g_idx"):
            p = getattr(layer, t)
            p.weight_loader(p, tensors[f"model.layers.0.mlp.{part}.{t}"].cuda(), shard)
    layer.process_weights_after_loading()
    assert layer.input_order is not None
    w = torch.cat([ref["model.layers.0.mlp.gate_proj.weight"],
                   ref["model.layers.0.mlp.up_proj.weight"]]).cuda()
    for rows in (1, 9, 100, 300):  # (300: the prefill path, dequantized then cuBLAS)
        x = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ w.float().T
        got = layer(x).float()
        assert (got - want).norm() / want.norm() < 1e-2


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors"])
def test_int_checkpoint_with_graphs(tmp_path: Path, fmt: str) -> None:
    """fp32 activations (the kernel's fp32 dot): HF's greedy tokens on the dequantized
    weights, graphs on and off; bf16: graphs on and off agree, the first tokens are HF's."""
    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3ForCausalLM", **ARCH)
    if fmt == "gptq":
        gptq_checkpoint(src, tmp_path / "q", tmp_path / "ref", group_size=64, desc_act=True)
    elif fmt == "awq":
        awq_checkpoint(src, tmp_path / "q", tmp_path / "ref", group_size=64)
    else:
        compressed_tensors_checkpoint(src, tmp_path / "q", tmp_path / "ref", group_size=64,
                                      sym=False, actorder=True)
    expected = [hf_greedy(tmp_path / "ref", p, 16) for p in PROMPTS]
    graphs = _check_with_graphs(tmp_path / "q", expected)
    agree = sum(g[0] == e[0] for g, e in zip(graphs, expected, strict=True))
    assert agree >= len(PROMPTS) - 1


def test_moe_with_integer_experts_with_graphs(tmp_path: Path) -> None:
    """A Qwen3-MoE checkpoint with GPTQ experts (the fused MoE's integer path): fp32 tokens
    are HF's on the dequantized weights, graphs on and off; bf16 graphs on and off agree."""
    from safetensors.torch import save_file

    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3MoeForCausalLM", num_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=128, **ARCH)
    file = src / "model.safetensors"
    save_file({n: t * 8 if ".experts." in n else t for n, t in load_file(file).items()}, file)
    gptq_checkpoint(src, tmp_path / "q", tmp_path / "ref", group_size=64, sym=False,
                    experts=True)
    _check_with_graphs(tmp_path / "q", [hf_greedy(tmp_path / "ref", p, 16) for p in PROMPTS])


def test_gpt_oss_mxfp4_experts_through_the_engine(tmp_path: Path) -> None:
    """gpt-oss with MXFP4 experts (the fused MoE's e2m1 path, with the experts' biases and
    the clamped swigluoai), attention sinks and a local layer, on CUDA: fp32 tokens are HF's
    on the dequantized weights, graphs on and off; bf16 graphs agree with eager."""
    arch, tiny = TINY_FAMILIES["gpt-oss"]
    src = make_tiny_checkpoint(tmp_path / "src", arch, **{
        **tiny, "hidden_size": 128, "intermediate_size": 64, "head_dim": 32,
        "num_local_experts": 8, "num_experts_per_tok": 4, "sliding_window": 8})
    mxfp4_checkpoint(src, tmp_path / "q", tmp_path / "ref")
    _check_with_graphs(tmp_path / "q", [hf_greedy(tmp_path / "ref", p, 16) for p in PROMPTS])


RELOADS: dict[str, tuple[str, dict[str, Any]]] = {
    "gptq-desc-act": ("Qwen3ForCausalLM", {}),
    "awq": ("Qwen3ForCausalLM", {}),
    "gptq-experts": ("Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2,
                                             "moe_intermediate_size": 128}),
}


@pytest.mark.parametrize("case", list(RELOADS))
def test_packed_integer_weights_update_and_reload_under_graphs(tmp_path: Path,
                                                               case: str) -> None:
    """On CUDA the integer layers stay packed (the W4A16 GEMM and the integer fused MoE read
    them): an engine with CUDA graphs started on A and given B's checkpoint generates HF's
    tokens on B's dequantized weights (fp32), and ``reload_weights`` A's again, twice (no
    input order, packing or zero point applied twice); every parameter keeps its storage,
    where the captured graphs read it."""
    arch, extra = RELOADS[case]
    paths = {}
    for seed, name in ((1, "a"), (2, "b")):
        src = make_tiny_checkpoint(tmp_path / f"src{name}", arch, seed=seed, **ARCH, **extra)
        if extra:
            file = src / "model.safetensors"
            save_file({n: t * 8 if ".experts." in n else t for n, t in load_file(file).items()},
                      file)
            gptq_checkpoint(src, tmp_path / name, tmp_path / f"ref{name}", group_size=64,
                            sym=False, experts=True)
        elif case == "awq":
            awq_checkpoint(src, tmp_path / name, tmp_path / f"ref{name}", group_size=64)
        else:
            gptq_checkpoint(src, tmp_path / name, tmp_path / f"ref{name}", group_size=64,
                            sym=False, desc_act=True)
        paths[name] = [hf_greedy(tmp_path / f"ref{name}", p, 16) for p in PROMPTS]
    assert paths["a"] != paths["b"]
    llm = LLM(str(tmp_path / "a"), device="cuda", dtype="float32", block_size=16,
              gpu_memory_utilization=0.3)
    from mrv2.layers.int_quant_moe import IntFusedMoE

    model = llm.engine.runner.model
    kept = IntFusedMoE if extra else IntLinearMixin
    assert any(isinstance(m, kept) for m in model.modules())  # (packed, not made plain)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def tokens() -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    assert tokens() == paths["a"]
    assert llm.engine.update_weights_from_disk(str(tmp_path / "b")) == set(ptrs)
    assert tokens() == paths["b"]
    for _ in range(2):
        llm.reload_weights()
        assert tokens() == paths["a"]
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    llm.shutdown()
