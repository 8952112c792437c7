"""GPTQ and AWQ checkpoints on the CPU: saved as those formats are published
(:mod:`mrv2.testing_quant`, written independently of the loader), they generate HF's greedy
tokens on the dequantized weights (4 and 8 bits, symmetric and not, ``desc_act``, one group
per channel); the loaded layers hold exactly the reference weights; the Triton layer agrees
with the dequantized product; bad configurations name the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from mrv2 import LLM, SamplingParams
from mrv2.config import EngineConfig
from mrv2.layers.int_model import apply_int_quant
from mrv2.layers.int_quant import IntLinearMixin
from mrv2.layers.int_quant_config import int_quant_config_of
from mrv2.layers.linear import LinearBase, MergedColumnLinear
from mrv2.testing import hf_greedy, make_tiny_checkpoint
from mrv2.testing_quant import awq_checkpoint, compressed_tensors_checkpoint, gptq_checkpoint

PROMPTS = [[5, 17, 42, 9, 100, 3, 77], [8, 8, 250], [1 + i % 200 for i in range(21)]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, **kwargs)


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


CASES = {
    "gptq4-sym": dict(fmt="gptq", bits=4, group_size=32, sym=True, desc_act=False),
    "gptq4-asym-act": dict(fmt="gptq", bits=4, group_size=16, sym=False, desc_act=True),
    "gptq8-channel": dict(fmt="gptq", bits=8, group_size=-1, sym=True, desc_act=True),
    "awq": dict(fmt="awq", group_size=32),
    "llama-awq": dict(fmt="awq", group_size=16, arch="LlamaForCausalLM"),
    "ct4-sym": dict(fmt="ct", bits=4, group_size=32, sym=True),
    "ct4-asym-actorder": dict(fmt="ct", bits=4, group_size=16, sym=False, actorder=True),
    "ct8-channel-asym": dict(fmt="ct", bits=8, group_size=-1, sym=False),
}
WRITERS = {"gptq": gptq_checkpoint, "awq": awq_checkpoint, "ct": compressed_tensors_checkpoint}


@pytest.mark.parametrize("case", list(CASES))
def test_int_checkpoint_matches_hf_on_dequantized_weights(tmp_path: Path, case: str) -> None:
    opts = dict(CASES[case])
    fmt, arch = opts.pop("fmt"), opts.pop("arch", "Qwen3ForCausalLM")
    src = make_tiny_checkpoint(tmp_path / "src", str(arch))
    WRITERS[str(fmt)](src, tmp_path / "q", tmp_path / "ref", **opts)  # type: ignore[operator]
    llm = _llm(tmp_path / "q")
    # the loaded (CPU: dequantized once) weights are the reference's, shard by shard
    ref = load_file(tmp_path / "ref" / "model.safetensors")
    layer = llm.engine.runner.model.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert type(qkv) is not IntLinearMixin and isinstance(qkv, LinearBase)
    q_rows = ref["model.layers.0.self_attn.q_proj.weight"].shape[0]
    torch.testing.assert_close(qkv.weight[:q_rows], ref["model.layers.0.self_attn.q_proj.weight"],
                               rtol=0, atol=0)
    torch.testing.assert_close(layer.mlp.down_proj.weight,
                               ref["model.layers.0.mlp.down_proj.weight"], rtol=0, atol=0)
    expected = [hf_greedy(tmp_path / "ref", p, 8) for p in PROMPTS]
    assert _greedy(llm) == expected


@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_quantized_lm_head_matches_hf_on_dequantized_weights(tmp_path: Path,
                                                                  desc_act: bool) -> None:
    """``quantization_config.lm_head: true`` (GPTQModel): the LM head's ``qweight`` /
    ``scales`` / ``qzeros`` / ``g_idx`` load (vLLM runs them), the head holds exactly the
    dequantized weight, and the tokens are HF's on the dequantized checkpoint."""
    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3ForCausalLM", tie_word_embeddings=False)
    gptq_checkpoint(src, tmp_path / "q", tmp_path / "ref", bits=4, group_size=16, sym=False,
                    desc_act=desc_act, lm_head=True)
    assert "lm_head.qweight" in load_file(tmp_path / "q" / "model.safetensors")
    llm = _llm(tmp_path / "q")
    ref = load_file(tmp_path / "ref" / "model.safetensors")
    torch.testing.assert_close(llm.engine.runner.model.lm_head.weight, ref["lm_head.weight"],
                               rtol=0, atol=0)
    expected = [hf_greedy(tmp_path / "ref", p, 8) for p in PROMPTS]
    assert _greedy(llm) == expected


