"""The TMA prefill attention kernel against the paged reference.

Under ``TRITON_INTERPRET=1`` on CPU (root conftest; the interpreter runs tensor descriptors
too), with ``MRV2_TMA_PREFILL=1`` so that it runs there; with ``MRV2_TEST_GPU=1`` on an H200
the compiled kernel. The step's keys and values are strided slices of one fused QKV buffer
(as in a model) and are also in the cache; every other cache slot no request may read is
poisoned, and ``out`` starts as NaN.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_paged_attention import (
    DEVICE,
    POISON,
    _check,
    _fused_rope,
    _rope_case,
    _rope_reference,
    count_calls,
    make_batch,
)

from mrv2_kernels import paged_attention as paged_module
from mrv2_kernels.paged_attention import (
    attention_plan,
    paged_attention,
    paged_attention_ref,
)
from mrv2_kernels.prefill_attention import (
    TMA_PREFILL_ENV_VAR,
    prefill_attention_tma,
    tma_prefill_min_query,
    use_tma_prefill,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

# (query_len, seq_len): a fresh prompt over several tiles, a chunk after a prefix (earlier
# chunk or cached prefix) whose length is not a tile multiple, a decode row of a mixed step,
# a zero-length request, a one-token prompt.
REQS = [(37, 37), (21, 50), (1, 19), (0, 0), (1, 1)]


def _step_kv(b: Any, heads: int, kv_heads: int, d: int, seed: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query, key and value as slices of one fused QKV buffer, the key/value rows being what
    the cache holds at each token's position (the new tokens' slots)."""
    num_tokens = b.query.shape[0]
    bs = b.kv_cache.shape[2]
    qkv = torch.full((num_tokens, (heads + 2 * kv_heads) * d), POISON, dtype=b.query.dtype,
                     device=DEVICE)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    q.copy_(b.query.reshape(num_tokens, -1))
    for i, (qlen, seq_len) in enumerate(zip(b.qlens, b.lens, strict=True)):
        for j in range(qlen):
            p = seq_len - qlen + j
            blk = int(b.block_table[i, p // bs])
            t = int(b.qsl[i]) + j
            k[t] = b.kv_cache[0, blk, p % bs].reshape(-1)
            v[t] = b.kv_cache[1, blk, p % bs].reshape(-1)
    return q.view(num_tokens, heads, d), k, v


@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "block_n"),
    [(torch.bfloat16, 8, 2, 16), (torch.float32, 6, 2, 32), (torch.float32, 4, 4, 16)],
)
def test_tma_prefill_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int,
                                       block_n: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """GQA groups of 4, 3 and 1; prefix keys from the cache, the chunk's from the step
    tensors; every request (here even one-token ones: ``min_query_len`` 0); padding rows
    are left alone."""
    monkeypatch.setenv(TMA_PREFILL_ENV_VAR, "1")
    d = 16
    b = make_batch(REQS, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, block_size=4,
                   dtype=dtype, pad_tokens=2, seed=5)
    q, k, v = _step_kv(b, heads, kv_heads, d, seed=6)
    assert use_tma_prefill(q, k, v)
    ref = paged_attention_ref(b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale,
                              **b.bounds)
    out = torch.full_like(b.query, float("nan"))
    prefill_attention_tma(q, k, v, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale,
                          max_query_len=max(b.qlens), num_reqs=len(b.qlens), out=out,
                          block_n=block_n)
    _check(out, ref, b, dtype)
    assert out[b.num_real_tokens:].isnan().all(), "a padding row was written"


def test_tma_prefill_tiles_last_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """``tiles_last``: the grid (head, request, query tile) computes every tile as the default
    (query tile, head, request) one does, bit for bit; padding rows stay unwritten."""
    monkeypatch.setenv(TMA_PREFILL_ENV_VAR, "1")
    b = make_batch(REQS, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                   dtype=torch.float32, pad_tokens=2, seed=7)
    q, k, v = _step_kv(b, 4, 2, 16, seed=8)
    outs = []
    for last in (False, True):
        out = torch.full_like(b.query, float("nan"))
        prefill_attention_tma(q, k, v, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale,
                              max_query_len=max(b.qlens), num_reqs=len(b.qlens), out=out,
                              tiles_last=last)
        outs.append(out)
    real = b.num_real_tokens
    assert torch.equal(outs[0][:real], outs[1][:real]) and not outs[1][:real].isnan().any()
    assert outs[1][real:].isnan().all(), "a padding row was written"


