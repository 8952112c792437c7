"""The torch backend's CPU path (``mrv2.attention.cpu_paged``) against its device-agnostic
reference (``forward_reference`` / ``write_kv_reference``), on the batches a step can carry."""

from __future__ import annotations

import pytest
import torch

from mrv2.attention import AttentionMetadata, ForwardContext, set_forward_context
from mrv2.attention.cpu_paged import paged_attention_cpu, plan_for, write_kv_cpu
from mrv2.attention.torch_backend import TorchAttentionBackend

BLOCK_SIZE = 4
NUM_BLOCKS = 40
HEAD_DIM = 8


def _step(
    requests: list[tuple[int, int]], num_pad: int, num_kv_heads: int, dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor, torch.Tensor]:
    """A cache holding each request's context (unused slots NaN) and one step's metadata,
    new keys and values; ``requests`` are ``(context, new tokens)``."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, starts, slots, seq_lens = [], [0], [], []
    cache = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM), float("nan"))
    for ctx, new in requests:
        n = -(-(ctx + new) // BLOCK_SIZE)
        blocks, perm = perm[:n], perm[n:]
        tables.append(blocks + [perm[0]] * (6 - n))  # columns past the sequence: never read
        for p in range(ctx):
            cache[:, blocks[p // BLOCK_SIZE], p % BLOCK_SIZE] = torch.randn(
                2, num_kv_heads, HEAD_DIM, generator=gen)
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                  for p in range(ctx, ctx + new)]
        starts.append(starts[-1] + new)
        seq_lens.append(ctx + new)
    num_tokens = starts[-1] + num_pad
    metadata = AttentionMetadata(
        num_reqs=len(requests), num_tokens=num_tokens,
        max_query_len=max(n for _, n in requests), max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1] * num_pad, dtype=torch.int64),
        block_size=BLOCK_SIZE,
        uniform_decode=all(n == 1 for _, n in requests),
    )
    key = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, HEAD_DIM, generator=gen)
    return cache.to(dtype), metadata, key.to(dtype), value.to(dtype)


STEPS = {
    "mixed": ([(5, 1), (0, 7), (6, 3), (0, 0)], 2),  # decode, prefill, chunk, padding request
    "decode_equal": ([(6, 1), (6, 1), (6, 1)], 0),  # no mask at all
    "decode_ragged": ([(9, 1), (2, 1), (5, 1)], 1),
    "one_prefill": ([(0, 11)], 0),
    "prefix_hit": ([(8, 5)], 0),
}


@pytest.mark.parametrize("name", list(STEPS))
@pytest.mark.parametrize("num_kv_heads,num_heads", [(2, 2), (2, 4), (1, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_matches_reference(
    name: str, num_kv_heads: int, num_heads: int, dtype: torch.dtype
) -> None:
    requests, num_pad = STEPS[name]
    cache, metadata, key, value = _step(requests, num_pad, num_kv_heads, dtype)
    backend = TorchAttentionBackend()
    want_cache = cache.clone()
    backend.write_kv_reference(key, value, want_cache, metadata.slot_mapping)
    backend.write_kv(key, value, cache, metadata.slot_mapping)
    assert torch.equal(cache.nan_to_num(7.0), want_cache.nan_to_num(7.0))

    gen = torch.Generator().manual_seed(1)
    query = torch.randn(metadata.num_tokens, num_heads, HEAD_DIM, generator=gen).to(dtype)
    got = backend.forward(query, cache, metadata, HEAD_DIM**-0.5)
    want = backend.forward_reference(query, cache, metadata, HEAD_DIM**-0.5)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    real = int(metadata.query_start_loc[-1])
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))  # padding rows


def test_plan_is_built_once_per_step_and_shared_by_layers() -> None:
    cache, metadata, key, value = _step([(6, 1), (3, 1)], 0, 2, torch.float32)
    caches = [cache, cache.clone()]
    backend = TorchAttentionBackend()
    query = torch.randn(2, 4, HEAD_DIM)
    with set_forward_context(ForwardContext(metadata, caches, [backend, backend])):
        for c in caches:
            backend.write_kv(key, value, c, metadata.slot_mapping)
        plan = plan_for(metadata)
        outs = [backend.forward(query, c, metadata, 0.3) for c in caches]
    assert plan_for(metadata) is plan and plan.write_rows is None
    torch.testing.assert_close(outs[0], outs[1], atol=0.0, rtol=0.0)
    want = backend.forward_reference(query, caches[0], metadata, 0.3)
    torch.testing.assert_close(outs[0], want, atol=1e-5, rtol=1e-5)


def test_write_without_plan_skips_padding_slots() -> None:
    cache = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_DIM)
    want = cache.clone()
    key, value = torch.randn(4, 2, HEAD_DIM), torch.randn(4, 2, HEAD_DIM)
    slots = torch.tensor([-1, 13, -1, 2], dtype=torch.int32)
    write_kv_cpu(key, value, cache, slots)
    TorchAttentionBackend().write_kv_reference(key, value, want, slots.long())
    assert torch.equal(cache, want)


def test_step_without_queries_gives_zeros() -> None:
    cache, metadata, _, _ = _step([(4, 0)], 2, 2, torch.float32)
    query = torch.randn(2, 2, HEAD_DIM)
    assert torch.equal(paged_attention_cpu(query, cache, metadata, 1.0), torch.zeros_like(query))