def test_quantized_lm_head_rank_rows(tmp_path: Path) -> None:
    """Under tensor parallelism each rank's quantized LM head holds its rows of the
    dequantized head (zeros past the vocabulary); a tied head is refused by name."""
    from mrv2.distributed.parallel_state import as_rank
    from mrv2.layers.embedding import LMHead, VocabEmbedding
    from mrv2.layers.int_lm_head import int_lm_head

    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3ForCausalLM", tie_word_embeddings=False,
                               vocab_size=200)
    gptq_checkpoint(src, tmp_path / "q", tmp_path / "ref", bits=4, group_size=16, sym=False,
                    desc_act=True, lm_head=True)
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    want = load_file(tmp_path / "ref" / "model.safetensors")["lm_head.weight"]
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    quant = int_quant_config_of(type("C", (), {"quantization_config":
                                               config["quantization_config"]})(), None)
    assert quant is not None
    for rank in range(3):
        with as_rank(rank, 3):
            head = int_lm_head(LMHead(200, 64), quant)
        params = dict(head.named_parameters())
        for role in ("qweight", "scales", "qzeros", "g_idx"):
            param = params[role]
            param.weight_loader(param, tensors[f"lm_head.{role}"])  # type: ignore[attr-defined]
        head.process_weights_after_loading()
        rows = head.weight.shape[0]  # 67: the last rank's last row is padding
        part = want[rank * rows:(rank + 1) * rows]
        torch.testing.assert_close(head.weight[: part.shape[0]], part, rtol=0, atol=0)
        assert not head.weight[part.shape[0]:].any()
    with pytest.raises(ValueError, match="quantization_config.lm_head"):
        int_lm_head(LMHead(200, 64, tied_to=VocabEmbedding(200, 64)), quant)


def test_gptq_without_g_idx_and_symmetric_zeros_loads(tmp_path: Path) -> None:
    """A GPTQ checkpoint may leave out ``g_idx`` (inputs in order) and, when symmetric,
    ``qzeros`` (midpoints): the layers fill them in."""
    from safetensors.torch import save_file

    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3ForCausalLM")
    gptq_checkpoint(src, tmp_path / "q", tmp_path / "ref", bits=4, group_size=32, sym=True)
    path = tmp_path / "q" / "model.safetensors"
    tensors = {n: t for n, t in load_file(path).items() if not n.endswith((".g_idx", ".qzeros"))}
    save_file(tensors, path)
    expected = [hf_greedy(tmp_path / "ref", p, 8) for p in PROMPTS]
    assert _greedy(_llm(tmp_path / "q")) == expected


def test_gptq_v2_zero_points_load_as_stored(tmp_path: Path) -> None:
    """``checkpoint_format: "gptq_v2"`` stores zero points as they are (v1: one less)."""
    from safetensors.torch import save_file

    from mrv2_kernels.wna16_gemm import pack_along_k, unpack_along_k

    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3ForCausalLM")
    gptq_checkpoint(src, tmp_path / "q", tmp_path / "ref", bits=4, group_size=16, sym=False)
    path = tmp_path / "q" / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(".qzeros")]:  # packed along N: transpose
        zeros = unpack_along_k(tensors[name].T.contiguous(), 4).to(torch.int64) + 1
        tensors[name] = pack_along_k(zeros, 4).T.contiguous()
    save_file(tensors, path)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = "gptq_v2"
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    expected = [hf_greedy(tmp_path / "ref", p, 8) for p in PROMPTS]
    assert _greedy(_llm(tmp_path / "q")) == expected