def test_tma_prefill_never_reads_the_cache_for_the_chunk(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The chunk's keys come from the step tensors: NaN in their cache slots changes nothing,
    and large values in the step rows past the last request (the descriptor's tile overruns
    into them, as into the next request's rows) are masked out."""
    monkeypatch.setenv(TMA_PREFILL_ENV_VAR, "1")
    heads, kv_heads, d, bs = 4, 2, 16, 4
    b = make_batch(REQS, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, block_size=bs,
                   dtype=torch.float32, pad_tokens=2, seed=8)
    q, k, v = _step_kv(b, heads, kv_heads, d, seed=9)
    ref = paged_attention_ref(b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale,
                              **b.bounds)
    cache = b.kv_cache.clone()
    for i, (qlen, seq_len) in enumerate(zip(b.qlens, b.lens, strict=True)):
        for p in range(seq_len - qlen, seq_len):
            cache[:, int(b.block_table[i, p // bs]), p % bs] = float("nan")
    k[b.num_real_tokens:] = -POISON
    v[b.num_real_tokens:] = POISON
    out = torch.full_like(b.query, float("nan"))
    prefill_attention_tma(q, k, v, cache, b.qsl, b.seq_lens, b.block_table, b.scale,
                          max_query_len=max(b.qlens), num_reqs=len(b.qlens), out=out)
    _check(out, ref, b, torch.float32)


def test_short_requests_are_left_to_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``min_query_len``, requests with fewer query tokens are not written at all."""
    monkeypatch.setenv(TMA_PREFILL_ENV_VAR, "1")
    heads, kv_heads, d = 4, 2, 16
    b = make_batch(REQS, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, block_size=4,
                   dtype=torch.float32, pad_tokens=2, seed=12)
    q, k, v = _step_kv(b, heads, kv_heads, d, seed=13)
    ref = paged_attention_ref(b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale,
                              **b.bounds)
    out = torch.full_like(b.query, float("nan"))
    prefill_attention_tma(q, k, v, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale,
                          max_query_len=max(b.qlens), num_reqs=len(b.qlens), out=out,
                          min_query_len=21)
    long_rows = torch.zeros(out.shape[0], dtype=torch.bool, device=DEVICE)
    for i, qlen in enumerate(b.qlens):
        if qlen >= 21:
            long_rows[int(b.qsl[i]):int(b.qsl[i]) + qlen] = True
    assert long_rows.sum() == 37 + 21
    assert out[~long_rows].isnan().all()
    torch.testing.assert_close(out[long_rows], ref[long_rows], atol=1e-4, rtol=1e-4)


def test_rope_prefill_plan_takes_the_tma_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through paged_attention with raw q/k/v (FusedRope) and a prefill plan: the RoPE kernel
    rotates and stores, then the TMA kernel attends for the requests of a query tile or more
    (its keys: the rotated ones in place) and the paged kernel for the rest (a decode row, a
    short chunk) and the padding; with ``MRV2_TMA_PREFILL=0`` the paged kernel does it all.
    Both match the reference."""
    calls = count_calls(monkeypatch, paged_module, "prefill_attention_tma")
    tile = tma_prefill_min_query(torch.empty(0, device=DEVICE))  # 16 on CPU, 64 on a GPU
    reqs = [(1, 23), (tile + 4, tile + 4), (9, 30), (tile + 1, tile + 24)]
    for setting, want_calls in (("1", 1), ("0", 1)):
        monkeypatch.setenv(TMA_PREFILL_ENV_VAR, setting)
        b, r = _rope_case(reqs, torch.float32, True, seed=3)
        num_tokens = b.query.shape[0]
        ref, want_cache = _rope_reference(b, r)
        assert not attention_plan(b.query, b.kv_cache, **b.bounds).small_q
        cache = b.kv_cache.clone()
        out = paged_attention(
            r["q"].reshape(num_tokens, 4, 16), cache, b.qsl, b.seq_lens, b.block_table,
            b.scale, **b.bounds,
            out=torch.full((num_tokens, 4, 16), float("nan"), device=DEVICE),
            rope=_fused_rope(r),
        )
        assert len(calls) == want_calls
        torch.testing.assert_close(cache, want_cache, atol=1e-5, rtol=0)
        _check(out, ref, b, torch.float32)
        assert torch.equal(out[b.num_real_tokens:], torch.zeros_like(out[b.num_real_tokens:]))


def test_use_tma_prefill_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """On only with ``MRV2_TMA_PREFILL=1`` (off by default); never for misaligned rows (TMA
    needs 16-byte row strides and bases)."""
    q = torch.randn(5, 4, 16)
    kv = torch.randn(5, 2 * 32)
    k, v = kv[:, :32], kv[:, 32:]
    monkeypatch.setenv(TMA_PREFILL_ENV_VAR, "1")
    assert use_tma_prefill(q, k, v)
    odd = torch.randn(5, 33)[:, :32]  # row stride 33 floats: 132 bytes
    assert not use_tma_prefill(q, odd, v)
    monkeypatch.setenv(TMA_PREFILL_ENV_VAR, "0")
    assert not use_tma_prefill(q, k, v)
    monkeypatch.delenv(TMA_PREFILL_ENV_VAR)
    assert not use_tma_prefill(q, k, v)


_SM90_SCRIPT = r"""
from mrv2_kernels import prefill_attention as m

bf, i32 = "*bf16", "*i32"
build(m._tma_prefill_kernel,
      {"key_cache_ptr": bf, "value_cache_ptr": bf, "out_ptr": bf, "qsl_ptr": i32,
       "seq_lens_ptr": i32, "block_table_ptr": i32},
      dict(GROUP=4, BLOCK_M=64, BLOCK_N=64, HEAD_DIM=128, KV_BLOCK_SIZE=16, NUM_STAGES=3,
           DOT_FP32=False, FP32_PRECISION="tf32x3", PDL=True),
      descs={name: "tensordesc<bf16[64, 128]>" for name in ("q_desc", "k_desc", "v_desc")},
      num_warps=4)
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU run compiles it for real")
def test_kernel_compiles_for_sm90(tmp_path: Any) -> None:
    """Compiled for an H100/H200 (no GPU needed) with the default GPU tiles, so what only the
    compiler rejects (a name it cannot resolve, shared memory past the limit) fails here."""
    from sm90 import compile_for_sm90

    (shared,) = compile_for_sm90(_SM90_SCRIPT, tmp_path)["_tma_prefill_kernel"]
    # Two programs per SM need 2 x (shared + 1 KiB reserved) <= 228 KiB: one more byte and
    # the kernel runs one program per SM (H200: 223 against 341 TFLOP/s, BENCHMARKS.md
    # 2026-12-02).
    assert 0 < shared <= 115712, f"shared memory {shared} B: only one program fits an SM"
