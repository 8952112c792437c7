"""The GPTQ / AWQ checkpoint writers of mrv2.testing_quant: packed shapes, unpacking back to the
reference's dequantized weights, and the quantization error bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mrv2.testing import make_tiny_checkpoint
from mrv2.testing_quant import (
    awq_checkpoint,
    gptq_checkpoint,
    is_quantized_weight,
    unpack_awq,
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
    from safetensors.torch import save_file

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