def test_triton_layers_match_the_dequantized_layers(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The integer layer's own forward (the Triton kernel under the interpreter, ``desc_act``
    input order included) against the plain layer the CPU makes of it, on a fused gate/up."""
    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3ForCausalLM")
    gptq_checkpoint(src, tmp_path / "q", tmp_path / "ref", bits=4, group_size=16, sym=False,
                    desc_act=True)
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    quant = int_quant_config_of(type("C", (), {"quantization_config":
                                               config["quantization_config"]})(), None)
    assert quant is not None and quant.desc_act

    def build() -> IntLinearMixin:
        model = torch.nn.Sequential(MergedColumnLinear(hidden, [inter, inter]))
        assert apply_int_quant(model, quant, ["0"]) == 1
        layer = model[0]
        assert isinstance(layer, IntLinearMixin)
        for shard, part in enumerate(("gate_proj", "up_proj")):
            for t in ("qweight", "qzeros", "scales", "g_idx"):
                param = getattr(layer, t)
                param.weight_loader(param, tensors[f"model.layers.0.mlp.{part}.{t}"], shard)
        return layer

    monkeypatch.setenv("MRV2_KERNELS", "triton")  # the kernel, interpreted, on CPU tensors
    kernel_layer = build()
    kernel_layer.order_inputs()  # (what process_weights_after_loading does on a GPU)
    assert kernel_layer.input_order is not None and kernel_layer.qzeros is not None
    plain = build()
    plain.process_weights_after_loading()  # the CPU's: dequantized, plain
    assert type(plain) is MergedColumnLinear
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(kernel_layer(x), plain(x), rtol=1e-4, atol=1e-5)


def _with_qc(tmp_path: Path, qc: dict[str, object]) -> Path:
    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3ForCausalLM")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qc
    (src / "config.json").write_text(json.dumps(config))
    return src


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
CT_GROUP = {"targets": ["Linear"], "input_activations": None,
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": 32}}
CT = {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": CT_GROUP}}


@pytest.mark.parametrize("qc,requested,match", [
    ({**GPTQ, "bits": 3}, None, r"quantization_config.bits = 3: allowed values are 4, 8"),
    ({**GPTQ, "group_size": 0}, None, r"quantization_config.group_size = 0"),
    ({**GPTQ, "checkpoint_format": "marlin"}, None, r"checkpoint_format = 'marlin'"),
    ({"quant_method": "awq", "bits": 8, "group_size": 32}, None, r"bits = 8: allowed values are 4"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, None,
     r"version = 'gemv'"),
    (GPTQ, "awq", r"quantization='awq': the checkpoint is 'gptq'"),
    (GPTQ, "fp8", r"quantization='fp8'"),
    ({"quant_method": "bitsandbytes"}, None, r"quant_method = 'bitsandbytes': allowed values"),
    ({**CT, "format": "float-quantized"}, None, r"format = 'float-quantized': only"),
    ({**CT, "config_groups": {"g": {**CT_GROUP, "input_activations": {"num_bits": 8}}}}, None,
     r"config_groups.g.input_activations: activation quantization"),
    ({**CT, "config_groups": {"g": {**CT_GROUP, "weights": {"num_bits": 4, "type": "int",
                                                            "strategy": "tensor"}}}}, None,
     r"weights.strategy = 'tensor': allowed values are 'group' and 'channel'"),
    ({**CT, "config_groups": {"a": CT_GROUP, "b": CT_GROUP}}, None, r"has 2 groups"),
])
def test_bad_int_quantization_config_names_the_field(tmp_path: Path, qc: dict[str, object],
                                                      requested: str | None, match: str) -> None:
    src = _with_qc(tmp_path, qc)
    with pytest.raises(ValueError, match=match):
        _llm(src, quantization=requested)


def test_gptq_on_a_float_checkpoint_needs_dummy_weights(tmp_path: Path) -> None:
    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3ForCausalLM")
    with pytest.raises(ValueError, match=r"quantization='gptq' needs a checkpoint quantized so"):
        _llm(src, quantization="gptq")
    with pytest.raises(ValueError, match=r"(?s)quantization.*'fp8', 'gptq', 'awq'"):  # the flag
        EngineConfig.from_kwargs(model=str(src), quantization="int3")


@pytest.mark.parametrize("method", ["gptq", "awq_marlin", "compressed-tensors"])
def test_random_integer_weights_run(tmp_path: Path, method: str) -> None:
    """``load_format="dummy"`` with an integer method: every linear layer gets random 4-bit
    weights (the benchmarks' setting); they decode finite logits."""
    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3ForCausalLM")
    llm = _llm(src, load_format="dummy", quantization=method)
    tokens = _greedy(llm)
    assert all(len(t) == 8 for t in tokens)
    llm.engine.update_weights([])  # (nothing to load: every layer as it was)
    assert _greedy(llm) == tokens


MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _loud_experts(path: Path) -> Path:
    """The experts' weights scaled up 12x (std 0.24), so that the tokens depend on them (at
    the tiny checkpoints' std 0.02 the residual stream drowns them: a gate/up mix-up went
    unseen)."""
    from safetensors.torch import save_file

    file = path / "model.safetensors"
    tensors = {n: t * 12 if ".experts." in n else t for n, t in load_file(file).items()}
    save_file(tensors, file)
    return path


@pytest.mark.parametrize("fmt,opts", [
    ("gptq", dict(bits=4, group_size=16, sym=False)),
    ("awq", dict(group_size=16)),
    ("ct", dict(bits=8, group_size=16, sym=True)),
], ids=["gptq4-asym", "awq", "ct8-sym"])
def test_moe_checkpoint_with_quantized_experts_matches_hf(tmp_path: Path, fmt: str,
                                                         opts: dict[str, Any]) -> None:
    """Every expert's gate / up / down quantized as a dense layer of the format (as
    Qwen3-30B-A3B-GPTQ-Int4 ships them), the router left in the model dtype."""
    src = _loud_experts(make_tiny_checkpoint(tmp_path / "src", "Qwen3MoeForCausalLM", **MOE))
    WRITERS[fmt](src, tmp_path / "q", tmp_path / "ref", experts=True, **opts)  # type: ignore[operator]
    names = load_file(tmp_path / "q" / "model.safetensors")
    assert any(".experts.3.down_proj." in n for n in names)
    expected = [hf_greedy(tmp_path / "ref", p, 8) for p in PROMPTS]
    assert _greedy(_llm(tmp_path / "q")) == expected


def test_experts_with_one_group_per_channel_are_refused(tmp_path: Path) -> None:
    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3MoeForCausalLM", **MOE)
    gptq_checkpoint(src, tmp_path / "q", tmp_path / "ref", group_size=-1, experts=True)
    with pytest.raises(ValueError, match=r"group_size = -1 \(one group per channel\) is not "
                                         r"supported for routed experts"):
        _llm(tmp_path / "q")


def test_integer_experts_out_of_range_or_left_out_are_named(tmp_path: Path) -> None:
    """A GPTQ MoE checkpoint with a tensor of expert 4 of 4 is refused naming the tensor and
    the range; one without expert 3's tensors (their packed rows would stay uninitialized)
    naming the stacks and the expert's projections."""
    from mrv2.testing_checkpoints import save_checkpoint_like

    src = make_tiny_checkpoint(tmp_path / "src", "Qwen3MoeForCausalLM", **MOE)
    gptq_checkpoint(src, tmp_path / "q", tmp_path / "ref", group_size=16, experts=True)
    tensors = {n: t.clone() for n, t in load_file(tmp_path / "q" / "model.safetensors").items()}
    extra = {n.replace(".experts.0.", ".experts.4."): t.clone() for n, t in tensors.items()
             if ".layers.1.mlp.experts.0.up_proj.qweight" in n}
    save_checkpoint_like(tmp_path / "q", tmp_path / "extra", {**tensors, **extra})
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.experts\.4\.up_proj\.qweight'"
                                         r".*expert index must be in \[0, 4\), got 4"):
        _llm(tmp_path / "extra")
    fewer = {n: t for n, t in tensors.items() if ".layers.0.mlp.experts.3." not in n}
    save_checkpoint_like(tmp_path / "q", tmp_path / "fewer", fewer)
    with pytest.raises(ValueError, match=r"not found in the checkpoint: .*layers\.0\.mlp\.experts"
                                         r"\.w13_\w+ \(experts\.3\.gate_proj\)"):
        _llm(tmp_path / "fewer")


