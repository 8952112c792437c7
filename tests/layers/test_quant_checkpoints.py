"""The GPTQ / AWQ / compressed-tensors checkpoint writers of mrv2.testing_quant: packed shapes,
unpacking back to the reference's dequantized weights, and the quantization error bound."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from mrv2.testing import make_tiny_checkpoint
from mrv2.testing_quant import (
    awq_checkpoint,
    compressed_tensors_checkpoint,
    gptq_checkpoint,
    is_quantized_weight,
    unpack_awq,
    unpack_compressed_tensors,
    unpack_gptq,
)

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("quant") / "src", "Qwen3ForCausalLM")


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    return (load_file(path / "dst" / "model.safetensors"),
            load_file(path / "ref" / "model.safetensors"),
            json.loads((path / "dst" / "config.json").read_text()))


def _check_common(source: dict[str, torch.Tensor], dst: dict[str, torch.Tensor],
                  ref: dict[str, torch.Tensor]) -> list[str]:
    """Unquantized tensors copied unchanged; returns the quantized prefixes."""
    prefixes = [n.removesuffix(".weight") for n, t in source.items() if is_quantized_weight(n, t)]
    assert {p.rsplit(".", 1)[1] for p in prefixes} == set(PROJS)
    assert set(ref) == set(source)
    for name, t in source.items():
        assert ref[name].shape == t.shape and ref[name].dtype == t.dtype
        if not is_quantized_weight(name, t):
            assert torch.equal(dst[name], t) and torch.equal(ref[name], t)
        else:
            assert name not in dst
    return prefixes


def _check_error(w: torch.Tensor, deq: torch.Tensor, step: torch.Tensor) -> None:
    """``deq`` within one quantization step (``step`` per element) of ``w``, and not constant."""
    err = (deq.float() - w.float()).abs()
    assert bool((err <= step * 1.001 + 1e-7).all()), float((err / step).max())
    assert float(err.mean()) < float(step.mean()) * 0.4


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq(src: Path, tmp_path: Path, bits: int, desc_act: bool, sym: bool) -> None:
    gptq_checkpoint(src, tmp_path / "dst", tmp_path / "ref", bits=bits, group_size=32,
                    desc_act=desc_act, sym=sym, seed=3)
    source = load_file(src / "model.safetensors")
    dst, ref, config = _load(tmp_path)
    assert config["quantization_config"] == {
        "quant_method": "gptq", "bits": bits, "group_size": 32, "desc_act": desc_act,
        "sym": sym, "checkpoint_format": "gptq", "static_groups": False,
        "true_sequential": True, "damp_percent": 0.01}
    pack = 32 // bits
    g_by_k: dict[int, torch.Tensor] = {}
    for prefix in _check_common(source, dst, ref):
        w = source[prefix + ".weight"]
        n, k = w.shape
        qweight, qzeros = dst[prefix + ".qweight"], dst[prefix + ".qzeros"]
        scales, g_idx = dst[prefix + ".scales"], dst[prefix + ".g_idx"]
        assert qweight.dtype == qzeros.dtype == g_idx.dtype == torch.int32
        assert scales.dtype == torch.float16
        assert qweight.shape == (k // pack, n) and qzeros.shape == (k // 32, n // pack)
        assert scales.shape == (k // 32, n) and g_idx.shape == (k,)
        assert torch.equal(torch.bincount(g_idx.long()), torch.full((k // 32,), 32))
        if desc_act:
            assert not torch.equal(g_idx.long(), torch.arange(k) // 32)
            assert torch.equal(g_by_k.setdefault(k, g_idx), g_idx)  # one permutation per K
        else:
            assert torch.equal(g_idx.long(), torch.arange(k) // 32)
        if sym:  # v1: every stored zero is 2**(bits-1) - 1
            fields = (qzeros.long().unsqueeze(-1) >> (torch.arange(pack) * bits)) & (2**bits - 1)
            assert bool((fields == 2 ** (bits - 1) - 1).all())
        deq = unpack_gptq(qweight, qzeros, scales, g_idx, bits)
        assert torch.equal(deq.to(w.dtype), ref[prefix + ".weight"])
        _check_error(w, deq, scales.float().t()[:, g_idx.long()])


def test_gptq_sym_zeros_and_sign_wrap(src: Path, tmp_path: Path) -> None:
    """Symmetric 4-bit stores 0x77777777 as zeros; packed words use the int32 sign bit."""
    gptq_checkpoint(src, tmp_path / "dst", tmp_path / "ref", bits=4, sym=True)
    dst = load_file(tmp_path / "dst" / "model.safetensors")
    qzeros = dst["model.layers.0.self_attn.q_proj.qzeros"]
    assert bool((qzeros == 0x77777777).all())
    assert bool((dst["model.layers.0.self_attn.q_proj.qweight"] < 0).any())
    gptq_checkpoint(src, tmp_path / "dst8", tmp_path / "ref8", bits=8, sym=True)
    qzeros8 = load_file(tmp_path / "dst8" / "model.safetensors")[
        "model.layers.0.self_attn.q_proj.qzeros"]
    assert bool((qzeros8 == 0x7F7F7F7F).all())


@pytest.mark.parametrize("group_size", [32, -1])
def test_awq(src: Path, tmp_path: Path, group_size: int) -> None:
    awq_checkpoint(src, tmp_path / "dst", tmp_path / "ref", group_size=group_size)
    source = load_file(src / "model.safetensors")
    dst, ref, config = _load(tmp_path)
    assert config["quantization_config"] == {
        "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": None}
    for prefix in _check_common(source, dst, ref):
        w = source[prefix + ".weight"]
        n, k = w.shape
        groups = 1 if group_size == -1 else k // group_size
        qweight, qzeros, scales = (dst[prefix + s] for s in (".qweight", ".qzeros", ".scales"))
        assert prefix + ".g_idx" not in dst
        assert qweight.dtype == qzeros.dtype == torch.int32 and scales.dtype == torch.float16
        assert qweight.shape == (k, n // 8) and qzeros.shape == (groups, n // 8)
        assert scales.shape == (groups, n)
        deq = unpack_awq(qweight, qzeros, scales, group_size)
        assert torch.equal(deq.to(w.dtype), ref[prefix + ".weight"])
        size = k if group_size == -1 else group_size
        _check_error(w, deq, scales.float().t().repeat_interleave(size, dim=1))


def test_awq_nibble_order(tmp_path: Path) -> None:
    """Hand-built weight: column c of a group constant with value growing with c, so the packed
    nibbles show AWQ's order (column 8j + AWQ_ORDER[i] in nibble i)."""
    n, k = 8, 32
    # every row: min 0 and max 15, so scale 1 and zero 0; row r holds q = r + 1 past column 0
    w = torch.zeros(n, k)
    w[:, 0] = 15.0
    w[:, 1:] = (torch.arange(n, dtype=torch.float32) + 1)[:, None]
    (tmp_path / "src").mkdir()
    save_file({"x.up_proj.weight": w}, tmp_path / "src" / "model.safetensors")
    (tmp_path / "src" / "config.json").write_text("{}")
    awq_checkpoint(tmp_path / "src", tmp_path / "dst", tmp_path / "ref", group_size=32)
    qweight = load_file(tmp_path / "dst" / "model.safetensors")["x.up_proj.qweight"]
    nibbles = [(int(qweight[1, 0]) >> (4 * i)) & 15 for i in range(8)]
    assert nibbles == [c + 1 for c in (0, 2, 4, 6, 1, 3, 5, 7)]


