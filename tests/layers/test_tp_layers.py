"""Tensor-parallel layers, one rank at a time (no processes): each rank's loader takes its part
of the whole checkpoint tensor, and the ranks' outputs put together (concatenated for column
layers, summed for row layers and experts) equal the unsplit layer's."""

from __future__ import annotations

from contextlib import AbstractContextManager

import pytest
import torch

from mrv2.distributed import parallel_state
from mrv2.layers.embedding import LMHead, VocabEmbedding
from mrv2.layers.linear import MergedColumnLinear, QKVLinear, RowLinear
from mrv2.layers.moe import FusedMoE
from mrv2_kernels.fused_moe import fused_moe_ref

SIZE = 2


def as_rank(rank: int, size: int = SIZE) -> AbstractContextManager[None]:
    """Build layers as ``rank`` of ``size`` (no group: the test sums the partials itself)."""
    return parallel_state.as_rank(rank, size)


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])  # split, one each, replicated
def test_qkv_heads_per_rank(num_kv_heads: int) -> None:
    hidden, head_dim, heads = 16, 4, 4
    q, k, v = _rand(heads * head_dim, hidden), _rand(num_kv_heads * head_dim, hidden), \
        _rand(num_kv_heads * head_dim, hidden) + 1
    x = _rand(3, hidden)
    outs = []
    for rank in range(SIZE):
        with as_rank(rank):
            layer = QKVLinear(hidden, head_dim, heads, num_kv_heads)
        for shard, w in zip("qkv", (q, k, v), strict=True):
            layer.weight_loader(layer.weight, w, shard)
        assert layer.num_heads == heads // SIZE
        assert layer.num_kv_heads == max(1, num_kv_heads // SIZE)
        outs.append(layer.split(x @ layer.weight.T))
    ref_q, ref_k, ref_v = x @ q.T, x @ k.T, x @ v.T
    torch.testing.assert_close(torch.cat([o[0] for o in outs], -1), ref_q)
    kv_rows = max(1, num_kv_heads // SIZE) * head_dim
    for rank, (_, k_r, v_r) in enumerate(outs):
        first = (rank * num_kv_heads // SIZE) * head_dim
        torch.testing.assert_close(k_r, ref_k[:, first:first + kv_rows])
        torch.testing.assert_close(v_r, ref_v[:, first:first + kv_rows])


def test_gate_up_and_row_layers_sum_to_the_whole() -> None:
    hidden, inter = 8, 12
    gate, up, down = _rand(inter, hidden), _rand(inter, hidden) + 1, _rand(hidden, inter)
    bias = _rand(hidden)
    x = _rand(5, hidden)
    total = torch.zeros(5, hidden)
    for rank in range(SIZE):
        with as_rank(rank):
            gate_up = MergedColumnLinear(hidden, [inter, inter])
            row = RowLinear(inter, hidden, bias=True, reduce_output=False)
        gate_up.weight_loader(gate_up.weight, gate, 0)
        gate_up.weight_loader(gate_up.weight, up, 1)
        row.weight_loader(row.weight, down)
        assert row.bias is not None
        row.weight_loader(row.bias, bias)
        g, u = (x @ gate_up.weight.T).chunk(2, dim=-1)
        total += row(torch.nn.functional.silu(g) * u)
    ref = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T + bias
    torch.testing.assert_close(total, ref)


def test_vocab_parallel_embedding_and_head_with_a_padded_vocabulary() -> None:
    vocab, dim = 7, 4  # 4 rows per rank, the last one padding
    table = _rand(vocab, dim)
    ids = torch.tensor([0, 3, 4, 6, 2])
    hidden = _rand(2, dim)
    embedded, logits = torch.zeros(5, dim), []
    for rank in range(SIZE):
        with as_rank(rank):
            embed = VocabEmbedding(vocab, dim)
            head = LMHead(vocab, dim)
        embed.weight_loader(embed.weight, table)
        head.weight_loader(head.weight, table)
        local = ids - embed.vocab_start
        mine = (local >= 0) & (local < embed.weight.shape[0])
        embedded[mine] += embed.weight[local[mine]]
        logits.append(hidden @ head.weight.T)
    torch.testing.assert_close(embedded, table[ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], hidden @ table.T)


@pytest.mark.parametrize("stacked", [False, True])
def test_experts_split_inside_sum_to_the_whole(stacked: bool) -> None:
    experts, hidden, inter = 3, 8, 6
    w13, w2 = _rand(experts, 2 * inter, hidden) * 0.3, _rand(experts, hidden, inter) * 0.3
    x = _rand(4, hidden)
    topk_w = torch.softmax(_rand(4, 2), -1)
    topk_ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1]], dtype=torch.int32)
    total = torch.zeros(4, hidden)
    for rank in range(SIZE):
        with as_rank(rank):
            moe = FusedMoE(experts, hidden, inter, reduce_output=False)
        if stacked:
            moe.weight_loader(moe.w13_weight, w13)
            moe.weight_loader(moe.w2_weight, w2)
        else:
            for e in range(experts):
                moe.weight_loader(moe.w13_weight, w13[e, :inter], (e, "gate"))
                moe.weight_loader(moe.w13_weight, w13[e, inter:], (e, "up"))
                moe.weight_loader(moe.w2_weight, w2[e], (e, "down"))
        total += fused_moe_ref(x, moe.w13_weight, moe.w2_weight, topk_w, topk_ids)
    torch.testing.assert_close(total, fused_moe_ref(x, w13, w2, topk_w, topk_ids))


def test_an_indivisible_split_names_the_field() -> None:
    with as_rank(0, 3), pytest.raises(ValueError, match=r"num_attention_heads \(4\).*\(3\)"):
        QKVLinear(16, 4, 4, 4)


def test_a_rank_sized_checkpoint_tensor_is_refused() -> None:
    """Loaders take the whole tensor: one that happens to be a rank's size is an error, not a
    silent copy."""
    with as_rank(1):
        qkv = QKVLinear(16, 4, 4, 2)
        row = RowLinear(16, 8)
        moe = FusedMoE(2, 8, 6)
    with pytest.raises(ValueError, match="whole checkpoint tensor"):
        qkv.weight_loader(qkv.weight, _rand(8, 16), "q")
    with pytest.raises(ValueError, match="whole checkpoint tensor"):
        row.weight_loader(row.weight, _rand(8, 8))
    with pytest.raises(ValueError, match="whole checkpoint tensor"):
        moe.weight_loader(moe.w2_weight, _rand(8, 3), (0, "down"))