def test_triton_experts_match_the_dequantized_experts(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The integer expert stack's own forward (the fused MoE kernel, interpreted) against the
    plain stack the CPU makes of it, loaded expert by expert from an AWQ checkpoint."""
    from mrv2.layers.int_quant_moe import IntFusedMoE
    from mrv2.layers.moe import FusedMoE

    src = _loud_experts(make_tiny_checkpoint(tmp_path / "src", "Qwen3MoeForCausalLM", **MOE))
    awq_checkpoint(src, tmp_path / "q", tmp_path / "ref", group_size=16, experts=True)
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    quant = int_quant_config_of(type("C", (), {"quantization_config": qc})(), None)
    assert quant is not None

    def build() -> IntFusedMoE:
        model = torch.nn.Sequential(FusedMoE(4, 64, 32))
        assert apply_int_quant(model, quant, ["0"]) == 1
        layer = model[0]
        assert isinstance(layer, IntFusedMoE)
        for e in range(4):
            for kind, stack in (("gate", "w13"), ("up", "w13"), ("down", "w2")):
                for t in ("qweight", "qzeros", "scales"):
                    param = getattr(layer, f"{stack}_{t}")
                    name = f"model.layers.0.mlp.experts.{e}.{kind}_proj.{t}"
                    param.weight_loader(param, tensors[name], (e, kind))
        return layer

    monkeypatch.setenv("MRV2_KERNELS", "triton")
    kernel_layer = build()
    kernel_layer.finish_loading()
    plain = build()
    plain.process_weights_after_loading()
    assert type(plain) is FusedMoE
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen)
    weights, ids = torch.randn(5, 4, generator=gen).softmax(-1).topk(2, dim=-1)
    got = kernel_layer(x, weights, ids.int())
    monkeypatch.setenv("MRV2_KERNELS", "torch")
    torch.testing.assert_close(got, plain(x, weights, ids.int()), rtol=1e-4, atol=1e-4)


RELOAD_CASES = {
    "gptq4-asym-act": ("gptq", dict(bits=4, group_size=16, sym=False, desc_act=True), {}),
    "awq": ("awq", dict(group_size=16), {}),
    "ct4-sym": ("ct", dict(bits=4, group_size=16, sym=True), {}),
    "gptq-experts": ("gptq", dict(bits=4, group_size=16, sym=False, experts=True), MOE),
}


def _two_checkpoints(tmp_path: Path, case: str) -> tuple[Path, Path, list[int], list[int]]:
    """Checkpoints A and B of ``case`` (different weights) and HF's greedy tokens of each on
    their dequantized weights."""
    fmt, opts, overrides = RELOAD_CASES[case]
    arch = "Qwen3MoeForCausalLM" if overrides else "Qwen3ForCausalLM"
    for seed, name in ((1, "a"), (2, "b")):
        src = make_tiny_checkpoint(tmp_path / f"src{name}", arch, seed=seed, std=0.1,
                                   **overrides)
        WRITERS[fmt](src, tmp_path / name, tmp_path / f"ref{name}", **opts)  # type: ignore[operator]
    want_a, want_b = (hf_greedy(tmp_path / f"ref{n}", PROMPTS[0], 8) for n in "ab")
    assert want_a != want_b
    return tmp_path / "a", tmp_path / "b", want_a, want_b


def _one(llm: LLM) -> list[int]:
    return llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0].outputs[
        0].token_ids


@pytest.mark.parametrize("case", list(RELOAD_CASES))
def test_integer_weights_update_and_reload(tmp_path: Path, case: str) -> None:
    """An integer model's weights load again as at start-up (they were refused): B's
    checkpoint into an engine started on A gives HF's tokens on B, ``reload_weights`` A's
    again, and again (no input order, packing or dequantization applied twice); the names
    loaded are the model's parameters."""
    a, b, want_a, want_b = _two_checkpoints(tmp_path, case)
    llm = _llm(a, max_model_len=64)
    assert _one(llm) == want_a
    names = {n for n, _ in llm.engine.runner.model.named_parameters()}
    assert llm.engine.update_weights_from_disk(str(b)) == names
    assert _one(llm) == want_b
    for _ in range(2):
        assert llm.reload_weights() == names
        assert _one(llm) == want_a


def test_integer_weights_given_in_part_on_the_cpu_are_refused(tmp_path: Path) -> None:
    """The CPU dequantizes a layer whole: an update giving a layer's packed weight but not
    its scales is refused, naming what to give, and the model keeps its weights."""
    a, b, want_a, _ = _two_checkpoints(tmp_path, "gptq4-asym-act")
    llm = _llm(a, max_model_len=64)
    part = [(n, t) for n, t in load_file(b / "model.safetensors").items()
            if n == "model.layers.0.self_attn.o_proj.qweight"]
    with pytest.raises(ValueError, match="give all of its packed weight, scales and zero"):
        llm.update_weights(part)
    assert _one(llm) == want_a


def _real_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's values, an integer layer's (or expert stack's) weight dequantized,
    by the name of the plain layer the CPU makes of it."""
    from mrv2.layers.int_quant_moe import IntFusedMoE

    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        if isinstance(module, IntLinearMixin):
            out[f"{prefix}weight"] = module.dequantized(torch.float32)
        elif isinstance(module, IntFusedMoE):
            for stack in ("w13", "w2"):
                out[f"{prefix}{stack}_weight"] = module.dequantized(stack, torch.float32)
        packed = isinstance(module, IntLinearMixin | IntFusedMoE)
        for param_name, param in module.named_parameters(recurse=False):
            if not packed or param_name.endswith("bias"):  # (not the scales)
                out[prefix + param_name] = param.detach()
    return out


@pytest.mark.parametrize("case", ["gptq4-asym-act", "gptq-experts"])
def test_packed_integer_weights_load_again_in_place(tmp_path: Path, case: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The layers kept packed, as on a GPU: new weights land in the same tensors (the CUDA
    graphs read them there) and give the real weights the CPU's dequantized load of that
    checkpoint has (a ``desc_act`` layer's packed rows put in its input order once, the
    expert stacks' zero points kept); a reload gives A's again."""
    from mrv2.layers.int_quant_moe import IntFusedMoE

    a, b, _, _ = _two_checkpoints(tmp_path, case)
    want_a, want_b = (_real_weights(_llm(p, max_model_len=64).engine.runner.model)
                      for p in (a, b))
    monkeypatch.setattr(IntLinearMixin, "_become_plain", lambda self: None)
    monkeypatch.setattr(IntFusedMoE, "_become_plain", lambda self: None)
    llm = _llm(a, max_model_len=64)
    model = llm.engine.runner.model
    assert any(isinstance(m, IntLinearMixin) for m in model.modules())
    if case == "gptq4-asym-act":
        assert any(getattr(m, "input_order", None) is not None for m in model.modules())
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}

    def same(want: dict[str, torch.Tensor]) -> None:
        got = _real_weights(model)
        assert got.keys() == want.keys()
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)

    same(want_a)
    assert llm.engine.update_weights_from_disk(str(b)) == set(ptrs)
    same(want_b)
    for _ in range(2):
        llm.reload_weights()
        same(want_a)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
