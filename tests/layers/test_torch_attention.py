"""The torch reference paged attention against a naive per-request dense attention."""

from __future__ import annotations

import math

import pytest
import torch

from mrv2.attention import AttentionMetadata
from mrv2.attention.torch_backend import TorchAttentionBackend

BLOCK_SIZE = 4
NUM_BLOCKS = 24
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
POISON = 1e4


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One request: ``q [Q, H, D]`` at the last ``Q`` positions of ``k``/``v`` ``[S, Hk, D]``."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    num_q, seq_len = q.shape[0], k.shape[0]
    out = torch.empty_like(q)
    for i in range(num_q):
        pos = seq_len - num_q + i
        scores = torch.einsum("hd,shd->hs", q[i], k[: pos + 1]) * scale
        out[i] = torch.einsum("hs,shd->hd", torch.softmax(scores, dim=-1), v[: pos + 1])
    return out


def slots_of(blocks: list[int], positions: range) -> list[int]:
    return [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def test_mixed_batch_matches_naive() -> None:
    gen = torch.Generator().manual_seed(0)
    backend = TorchAttentionBackend()
    # (cached context, new queries): decode, fresh prefill, chunked prefill, padding request.
    requests = [(5, 1), (0, 7), (6, 3), (0, 0)]
    num_pad_tokens = 2
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    # Block 0 first for the fresh prefill: a real token writes slot 0, where a careless
    # padding write (slot -1 clamped to 0) would land too.
    perm.remove(0)
    perm.insert(math.ceil(sum(requests[0]) / BLOCK_SIZE), 0)
    block_tables, used = [], set()
    for ctx, new in requests:
        n = math.ceil((ctx + new) / BLOCK_SIZE)
        block_tables.append(perm[:n])
        used.update(perm[:n])
        perm = perm[n:]
    max_blocks = max(len(b) for b in block_tables) + 1
    unused = perm  # never written: reads of them would show the poison
    table = torch.tensor(
        [b + unused[: max_blocks - len(b)] for b in block_tables], dtype=torch.int32
    )

    cache = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), POISON)
    # Slots past a sequence's end inside its own last block: NaN, which must not leak either.
    for (ctx, new), blocks in zip(requests, block_tables, strict=True):
        for slot in slots_of(blocks, range(ctx + new, len(blocks) * BLOCK_SIZE)):
            cache[:, slot // BLOCK_SIZE, slot % BLOCK_SIZE] = float("nan")

    full_k = [torch.randn(c + n, NUM_KV_HEADS, HEAD_DIM, generator=gen) for c, n in requests]
    full_v = [torch.randn(c + n, NUM_KV_HEADS, HEAD_DIM, generator=gen) for c, n in requests]

    # Earlier steps: the cached context.
    ctx_slots = sum(
        (slots_of(b, range(c)) for (c, _), b in zip(requests, block_tables, strict=True)), []
    )
    backend.write_kv(
        torch.cat([k[:c] for k, (c, _) in zip(full_k, requests, strict=True)]),
        torch.cat([v[:c] for v, (c, _) in zip(full_v, requests, strict=True)]),
        cache,
        torch.tensor(ctx_slots, dtype=torch.int64),
    )

    # This step: the new tokens, then padding tokens (slot -1) with random K/V.
    new_slots = sum(
        (slots_of(b, range(c, c + n)) for (c, n), b in zip(requests, block_tables, strict=True)), []
    )
    slot_mapping = torch.tensor(new_slots + [-1] * num_pad_tokens, dtype=torch.int64)
    pad_kv = torch.randn(num_pad_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, requests, strict=True)] + [pad_kv])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, requests, strict=True)] + [pad_kv])
    before = cache.clone()
    backend.write_kv(new_k, new_v, cache, slot_mapping)
    changed = (cache != before) & ~(cache.isnan() & before.isnan())
    written = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    written[new_slots] = True
    assert not changed.flatten(1, 2).any(dim=(0, 2, 3))[~written].any(), "padding was written"

    query_lens = [n for _, n in requests]
    num_tokens = sum(query_lens) + num_pad_tokens
    query = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    metadata = AttentionMetadata(
        num_reqs=len(requests),
        num_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(c + n for c, n in requests),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in requests], dtype=torch.int32),
        block_table=table,
        slot_mapping=slot_mapping,
        block_size=BLOCK_SIZE,
    )
    scale = HEAD_DIM**-0.5
    out = backend.forward(query, cache, metadata, scale)

    assert out.shape == query.shape and out.dtype == query.dtype
    for i, (_, n) in enumerate(requests):
        if n == 0:
            continue
        expected = naive_attention(query[starts[i] : starts[i + 1]], full_k[i], full_v[i], scale)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], expected, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out[starts[-1] :]).all()


def test_write_kv_all_padding_leaves_cache_untouched() -> None:
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    before = cache.clone()
    kv = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    TorchAttentionBackend().write_kv(kv, kv, cache, torch.full((3,), -1, dtype=torch.int64))
    assert torch.equal(cache, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_output_dtype_follows_query(dtype: torch.dtype) -> None:
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    query = torch.randn(3, NUM_HEADS, HEAD_DIM).to(dtype)
    metadata = AttentionMetadata(
        num_reqs=1,
        num_tokens=3,
        max_query_len=3,
        max_seq_len=3,
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        seq_lens=torch.tensor([3], dtype=torch.int32),
        block_table=torch.tensor([[7]], dtype=torch.int32),
        slot_mapping=torch.tensor([28, 29, 30]),
        block_size=BLOCK_SIZE,
    )
    out = TorchAttentionBackend().forward(query, cache, metadata, 0.5)
    expected = naive_attention(query.float(), cache[0, 7, :3].float(), cache[1, 7, :3].float(), 0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
