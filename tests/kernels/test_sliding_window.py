"""Sliding-window attention (``sliding_window``: a query at position ``p`` sees keys ``p - W + 1 ..
p``), logit soft-capping (``cap * tanh(score / cap)``) and attention sinks (a score per head
joining the softmax, valued zero): the torch reference against a naive loop, the Triton kernel
(prefill, mixed, split decode, RoPE inside decode) against the reference, and the torch
backend's CPU and device-agnostic paths."""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import (
    DEVICE,
    MIXED,
    Batch,
    _check,
    _fused_rope,
    _rope_case,
    make_batch,
)

from mrv2_kernels.paged_attention import paged_attention, paged_attention_ref

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


def naive_window(b: Batch, window: int, cap: float | None = None,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Per request, token and head: softmax over the last ``window`` keys up to the query."""
    q_all, kv = b.query, b.kv_cache
    heads, kv_heads, bs = q_all.shape[1], kv.shape[3], kv.shape[2]
    out = torch.zeros(q_all.shape, dtype=torch.float32, device=q_all.device)
    for i, (qlen, seq_len) in enumerate(zip(b.qlens, b.lens, strict=True)):
        for j in range(qlen):
            t = int(b.qsl[i]) + j
            pos = seq_len - qlen + j
            if pos < 0:
                continue
            keys = range(max(0, pos - window + 1), pos + 1)
            slots = [(int(b.block_table[i, p // bs]), p % bs) for p in keys]
            for h in range(heads):
                kh = h // (heads // kv_heads)
                k = torch.stack([kv[0, blk, off, kh].float() for blk, off in slots])
                v = torch.stack([kv[1, blk, off, kh].float() for blk, off in slots])
                s = (k @ q_all[t, h].float()) * b.scale
                if cap is not None:
                    s = cap * torch.tanh(s / cap)
                if sinks is not None:
                    p = torch.softmax(torch.cat([s, sinks[h:h + 1].float()]), 0)[:-1]
                    out[t, h] = p @ v
                    continue
                out[t, h] = torch.softmax(s, 0) @ v
    return out


def _batch(reqs: list[tuple[int, int]], dtype: torch.dtype = torch.float32, seed: int = 0,
           heads: int = 4, kv_heads: int = 2) -> Batch:
    return make_batch(reqs, num_heads=heads, num_kv_heads=kv_heads, head_dim=16, block_size=4,
                      dtype=dtype, pad_tokens=2, seed=seed)


@pytest.mark.parametrize("window", [1, 5, 16])
def test_ref_matches_naive(window: int) -> None:
    b = _batch([(1, 23), (13, 13), (9, 30), (0, 0)])
    ref = paged_attention_ref(b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table,
                              b.scale, **b.bounds, sliding_window=window)
    torch.testing.assert_close(ref.float(), naive_window(b, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "block_m", "block_n", "flat", "dtype"), [
    (5, None, None, True, torch.float32),
    (7, 16, 16, False, torch.float32),
    (12, 16, 32, True, torch.bfloat16),
    (64, None, None, True, torch.float32),  # wider than every sequence: plain causal
])
def test_prefill_and_mixed_steps(window: int, block_m: int | None, block_n: int | None,
                                 flat: bool, dtype: torch.dtype) -> None:
    """Query tiles whose rows' windows start in different key tiles; a decoding request beside
    prompts (one-token requests apart); NaN-poisoned output buffer."""
    b = _batch(MIXED, dtype, seed=window)
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    ref = paged_attention_ref(*args, **b.bounds, sliding_window=window)
    out = paged_attention(*args, **b.bounds, sliding_window=window, block_m=block_m,
                          block_n=block_n, flat_grid=flat, one_token_apart=True,
                          out=torch.full_like(b.query, float("nan")))
    _check(out, ref, b, dtype)
    if window >= max(b.lens):
        plain = paged_attention_ref(*args, **b.bounds)
        torch.testing.assert_close(out.float(), plain.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("num_splits", "window"), [(1, 9), (3, 9), (4, 30), (2, 1)])
def test_split_decode_reads_the_window(num_splits: int, window: int) -> None:
    """Decode splits cut the window, not the whole context; keys before it are NaN and never
    read."""
    reqs = [(1, 77), (1, 1), (1, 40), (0, 0), (1, 17)]
    b = _batch(reqs, seed=11)
    flat = b.kv_cache.view(2, -1, 2, 16)
    for i, (_, seq_len) in enumerate(reqs):
        for p in range(max(0, seq_len - window - 4)):  # (tile alignment reads up to 3 more)
            blk = int(b.block_table[i, p // 4])
            flat[:, blk * 4 + p % 4] = float("nan")
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    ref = paged_attention_ref(*args, **b.bounds, sliding_window=window)
    out = paged_attention(*args, **b.bounds, uniform_decode=True, num_splits=num_splits,
                          sliding_window=window, block_n=16)
    _check(out, ref, b, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_rope_inside_decode_attention_with_a_window(num_splits: int) -> None:
    reqs = [(2, 37), (2, 2), (2, 20)]
    b, r = _rope_case(reqs, torch.float32, True, seed=5)
    from mrv2_kernels.rotary import rotary_embedding_ref

    want_cache = b.kv_cache.clone()
    q_ref, _ = rotary_embedding_ref(r["positions"], r["q"].clone(), r["k"].clone(),
                                    r["cos_sin"], 16, 16, r["qk_norm"],
                                    kv_write=(r["v"], want_cache, r["slots"]))
    num_tokens = b.query.shape[0]
    ref = paged_attention_ref(q_ref.reshape(num_tokens, 4, 16), want_cache, b.qsl, b.seq_lens,
                              b.block_table, b.scale, **b.bounds, sliding_window=6)
    cache = b.kv_cache.clone()
    out = paged_attention(r["q"].reshape(num_tokens, 4, 16), cache, b.qsl, b.seq_lens,
                          b.block_table, b.scale, **b.bounds, uniform_decode=True,
                          num_splits=num_splits, rope=_fused_rope(r), sliding_window=6)
    assert not cache.isnan().any(), "a new key or value was not stored"
    _check(out, ref, b, torch.float32)


@pytest.mark.parametrize("reqs", [MIXED, [(1, 30), (1, 30)], [(1, 9), (1, 30)]])
def test_torch_backend_paths(reqs: list[tuple[int, int]]) -> None:
    """The CPU plan (masks per window, kept per step) and the device-agnostic reference."""
    from mrv2.attention.torch_backend import TorchAttentionBackend
    from mrv2.contract.attention import AttentionMetadata

    b = _batch(reqs, seed=2)
    n = len(reqs)
    md = AttentionMetadata(n, b.query.shape[0], max(b.qlens), max(b.lens), b.qsl,
                           b.seq_lens, b.block_table, torch.zeros(b.query.shape[0]), 4)
    backend = TorchAttentionBackend()
    q, cache = b.query.cpu(), b.kv_cache.cpu()
    md.query_start_loc, md.seq_lens = md.query_start_loc.cpu(), md.seq_lens.cpu()
    md.block_table = md.block_table.cpu()
    for window in (3, 8, None):
        ref = paged_attention_ref(q, cache, md.query_start_loc, md.seq_lens, md.block_table,
                                  b.scale, **b.bounds, sliding_window=window)
        real = b.num_real_tokens
        fast = backend.forward(q, cache, md, b.scale, sliding_window=window)
        slow = backend.forward_reference(q, cache, md, b.scale, sliding_window=window)
        torch.testing.assert_close(fast[:real], ref[:real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(slow[:real], ref[:real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "cap"), [(None, 0.7), (5, 1.5)])
def test_softcap_ref_matches_naive(window: int | None, cap: float) -> None:
    b = _batch([(1, 23), (13, 13), (9, 30), (0, 0)], seed=8)
    b.query.mul_(4)  # scores well past the cap
    ref = paged_attention_ref(b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table,
                              b.scale, **b.bounds, sliding_window=window, logit_softcap=cap)
    naive = naive_window(b, window or 10**6, cap)
    torch.testing.assert_close(ref.float(), naive, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "cap", "decode", "splits"), [
    (None, 0.7, False, None), (6, 1.5, False, None), (None, 0.7, True, 3), (9, 2.0, True, 1),
])
def test_softcap_in_the_triton_kernel(window: int | None, cap: float, decode: bool,
                                      splits: int | None) -> None:
    reqs = [(1, 77), (1, 1), (1, 40), (0, 0), (1, 17)] if decode else MIXED
    b = _batch(reqs, seed=9)
    b.query.mul_(4)
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    ref = paged_attention_ref(*args, **b.bounds, sliding_window=window, logit_softcap=cap)
    plain = paged_attention_ref(*args, **b.bounds, sliding_window=window)
    out = paged_attention(*args, **b.bounds, uniform_decode=decode, num_splits=splits,
                          sliding_window=window, logit_softcap=cap)
    _check(out, ref, b, torch.float32)
    assert (ref - plain).abs().max() > 1e-2  # the cap changes the result


def test_torch_backend_softcap_paths() -> None:
    from mrv2.attention.torch_backend import TorchAttentionBackend
    from mrv2.contract.attention import AttentionMetadata

    b = _batch(MIXED, seed=10)
    b.query.mul_(4)
    n = len(MIXED)
    q, cache = b.query.cpu(), b.kv_cache.cpu()
    md = AttentionMetadata(n, q.shape[0], max(b.qlens), max(b.lens), b.qsl.cpu(),
                           b.seq_lens.cpu(), b.block_table.cpu(), torch.zeros(q.shape[0]), 4)
    backend = TorchAttentionBackend()
    for window in (None, 4):
        ref = paged_attention_ref(q, cache, md.query_start_loc, md.seq_lens, md.block_table,
                                  b.scale, **b.bounds, sliding_window=window, logit_softcap=0.9)
        real = b.num_real_tokens
        for got in (backend.forward(q, cache, md, b.scale, sliding_window=window,
                                    logit_softcap=0.9),
                    backend.forward_reference(q, cache, md, b.scale, sliding_window=window,
                                              logit_softcap=0.9)):
            torch.testing.assert_close(got[:real], ref[:real], atol=1e-5, rtol=1e-5)


def _sinks(heads: int, seed: int) -> torch.Tensor:
    return (torch.randn(heads, generator=torch.Generator().manual_seed(seed)) * 2).to(DEVICE)


@pytest.mark.parametrize(("window", "cap"), [(None, None), (5, 1.5)])
def test_sinks_ref_matches_naive(window: int | None, cap: float | None) -> None:
    b = _batch([(1, 23), (13, 13), (9, 30), (0, 0), (1, 0)], seed=12)
    sinks = _sinks(4, 3)
    ref = paged_attention_ref(b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table,
                              b.scale, **b.bounds, sliding_window=window, logit_softcap=cap,
                              sinks=sinks)
    naive = naive_window(b, window or 10**6, cap, sinks)
    torch.testing.assert_close(ref.float(), naive, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("window", "decode", "splits", "dtype"), [
    (None, False, None, torch.float32), (6, False, None, torch.bfloat16),
    (None, True, 3, torch.float32), (9, True, 4, torch.float32), (None, True, 1, torch.float32),
])
def test_sinks_in_the_triton_kernel(window: int | None, decode: bool, splits: int | None,
                                    dtype: torch.dtype) -> None:
    """Split decode counts each sink once (in split 0), however many splits a row has; a
    query with no key at all gives zeros (all its weight on the sink)."""
    reqs = [(1, 77), (1, 1), (1, 40), (0, 0), (1, 17)] if decode else MIXED
    b = _batch(reqs, dtype, seed=13)
    sinks = _sinks(4, 5)
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    ref = paged_attention_ref(*args, **b.bounds, sliding_window=window, sinks=sinks)
    plain = paged_attention_ref(*args, **b.bounds, sliding_window=window)
    out = paged_attention(*args, **b.bounds, uniform_decode=decode, num_splits=splits,
                          sliding_window=window, sinks=sinks, one_token_apart=True)
    _check(out, ref, b, dtype)
    assert (ref.float() - plain.float()).abs().max() > 1e-2  # the sinks change the result


def test_torch_backend_sink_paths() -> None:
    from mrv2.attention.torch_backend import TorchAttentionBackend
    from mrv2.contract.attention import AttentionMetadata

    for reqs in (MIXED, [(1, 30), (1, 12)]):
        b = _batch(reqs, seed=14)
        sinks = _sinks(4, 7).cpu()
        n = len(reqs)
        q, cache = b.query.cpu(), b.kv_cache.cpu()
        md = AttentionMetadata(n, q.shape[0], max(b.qlens), max(b.lens), b.qsl.cpu(),
                               b.seq_lens.cpu(), b.block_table.cpu(), torch.zeros(q.shape[0]),
                               4)
        backend = TorchAttentionBackend()
        ref = paged_attention_ref(q, cache, md.query_start_loc, md.seq_lens, md.block_table,
                                  b.scale, **b.bounds, sliding_window=4, sinks=sinks)
        real = b.num_real_tokens
        for got in (backend.forward(q, cache, md, b.scale, sliding_window=4, sinks=sinks),
                    backend.forward_reference(q, cache, md, b.scale, sliding_window=4,
                                              sinks=sinks)):
            torch.testing.assert_close(got[:real], ref[:real], atol=1e-5, rtol=1e-5)
