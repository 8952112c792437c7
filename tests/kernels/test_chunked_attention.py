"""Chunked local attention (``attention_chunk``, Llama 4's ``attention_chunk_size``: a query at
position ``p`` sees keys ``(p // C) * C .. p``): the torch reference against a naive loop, the
Triton kernel (prefill and mixed plans with chunk boundaries inside query tiles, split decode,
spec-decode-sized queries across a boundary, RoPE inside decode, the TMA prefill bypassed, an
fp8 cache) against the reference with every key before a query's chunk NaN and the output
NaN-poisoned, the refusals, and the torch backend's CPU and device-agnostic paths."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_paged_attention import (
    DEVICE,
    Batch,
    _check,
    _fused_rope,
    _rope_case,
    count_calls,
    make_batch,
)

from mrv2_kernels import paged_attention as paged_module
from mrv2_kernels.kv_cache import FP8_KV_DTYPE, to_cache_dtype
from mrv2_kernels.paged_attention import attention_plan, paged_attention, paged_attention_ref

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

#: (query_len, seq_len): decode past two chunk boundaries, a fresh prompt over three chunks, a
#: prompt chunk after a prefix whose query tiles each hold a boundary (positions 29..49), a
#: decode row in the first chunk, an empty request, a three-token query across position 32.
MIXED = [(1, 40), (37, 37), (21, 50), (1, 17), (0, 0), (3, 33)]


def _batch(reqs: list[tuple[int, int]], dtype: torch.dtype = torch.float32, seed: int = 0,
           block_size: int = 16) -> Batch:
    return make_batch(reqs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=block_size,
                      dtype=dtype, pad_tokens=2, seed=seed)


def _args(b: Batch) -> tuple[Any, ...]:
    return b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale


def _hide_before_chunks(b: Batch, chunk: int) -> None:
    """NaN in every key and value before the chunk of each request's first query: never read."""
    bs = b.kv_cache.shape[2]
    flat = b.kv_cache.view(2, -1, *b.kv_cache.shape[3:])
    for i, (qlen, seq_len) in enumerate(zip(b.qlens, b.lens, strict=True)):
        first = max(seq_len - qlen, 0) // chunk * chunk
        for p in range(first):
            flat[:, int(b.block_table[i, p // bs]) * bs + p % bs] = float("nan")


def naive_chunked(b: Batch, chunk: int) -> torch.Tensor:
    """Per request, token and head: softmax over the keys of the query's chunk up to it."""
    q_all, kv = b.query, b.kv_cache
    heads, kv_heads, bs = q_all.shape[1], kv.shape[3], kv.shape[2]
    out = torch.zeros(q_all.shape, dtype=torch.float32, device=q_all.device)
    for i, (qlen, seq_len) in enumerate(zip(b.qlens, b.lens, strict=True)):
        for j in range(qlen):
            t, pos = int(b.qsl[i]) + j, seq_len - qlen + j
            slots = [(int(b.block_table[i, p // bs]), p % bs)
                     for p in range(pos // chunk * chunk, pos + 1)]
            for h in range(heads):
                kh = h // (heads // kv_heads)
                k = torch.stack([kv[0, blk, off, kh].float() for blk, off in slots])
                v = torch.stack([kv[1, blk, off, kh].float() for blk, off in slots])
                out[t, h] = torch.softmax((k @ q_all[t, h].float()) * b.scale, 0) @ v
    return out


@pytest.mark.parametrize("chunk", [1, 16, 20])
def test_ref_matches_naive(chunk: int) -> None:
    b = _batch(MIXED, block_size=4)
    ref = paged_attention_ref(*_args(b), **b.bounds, attention_chunk=chunk)
    torch.testing.assert_close(ref.float(), naive_chunked(b, chunk), atol=1e-5, rtol=1e-5)
    plain = paged_attention_ref(*_args(b), **b.bounds)  # (past the first chunk: different)
    assert (ref[0] - plain[0]).abs().max() > 1e-2


@pytest.mark.parametrize(("chunk", "block_m", "block_n", "flat", "dtype"), [
    (16, None, None, True, torch.float32),  # chunks of one key tile, query tiles of 16 tokens
    (32, 16, 16, False, torch.float32),  # 8-token query tiles
    (20, 32, 32, True, torch.bfloat16),  # chunk starts inside key tiles
    (64, None, None, True, torch.float32),  # past every sequence: plain causal
])
def test_prefill_and_mixed_steps(chunk: int, block_m: int | None, block_n: int | None,
                                 flat: bool, dtype: torch.dtype) -> None:
    """Query tiles whose rows' chunks start apart, a decoding request beside prompts (one-token
    requests apart), keys before each request's first chunk NaN."""
    b = _batch(MIXED, dtype, seed=chunk)
    _hide_before_chunks(b, chunk)
    ref = paged_attention_ref(*_args(b), **b.bounds, attention_chunk=chunk)
    assert not attention_plan(b.query, b.kv_cache, **b.bounds).small_q
    out = paged_attention(*_args(b), **b.bounds, attention_chunk=chunk, block_m=block_m,
                          block_n=block_n, flat_grid=flat, one_token_apart=True,
                          out=torch.full_like(b.query, float("nan")))
    _check(out, ref, b, dtype)
    assert (out[b.num_real_tokens:] == 0).all()
    if chunk >= max(b.lens):
        plain = paged_attention_ref(*_args(b), **b.bounds)
        torch.testing.assert_close(out.float(), plain.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("chunk", "num_splits", "qlen"), [(32, 1, 1), (32, 3, 1), (20, 4, 1),
                                                           (16, 2, 3)])
def test_split_decode_reads_the_chunk(chunk: int, num_splits: int, qlen: int) -> None:
    """Decode splits cut the chunk, not the context (keys before it are NaN); queries of three
    tokens (spec decode) whose rows sit in two chunks."""
    reqs = [(qlen, 77), (qlen, qlen), (qlen, 40), (0, 0), (qlen, 33)]
    b = _batch(reqs, seed=11)
    _hide_before_chunks(b, chunk)
    ref = paged_attention_ref(*_args(b), **b.bounds, attention_chunk=chunk)
    plan = attention_plan(b.query, b.kv_cache, **b.bounds, uniform_decode=True,
                          num_splits=num_splits)
    assert plan.small_q and plan.num_splits == num_splits
    out = paged_attention(*_args(b), **b.bounds, uniform_decode=True, num_splits=num_splits,
                          attention_chunk=chunk, out=torch.full_like(b.query, float("nan")))
    _check(out, ref, b, torch.float32)


def test_fp8_cache() -> None:
    """bf16 queries over an fp8 cache, a mixed step and a decode step, keys before the chunks
    NaN (e4m3's NaN)."""
    for reqs, decode in ((MIXED, False), ([(1, 77), (1, 40), (1, 17)], True)):
        b = _batch(reqs, torch.bfloat16, seed=5)
        _hide_before_chunks(b, 16)
        b.kv_cache = to_cache_dtype(b.kv_cache.float() * 8, FP8_KV_DTYPE)
        assert b.kv_cache.float().isnan().any()
        ref = paged_attention_ref(*_args(b), **b.bounds, attention_chunk=16)
        out = paged_attention(*_args(b), **b.bounds, uniform_decode=decode,
                              num_splits=3 if decode else None, attention_chunk=16,
                              out=torch.full_like(b.query, float("nan")))
        _check(out, ref, b, torch.bfloat16)


@pytest.mark.parametrize(("num_splits", "tma"), [(3, "0"), (None, "1")])
def test_rope_inside_attention_and_no_tma_prefill(num_splits: int | None, tma: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw q/k/v: split decode rotates and stores the step's keys itself (their slots start
    NaN) with chunks of 8 (queries of two tokens across a boundary); a prefill plan with
    ``MRV2_TMA_PREFILL=1`` never takes the TMA kernel, which has no chunked mode."""
    from mrv2_kernels.prefill_attention import TMA_PREFILL_ENV_VAR
    from mrv2_kernels.rotary import rotary_embedding_ref

    monkeypatch.setenv(TMA_PREFILL_ENV_VAR, tma)
    tma_calls = count_calls(monkeypatch, paged_module, "prefill_attention_tma")
    reqs = [(2, 37), (2, 2), (2, 25)] if num_splits else [(1, 23), (20, 20), (17, 30)]
    b, r = _rope_case(reqs, torch.float32, True, seed=5)
    want_cache = b.kv_cache.clone()
    q_ref, _ = rotary_embedding_ref(r["positions"], r["q"].clone(), r["k"].clone(),
                                    r["cos_sin"], 16, 16, r["qk_norm"],
                                    kv_write=(r["v"], want_cache, r["slots"]))
    num_tokens = b.query.shape[0]
    ref = paged_attention_ref(q_ref.reshape(num_tokens, 4, 16), want_cache, *_args(b)[2:],
                              **b.bounds, attention_chunk=8)
    cache = b.kv_cache.clone()
    out = paged_attention(r["q"].reshape(num_tokens, 4, 16), cache, *_args(b)[2:], **b.bounds,
                          uniform_decode=num_splits is not None, num_splits=num_splits,
                          rope=_fused_rope(r), attention_chunk=8)
    assert not cache.isnan().any(), "a new key or value was not stored"
    assert not tma_calls
    _check(out, ref, b, torch.float32)


def test_refusals() -> None:
    """A chunk below 1, or a chunk with a sliding window: ValueErrors naming the fields, from
    the kernel's launcher and the reference alike."""
    b = _batch([(1, 5)])
    for fn in (paged_attention, paged_attention_ref):
        with pytest.raises(ValueError, match=r"attention_chunk must be None or >= 1, got 0"):
            fn(*_args(b), **b.bounds, attention_chunk=0)
        with pytest.raises(ValueError, match=r"sliding_window \(4\) and attention_chunk \(8\)"):
            fn(*_args(b), **b.bounds, sliding_window=4, attention_chunk=8)


@pytest.mark.parametrize("reqs", [MIXED, [(1, 40), (1, 40)], [(1, 9), (1, 77)]])
def test_torch_backend_paths(reqs: list[tuple[int, int]]) -> None:
    """The CPU plan (masks per chunk size, kept per step) and the device-agnostic reference."""
    from mrv2.attention.torch_backend import TorchAttentionBackend
    from mrv2.contract.attention import AttentionMetadata

    b = _batch(reqs, seed=2, block_size=4)
    q, cache = b.query.cpu(), b.kv_cache.cpu()
    md = AttentionMetadata(len(reqs), q.shape[0], max(b.qlens), max(b.lens), b.qsl.cpu(),
                           b.seq_lens.cpu(), b.block_table.cpu(), torch.zeros(q.shape[0]), 4)
    backend = TorchAttentionBackend()
    assert backend.attention_chunk
    real = b.num_real_tokens
    for chunk in (8, 16, None):
        ref = paged_attention_ref(q, cache, md.query_start_loc, md.seq_lens, md.block_table,
                                  b.scale, **b.bounds, attention_chunk=chunk)
        for got in (backend.forward(q, cache, md, b.scale, attention_chunk=chunk),
                    backend.forward_reference(q, cache, md, b.scale, attention_chunk=chunk)):
            torch.testing.assert_close(got[:real], ref[:real], atol=1e-5, rtol=1e-5)


def test_attention_layer_option() -> None:
    """``Attention(attention_chunk=C)`` checks ``C`` (None or >= 1, never with a sliding
    window) when built, and passes it to backends that take it (a ValueError naming the
    option and the backend for one that does not)."""
    from types import SimpleNamespace

    from mrv2.attention.torch_backend import TorchAttentionBackend
    from mrv2.layers import Attention

    with pytest.raises(ValueError, match=r"attention_chunk must be None or >= 1, got 0"):
        Attention(4, 2, 16, 0.25, 0, attention_chunk=0)
    with pytest.raises(ValueError, match=r"sliding_window \(4\) and attention_chunk \(8\)"):
        Attention(4, 2, 16, 0.25, 0, sliding_window=4, attention_chunk=8)
    layer = Attention(4, 2, 16, 0.25, 3, attention_chunk=8)
    assert "attention_chunk=8" in layer.extra_repr()
    assert layer._options(TorchAttentionBackend(), None) == {"attention_chunk": 8}
    with pytest.raises(ValueError, match=r"layer 3 attends with attention_chunk; the 'old'"):
        layer._options(SimpleNamespace(name="old"), None)


_SM90_SCRIPT = r"""
from mrv2_kernels import paged_attention as m

bf, f8, f32, i32 = "*bf16", "*fp8e4nv", "*fp32", "*i32"
ptrs = {"q_ptr": bf, "k_ptr": bf, "v_ptr": bf, "out_ptr": bf, "part_m_ptr": f32,
        "part_l_ptr": f32, "part_acc_ptr": f32, "qsl_ptr": i32, "seq_lens_ptr": i32,
        "block_table_ptr": i32, "pos_ptr": "*i64", "cos_sin_ptr": f32, "q_w_ptr": bf,
        "k_w_ptr": bf, "new_k_ptr": bf, "new_v_ptr": bf, "slot_ptr": "*i64"}
common = dict(HEAD_DIM=128, HEAD_DIM_P2=128, KV_BLOCK_SIZE=16, DOT_FP32=False,
              FP32_PRECISION="tf32x3",
              PDL=True, EARLY_META=False, SKIP_LONG=False, GROUP=5, GROUP_P2=8,
              ZERO_PAD=True, REQ_BLOCK=256, ONE_TOKEN=0, SLIDING=False, CAP=0.0,
              SINKS=False, sinks_ptr=None, CHUNK=8192)
# Llama 4 Scout's heads (40 over 8): a prefill plan's tiles over a bf16 cache; split decode
# with RoPE inside over an fp8 cache
build(m._paged_attn_kernel, ptrs,
      dict(common, BLOCK_Q=16, BLOCK_M=128, BLOCK_N=32, USE_SPLITS=False, FLAT=True,
           ROPE=False, QK_NORM=False), num_warps=8, num_stages=2)
build(m._paged_attn_kernel, dict(ptrs, k_ptr=f8, v_ptr=f8),
      dict(common, BLOCK_Q=2, BLOCK_M=16, BLOCK_N=64, USE_SPLITS=True, FLAT=False,
           ROPE=True, QK_NORM=True), num_warps=2, num_stages=2)
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU run compiles it for real")
def test_chunked_kernels_compile_for_sm90(tmp_path: Any) -> None:
    """The chunked kernel (``CHUNK`` 8192) compiles for an H100/H200 (no GPU needed): a
    prefill plan over a bf16 cache and split decode over an fp8 one, with no math repeated
    across threads."""
    from sm90 import compile_for_sm90

    sizes = compile_for_sm90(_SM90_SCRIPT, tmp_path)["_paged_attn_kernel"]
    assert len(sizes) == 2 and all(s > 0 for s in sizes)