def test_group_size_must_divide(src: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="group_size"):
        gptq_checkpoint(src, tmp_path / "d", tmp_path / "r", group_size=48)
    with pytest.raises(ValueError, match="group_size"):
        awq_checkpoint(src, tmp_path / "d2", tmp_path / "r2", group_size=48)
    with pytest.raises(ValueError, match="group_size"):
        compressed_tensors_checkpoint(src, tmp_path / "d3", tmp_path / "r3", group_size=48)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize(("group_size", "actorder"), [(32, False), (32, True), (-1, False)])
def test_compressed_tensors(src: Path, tmp_path: Path, bits: int, sym: bool, group_size: int,
                            actorder: bool) -> None:
    compressed_tensors_checkpoint(src, tmp_path / "dst", tmp_path / "ref", bits=bits,
                                  group_size=group_size, sym=sym, actorder=actorder, seed=3)
    source = load_file(src / "model.safetensors")
    dst, ref, config = _load(tmp_path)
    assert config["quantization_config"] == {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": None, "output_activations": None,
            "weights": {
                "num_bits": bits, "type": "int", "symmetric": sym,
                "strategy": "channel" if group_size == -1 else "group",
                "group_size": None if group_size == -1 else group_size,
                "actorder": "group" if actorder else None, "dynamic": False,
                "observer": "minmax", "block_structure": None}}}}
    pack = 32 // bits
    g_by_k: dict[int, torch.Tensor] = {}
    for prefix in _check_common(source, dst, ref):
        w = source[prefix + ".weight"]
        n, k = w.shape
        groups = 1 if group_size == -1 else k // group_size
        packed, scale = dst[prefix + ".weight_packed"], dst[prefix + ".weight_scale"]
        assert packed.dtype == torch.int32 and packed.shape == (n, k // pack)
        assert scale.dtype == w.dtype and scale.shape == (n, groups)
        shape = dst[prefix + ".weight_shape"]
        assert shape.dtype == torch.int64 and shape.tolist() == [n, k]
        zero_point = dst.get(prefix + ".weight_zero_point")
        if sym:
            assert zero_point is None
        else:
            assert zero_point is not None
            assert zero_point.dtype == torch.int32 and zero_point.shape == (n // pack, groups)
        g_idx = dst.get(prefix + ".weight_g_idx")
        if actorder:
            assert g_idx is not None and g_idx.dtype == torch.int32 and g_idx.shape == (k,)
            assert torch.equal(torch.bincount(g_idx.long()), torch.full((groups,), 32))
            assert not torch.equal(g_idx.long(), torch.arange(k) // 32)
            assert torch.equal(g_by_k.setdefault(k, g_idx), g_idx)  # one permutation per K
            g = g_idx.long()
        else:
            assert g_idx is None
            g = torch.arange(k) // (k // groups)
        deq = unpack_compressed_tensors(packed, scale, zero_point, g_idx, bits)
        assert torch.equal(deq.to(w.dtype), ref[prefix + ".weight"])
        _check_error(w, deq, scale.float()[:, g])


def _hand_checkpoint(path: Path, dtype: torch.dtype) -> torch.Tensor:
    """One ``x.up_proj.weight`` ``[8, 32]``: row ``r`` holds ``(c % 16) - r`` in column ``c``,
    so its range is ``[-r, 15 - r]`` (asymmetric 4-bit: scale 1, signed zero ``r - 8``)."""
    w = ((torch.arange(32) % 16)[None, :] - torch.arange(8)[:, None]).to(dtype)
    path.mkdir()
    save_file({"x.up_proj.weight": w}, path / "model.safetensors")
    (path / "config.json").write_text("{}")
    return w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compressed_tensors_by_hand(tmp_path: Path, dtype: torch.dtype) -> None:
    """The unsigned offset, packing along K (weight) and along N (zero points), checked on a
    hand-built weight; scales in the source dtype."""
    w = _hand_checkpoint(tmp_path / "src", dtype)
    compressed_tensors_checkpoint(tmp_path / "src", tmp_path / "dst", tmp_path / "ref", bits=4,
                                  group_size=32, sym=False)
    dst = load_file(tmp_path / "dst" / "model.safetensors")
    ref = load_file(tmp_path / "ref" / "model.safetensors")
    scale = dst["x.up_proj.weight_scale"]
    assert scale.dtype == dtype and bool((scale == 1).all())
    # stored q = signed q + 8 = w + r: column c of every row stores c % 16
    packed = dst["x.up_proj.weight_packed"]
    assert packed.shape == (8, 4)
    assert packed[:, 0].tolist() == [0x76543210] * 8
    assert packed[:, 1].tolist() == [0xFEDCBA98 - 2**32] * 8  # int32 sign wrap
    # zero points: signed r - 8, stored r, row r in nibble r of word row 0
    zero_point = dst["x.up_proj.weight_zero_point"]
    assert zero_point.shape == (1, 1) and int(zero_point[0, 0]) == 0x76543210
    assert torch.equal(ref["x.up_proj.weight"], w)  # exact on this grid

    compressed_tensors_checkpoint(tmp_path / "src", tmp_path / "dst_sym", tmp_path / "ref_sym",
                                  bits=4, group_size=32, sym=True)
    dst = load_file(tmp_path / "dst_sym" / "model.safetensors")
    assert "x.up_proj.weight_zero_point" not in dst
    assert dst["x.up_proj.weight_scale"].dtype == dtype
    nibbles = ((dst["x.up_proj.weight_packed"].long()[:, :, None] >> (4 * torch.arange(8)))
               & 15).reshape(8, 32)
    for r in range(8):  # w[r, r] == 0 is stored as the offset, 8
        assert int(nibbles[r, r]) == 8 and float(w[r, r]) == 0.0
    ref = load_file(tmp_path / "ref_sym" / "model.safetensors")
    deq = unpack_compressed_tensors(dst["x.up_proj.weight_packed"], dst["x.up_proj.weight_scale"],
                                    None, None, 4)
    assert torch.equal(deq.to(dtype), ref["x.up_proj.weight"])


def test_compressed_tensors_actorder_needs_groups(src: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="actorder"):
        compressed_tensors_checkpoint(src, tmp_path / "d", tmp_path / "r", group_size=-1,
                                      actorder=True)


# -- routed experts (experts=True) -------------------------------------------------------------

#: (writer, its keywords, per-layer tensor suffixes in dst) of the formats checked with experts
EXPERT_FORMATS: dict[str, tuple[Callable[..., None], dict[str, Any], set[str]]] = {
    "gptq_sym": (gptq_checkpoint, {"bits": 4, "group_size": 16, "sym": True},
                 {"qweight", "qzeros", "scales", "g_idx"}),
    "gptq_asym": (gptq_checkpoint, {"bits": 4, "group_size": 16, "sym": False},
                  {"qweight", "qzeros", "scales", "g_idx"}),
    "gptq_desc_act": (gptq_checkpoint, {"bits": 4, "group_size": 16, "sym": False,
                                        "desc_act": True, "seed": 3},
                      {"qweight", "qzeros", "scales", "g_idx"}),
    "awq": (awq_checkpoint, {"group_size": 16}, {"qweight", "qzeros", "scales"}),
    "ct_asym": (compressed_tensors_checkpoint, {"bits": 4, "group_size": 16, "sym": False},
                {"weight_packed", "weight_scale", "weight_zero_point", "weight_shape"}),
}
MOE_LAYERS = ("model.layers.0.mlp.experts", "model.layers.1.mlp.experts")
NUM_EXPERTS, MOE_INTER, MOE_HIDDEN = 4, 32, 64


@pytest.fixture(scope="module")
def moe_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE as transformers 5 saves it: per-expert
    ``experts.{e}.{gate,up,down}_proj.weight`` (converted back from its stacked parameters)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("moe") / "src", "Qwen3MoeForCausalLM",
                                num_experts=NUM_EXPERTS, num_experts_per_tok=2,
                                moe_intermediate_size=MOE_INTER)
    tensors = load_file(path / "model.safetensors")
    assert tensors[MOE_LAYERS[0] + ".0.gate_proj.weight"].shape == (MOE_INTER, MOE_HIDDEN)
    assert tensors[MOE_LAYERS[0] + ".0.down_proj.weight"].shape == (MOE_HIDDEN, MOE_INTER)
    return path


@pytest.fixture(scope="module")
def moe_stacked_src(moe_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``moe_src`` with transformers 5's stacked experts: ``experts.gate_up_proj`` ``[E, 2I, H]``
    (gate rows, then up rows) and ``experts.down_proj`` ``[E, H, I]``."""
    tensors = load_file(moe_src / "model.safetensors")
    for p in MOE_LAYERS:
        per = {(e, proj): tensors.pop(f"{p}.{e}.{proj}.weight")
               for e in range(NUM_EXPERTS) for proj in ("gate_proj", "up_proj", "down_proj")}
        tensors[p + ".gate_up_proj"] = torch.stack(
            [torch.cat([per[e, "gate_proj"], per[e, "up_proj"]]) for e in range(NUM_EXPERTS)])
        tensors[p + ".down_proj"] = torch.stack(
            [per[e, "down_proj"] for e in range(NUM_EXPERTS)])
    path = tmp_path_factory.mktemp("moe_stacked") / "src"
    path.mkdir()
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text((moe_src / "config.json").read_text())
    return path


def _expert_weight(tensors: dict[str, torch.Tensor], p: str, e: int, proj: str,
                   stacked: bool) -> torch.Tensor:
    """Expert ``e``'s ``proj`` weight ``[N, K]`` of layer ``p`` in ``tensors``, either layout."""
    if not stacked:
        return tensors[f"{p}.{e}.{proj}.weight"]
    if proj == "down_proj":
        return tensors[p + ".down_proj"][e]
    gate_up = tensors[p + ".gate_up_proj"][e]
    return gate_up[:MOE_INTER] if proj == "gate_proj" else gate_up[MOE_INTER:]


def _unpack_layer(fmt: str, dst: dict[str, torch.Tensor], prefix: str, n: int,
                  k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the shapes of dst's layer ``prefix`` (``[n, k]``, group 16) in format ``fmt``;
    returns its dequantized weight and its g_idx."""
    groups = k // 16
    if fmt.startswith("gptq"):
        qweight, qzeros, scales, g_idx = (
            dst[f"{prefix}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx"))
        assert qweight.shape == (k // 8, n) and qzeros.shape == (groups, n // 8)
        assert scales.shape == (groups, n) and g_idx.shape == (k,)
        return unpack_gptq(qweight, qzeros, scales, g_idx, 4), g_idx.long()
    if fmt == "awq":
        qweight, qzeros, scales = (dst[f"{prefix}.{s}"] for s in ("qweight", "qzeros", "scales"))
        assert qweight.shape == (k, n // 8) and qzeros.shape == (groups, n // 8)
        assert scales.shape == (groups, n)
        return unpack_awq(qweight, qzeros, scales, 16), torch.arange(k) // 16
    packed, scale, zero_point, shape = (dst[f"{prefix}.{s}"] for s in (
        "weight_packed", "weight_scale", "weight_zero_point", "weight_shape"))
    assert packed.shape == (n, k // 8) and scale.shape == (n, groups)
    assert zero_point.shape == (n // 8, groups) and shape.tolist() == [n, k]
    return unpack_compressed_tensors(packed, scale, zero_point, None, 4), torch.arange(k) // 16


@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked"])
@pytest.mark.parametrize("fmt", list(EXPERT_FORMATS))
def test_experts(moe_src: Path, moe_stacked_src: Path, tmp_path: Path, fmt: str,
                 stacked: bool) -> None:
    """``experts=True``: one quantized layer per expert and projection in dst, unpacking to the
    reference's (source-layout) experts exactly; the router and norms untouched."""
    writer, kwargs, suffixes = EXPERT_FORMATS[fmt]
    src = moe_stacked_src if stacked else moe_src
    writer(src, tmp_path / "dst", tmp_path / "ref", experts=True, **kwargs)
    source = load_file(src / "model.safetensors")
    dst, ref, _ = _load(tmp_path)
    assert set(ref) == set(source)
    for name, t in source.items():
        assert ref[name].shape == t.shape and ref[name].dtype == t.dtype
    assert not [n for n in dst if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert not [n for n in dst if ".experts." in n and n.endswith(".weight")]
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.input_layernorm.weight"):
        assert torch.equal(dst[name], source[name]) and torch.equal(ref[name], source[name])
    assert "model.layers.0.self_attn.q_proj." + sorted(suffixes)[0] in dst
    g_by_k: dict[int, torch.Tensor] = {}
    _, g_by_k[MOE_HIDDEN] = _unpack_layer(fmt, dst, "model.layers.0.self_attn.q_proj", 64, 64)
    for p in MOE_LAYERS:
        expected = {f"{p}.{e}.{proj}.{s}" for e in range(NUM_EXPERTS) for s in suffixes
                    for proj in ("gate_proj", "up_proj", "down_proj")}
        assert {n for n in dst if n.startswith(p + ".")} == expected
        for e in range(NUM_EXPERTS):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                w = _expert_weight(source, p, e, proj, stacked)
                n, k = w.shape
                assert (n, k) == ((MOE_HIDDEN, MOE_INTER) if proj == "down_proj"
                                  else (MOE_INTER, MOE_HIDDEN))
                deq, g_idx = _unpack_layer(fmt, dst, f"{p}.{e}.{proj}", n, k)
                assert torch.equal(deq.to(w.dtype), _expert_weight(ref, p, e, proj, stacked))
                assert torch.equal(g_by_k.setdefault(k, g_idx), g_idx)  # one permutation per K
                assert float((deq - w).abs().max()) < float(w.abs().max()) / 4
    if fmt == "gptq_desc_act":
        assert not torch.equal(g_by_k[MOE_INTER], torch.arange(MOE_INTER) // 16)


@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked"])
@pytest.mark.parametrize("fmt", ["gptq_asym", "awq", "ct_asym"])
def test_experts_off(moe_src: Path, moe_stacked_src: Path, tmp_path: Path, fmt: str,
                     stacked: bool) -> None:
    """``experts=False`` (the default): the experts' float tensors stay in dst as they are."""
    writer, kwargs, _ = EXPERT_FORMATS[fmt]
    src = moe_stacked_src if stacked else moe_src
    writer(src, tmp_path / "dst", tmp_path / "ref", **kwargs)
    source = load_file(src / "model.safetensors")
    dst, ref, _ = _load(tmp_path)
    experts = {n: t for n, t in source.items() if ".experts." in n}
    assert len(experts) == (2 if stacked else 3 * NUM_EXPERTS) * len(MOE_LAYERS)
    for name, t in experts.items():
        assert torch.equal(dst[name], t) and torch.equal(ref[name], t)
    assert {n for n in dst if ".experts." in n} == set(experts)
    assert "model.layers.0.self_attn.q_proj.weight" not in dst
