"""Quantized linear layers loaded shard by shard, checked against plain-torch dequantization
written from the formats' descriptions (not mrv2's own dequantizing functions)."""

from __future__ import annotations

import pytest
import torch

from mrv2.distributed import parallel_state
from mrv2.layers.fp8 import to_fp8
from mrv2.layers.int_model import apply_int_quant
from mrv2.layers.int_quant import IntLinearMixin
from mrv2.layers.int_quant_config import IntQuantConfig
from mrv2.layers.linear import ColumnLinear, MergedColumnLinear, QKVLinear

FP8 = torch.float8_e4m3fn


def _block_fp8(n: int, k: int, block: tuple[int, int], seed: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A checkpoint's block-FP8 weight ``[n, k]``: the fp8 values, ``weight_scale_inv``
    ``[ceil(n / bn), ceil(k / bk)]`` and the real weight (each value times its block's
    scale)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(FP8)
    s = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) + 0.5
    real = torch.empty(n, k)
    for r in range(n):
        for c in range(k):
            real[r, c] = w[r, c].float() * s[r // block[0], c // block[1]]
    return w, s, real


@pytest.mark.parametrize(("num_kv_heads", "tp"), [(1, 1), (1, 2), (3, 1), (2, 2), (4, 2)])
def test_fp8_qkv_shards_not_whole_blocks(num_kv_heads: int, tp: int) -> None:
    """q / k / v shards of a block-FP8 checkpoint whose rows are not whole blocks (k and v:
    4 rows a head, blocks of 8 rows), with and without tensor parallelism (one k/v head
    replicated on both ranks)."""
    hidden, head_dim, heads, block = 16, 4, 4, (8, 8)
    shards = {name: _block_fp8(n, hidden, block, seed) for seed, (name, n) in enumerate(
        (("q", heads * head_dim), ("k", num_kv_heads * head_dim),
         ("v", num_kv_heads * head_dim)))}
    for rank in range(tp):
        with parallel_state.as_rank(rank, tp):
            layer = QKVLinear(hidden, head_dim, heads, num_kv_heads)
        to_fp8(layer, block, True)
        for name, (w, s, _) in shards.items():
            layer.weight.weight_loader(layer.weight, w, name)  # type: ignore[attr-defined]
            layer.weight_scale_inv.weight_loader(  # type: ignore[attr-defined]
                layer.weight_scale_inv, s, name)
        layer.process_weights_after_loading()  # (CPU: dequantized, a plain layer again)
        q_rows = heads // tp * head_dim
        kv_head = rank * num_kv_heads // tp
        kv_rows = max(1, num_kv_heads // tp) * head_dim
        want = torch.cat([shards["q"][2][rank * q_rows:(rank + 1) * q_rows],
                          *(shards[s][2][kv_head * head_dim:kv_head * head_dim + kv_rows]
                            for s in "kv")])
        torch.testing.assert_close(layer.weight.data, want, rtol=0, atol=0)


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_gate_up_shards_not_whole_blocks(tp: int) -> None:
    """gate / up shards of 12 rows each (blocks of 8 rows): each shard's scales by its own
    rows."""
    hidden, inter, block = 16, 12, (8, 8)
    gate, up = _block_fp8(inter, hidden, block, 5), _block_fp8(inter, hidden, block, 6)
    for rank in range(tp):
        with parallel_state.as_rank(rank, tp):
            layer = MergedColumnLinear(hidden, [inter, inter])
        to_fp8(layer, block, True)
        for shard, (w, s, _) in enumerate((gate, up)):
            layer.weight.weight_loader(layer.weight, w, shard)  # type: ignore[attr-defined]
            layer.weight_scale_inv.weight_loader(  # type: ignore[attr-defined]
                layer.weight_scale_inv, s, shard)
        layer.process_weights_after_loading()
        mine = inter // tp
        want = torch.cat([gate[2][rank * mine:(rank + 1) * mine],
                          up[2][rank * mine:(rank + 1) * mine]])
        torch.testing.assert_close(layer.weight.data, want, rtol=0, atol=0)


def _gptq_v1(n: int, k: int, group: int, seed: int) -> tuple[dict[str, torch.Tensor],
                                                             torch.Tensor]:
    """A 4-bit asymmetric GPTQ (v1) layer ``[n, k]`` with an activation order, packed by hand
    as AutoGPTQ does: ``qweight`` ``[k / 8, n]`` (input ``i`` at bits ``4 * (i % 8)`` of row
    ``i // 8``), ``qzeros`` ``[G, n / 8]`` (zero point minus one, packed along the outputs),
    ``scales`` ``[G, n]``, ``g_idx`` ``[k]``; and the real weight ``(q - zero) * scale``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    groups = k // group
    zero = torch.randint(1, 16, (n, groups), generator=g)
    scale = (torch.rand(n, groups, generator=g) * 0.1 + 0.01).half()
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[torch.randperm(k, generator=g)] = torch.arange(k) // group

    def pack(values: torch.Tensor) -> torch.Tensor:  # [R, M] -> int32 [R, M / 8], along M
        words = sum(values[:, i::8].long() << (4 * i) for i in range(8))
        return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)

    tensors = {"qweight": pack(q).T.contiguous(), "qzeros": pack((zero - 1).T.contiguous()),
               "scales": scale.T.contiguous(), "g_idx": g_idx.to(torch.int32)}
    real = (q - zero[:, g_idx]).float() * scale.float()[:, g_idx]
    return tensors, real


@pytest.mark.parametrize("kept", [True, False], ids=["integer", "cpu-plain"])
def test_int_layer_rows_reordered_in_place(kept: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """:meth:`IntLinearMixin.reorder_rows` (a model's permutation of a layer's output rows,
    DeepSeek's rope rows, Qwen3-Next's regrouping) on a GPTQ layer with an activation order:
    kept integer (the GPU's layer; the kernel under the interpreter here) or dequantized
    after, it computes ``x @ W[perm].T + b[perm]``."""
    n, k, group = 24, 64, 16
    tensors, real = _gptq_v1(n, k, group, seed=3)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(4))
    quant = IntQuantConfig("gptq", 4, group, sym=False, desc_act=True, zeros_minus_one=True)
    model = torch.nn.Sequential(ColumnLinear(k, n, bias=True))
    assert apply_int_quant(model, quant, ["0"]) == 1
    layer = model[0]
    assert isinstance(layer, IntLinearMixin)
    for role, t in tensors.items():
        param = getattr(layer, role)
        param.weight_loader(param, t)
    layer.bias.weight_loader(layer.bias, bias)  # type: ignore[union-attr,operator]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(5))

    def reorder(rows: torch.Tensor) -> None:
        rows.copy_(rows[perm].clone())

    monkeypatch.setenv("MRV2_KERNELS", "triton")  # the kernel, interpreted, on CPU tensors
    layer.order_inputs()
    layer.reorder_rows(reorder)
    if kept:
        layer.order_inputs()  # (again, as the layer's own hook does: changes nothing)
    else:
        layer.process_weights_after_loading()
        assert type(layer) is ColumnLinear
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(layer(x), x @ real[perm].T + bias[perm], rtol=1e-4, atol=1e-4)
