"""Paged attention at head dims that are not powers of two (80: Pythia-2.8B, StableLM-3B, Phi-2;
96: Phi-3-mini, GPT-NeoX-20B; 160: StableLM-2-12B; the tiny 8 and 24 too): the kernels' tiles
are the next power of two wide and every load and store of a head is masked to its real
columns. Against paged_attention_ref, outputs poisoned (NaN) first, unused cache slots poisoned
too (:func:`test_paged_attention.make_batch`): a read past a head's last column (the next
head's keys, or past the cache) or a column left unwritten shows.

Under ``TRITON_INTERPRET=1`` on CPU; with ``MRV2_TEST_GPU=1`` on a CUDA machine the compiled
kernels.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_paged_attention import (
    DEVICE,
    MIXED,
    Batch,
    _check,
    _fused_rope,
    _rope_case,
    _rope_reference,
    count_calls,
    make_batch,
)

from mrv2_kernels.kv_cache import FP8_KV_DTYPE, to_cache_dtype
from mrv2_kernels.paged_attention import (
    attention_plan,
    head_tile,
    paged_attention,
    paged_attention_ref,
)
from mrv2_kernels.paged_attention_plan import rope_in_kernel
from mrv2_kernels.prefill_attention import TMA_PREFILL_ENV_VAR, use_tma_prefill
from mrv2_kernels.rotary import rotary_embedding_ref

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


def _run(b: Batch, **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, ref)`` of one batch: the kernel into a NaN-filled output, the reference."""
    args: tuple[Any, ...] = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    ref_options = {k: v for k, v in options.items()
                   if k in ("sliding_window", "logit_softcap", "sinks", "attention_chunk")}
    ref = paged_attention_ref(*args, **b.bounds, **ref_options)
    poisoned = torch.full_like(b.query, float("nan"))
    out = paged_attention(*args, **b.bounds, **options, out=poisoned)
    assert out is poisoned
    return out, ref


def test_head_tile() -> None:
    assert [head_tile(d) for d in (8, 16, 24, 64, 80, 96, 128, 160, 256)] == [
        16, 16, 32, 64, 128, 128, 128, 256, 256]


@pytest.mark.parametrize(
    ("head_dim", "num_heads", "num_kv_heads", "dtype", "options"),
    [
        (80, 4, 2, torch.float32, {}),
        (96, 6, 2, torch.bfloat16, {}),  # a group of 3: padded to 4 rows per token
        (80, 4, 1, torch.float16, {"block_m": 16, "block_n": 32}),  # several query tiles
        (96, 4, 2, torch.float32, {"flat_grid": False, "one_token_apart": True}),
        (24, 2, 1, torch.float32, {}),  # (refused before: not a power of 2)
        (8, 4, 2, torch.float32, {}),  # (refused before: below tl.dot's 16)
    ],
)
def test_mixed_batch_padded_heads(head_dim: int, num_heads: int, num_kv_heads: int,
                                  dtype: torch.dtype, options: dict[str, Any]) -> None:
    """Prefill, chunked prefill and decode requests in one step (a prefill plan): every real
    row is the reference's in every column, padding tokens come out as zeros."""
    b = make_batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   block_size=4, dtype=dtype, pad_tokens=2, seed=head_dim + num_heads)
    assert not attention_plan(b.query, b.kv_cache, **b.bounds).small_q
    out, ref = _run(b, **options)
    _check(out, ref, b, dtype)
    assert (out[b.num_real_tokens:] == 0).all(), "padding tokens should come out as zeros"


@pytest.mark.parametrize(
    ("head_dim", "num_heads", "num_kv_heads", "qlen", "num_splits", "dtype"),
    [
        (80, 4, 1, 1, 3, torch.bfloat16),
        (96, 4, 2, 1, 5, torch.float32),
        (96, 6, 2, 2, 2, torch.float32),  # spec-decode sized, GQA group of 3
        (80, 4, 2, 1, 1, torch.float32),  # unsplit: no combine kernel
    ],
)
def test_decode_splits_padded_heads(head_dim: int, num_heads: int, num_kv_heads: int,
                                    qlen: int, num_splits: int, dtype: torch.dtype) -> None:
    """The small-query plan: split partials (masked to the real columns) and their combine,
    with a loose ``max_seq_len`` and a request with a query and no key."""
    reqs = [(qlen, 77), (qlen, qlen), (qlen, 40), (0, 0), (qlen, 17)]
    b = make_batch(reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   block_size=4, dtype=dtype, pad_tokens=2, seed=head_dim + qlen)
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    ref = paged_attention_ref(*args, **b.bounds)
    out = torch.full_like(b.query, float("nan"))
    bounds = {**b.bounds, "max_seq_len": 4096}
    plan = attention_plan(b.query, b.kv_cache, **bounds, uniform_decode=True,
                          num_splits=num_splits)
    assert plan.small_q and plan.num_splits == num_splits
    paged_attention(*args, **bounds, uniform_decode=True, num_splits=num_splits, out=out)
    _check(out, ref, b, dtype)
    assert (out[b.num_real_tokens:] == 0).all()


@pytest.mark.parametrize("uniform_decode", [False, True])
def test_local_attention_options_padded_heads(uniform_decode: bool) -> None:
    """The masked key loop's other users at a head_dim of 80: a sliding window with a
    soft-cap and sinks, and chunked local attention."""
    reqs = [(1, 23), (1, 9), (1, 30)] if uniform_decode else MIXED
    b = make_batch(reqs, num_heads=4, num_kv_heads=2, head_dim=80, block_size=4,
                   dtype=torch.float32, pad_tokens=1, seed=3)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=DEVICE)
    splits = {"uniform_decode": True, "num_splits": 3} if uniform_decode else {}
    out, ref = _run(b, sliding_window=7, logit_softcap=5.0, sinks=sinks, **splits)
    _check(out, ref, b, torch.float32)
    out, ref = _run(b, attention_chunk=8, **splits)
    _check(out, ref, b, torch.float32)


@pytest.mark.parametrize(("reqs", "options"), [
    (MIXED, {}),
    ([(1, 77), (1, 1), (1, 40), (0, 0), (1, 17)], {"uniform_decode": True, "num_splits": 3}),
])
def test_fp8_cache_padded_heads(reqs: list[tuple[int, int]], options: dict[str, Any]) -> None:
    """bf16 queries over an fp8 (e4m3) cache of 96-wide heads: the reference's output over the
    same cache."""
    b = make_batch(reqs, num_heads=4, num_kv_heads=2, head_dim=96, block_size=4,
                   dtype=torch.bfloat16, pad_tokens=2, seed=5)
    b.kv_cache = to_cache_dtype(b.kv_cache.float() * 8, FP8_KV_DTYPE)
    out, ref = _run(b, **options)
    _check(out, ref, b, torch.bfloat16)
    assert (out[b.num_real_tokens:] == 0).all()


def test_fused_rope_decision_falls_back_for_padded_heads() -> None:
    """The kernel's own RoPE rotates ``head_dim // 2`` halves unpadded: split decode plans
    take it at power-of-2 head dims only, never at 80 or 96."""
    reqs = [(1, 77), (1, 40)]
    for head_dim, fused in ((16, True), (128, True), (80, False), (96, False), (24, False)):
        b = make_batch(reqs, num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=4,
                       dtype=torch.float32)
        plan = attention_plan(b.query, b.kv_cache, **b.bounds, uniform_decode=True,
                              num_splits=3)
        assert plan.small_q and plan.num_splits == 3
        assert rope_in_kernel(plan, head_dim, 2) is fused, head_dim


@pytest.mark.parametrize(("dtype", "qk_norm", "fp8"), [
    (torch.bfloat16, True, False), (torch.float32, False, False), (torch.bfloat16, True, True)])
def test_rope_with_padded_heads_runs_the_rope_kernel_first(
        dtype: torch.dtype, qk_norm: bool, fp8: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw query/key/value of 80-wide heads with a split decode plan (which rotates inside
    the kernel at power-of-2 head dims): the RoPE kernel rotates and stores the step's keys
    and values first (their slots start as NaN), then the kernel attends; the cache and the
    output as rotary_embedding_ref + write_kv_ref + paged_attention_ref give them."""
    from mrv2_kernels import paged_attention_plan as module

    rope_kernel_calls = count_calls(monkeypatch, module, "rotary_embedding_triton")
    d = 80
    reqs = [(1, 37), (1, 1), (0, 0), (1, 20)]
    b, r = _rope_case(reqs, dtype, qk_norm, seed=11, d=d)
    if fp8:
        b.kv_cache = to_cache_dtype(b.kv_cache, FP8_KV_DTYPE)  # new slots stay NaN
    ref, want_cache = _rope_reference(b, r)
    raw_q, raw_k = r["q"].clone(), r["k"].clone()  # (the RoPE kernel rotates them in place)
    num_tokens = b.query.shape[0]
    cache = b.kv_cache.clone()
    out = paged_attention(
        r["q"].reshape(num_tokens, 4, d), cache, b.qsl, b.seq_lens, b.block_table, b.scale,
        **b.bounds, uniform_decode=True, num_splits=3,
        out=torch.full((num_tokens, 4, d), float("nan"), dtype=dtype, device=DEVICE),
        rope=_fused_rope(r),
    )
    assert len(rope_kernel_calls) == 1
    assert not cache.float().isnan().any(), "a new key or value was not stored"
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    if fp8:  # a bf16 rounding apart may land one e4m3 step away (6%)
        torch.testing.assert_close(cache.float(), want_cache.float(), atol=1e-2, rtol=0.13)
        # so the output is the reference's over the cache the kernels wrote
        q_ref, _ = rotary_embedding_ref(r["positions"], raw_q, raw_k, r["cos_sin"], d, d,
                                        r["qk_norm"])
        ref = paged_attention_ref(q_ref.reshape(num_tokens, 4, d), cache, b.qsl, b.seq_lens,
                                  b.block_table, b.scale, **b.bounds)
    else:
        torch.testing.assert_close(cache.float(), want_cache.float(), atol=tol, rtol=tol)
    _check(out, ref, b, dtype)
    assert (out[b.num_real_tokens:] == 0).all()


def test_tma_prefill_takes_power_of_2_heads_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The opt-in TMA prefill's blocks are a head wide: a head_dim of 80 stays with the paged
    kernel (which pads it)."""
    monkeypatch.setenv(TMA_PREFILL_ENV_VAR, "1")
    for d, taken in ((32, True), (80, False), (96, False), (8, False)):
        q = torch.randn(5, 4, d)
        kv = torch.randn(5, 2 * 2 * d)
        assert use_tma_prefill(q, kv[:, :2 * d], kv[:, 2 * d:]) is taken, d


_SM90_SCRIPT = r"""
from mrv2_kernels import paged_attention as m

bf, f32, i32, f8 = "*bf16", "*fp32", "*i32", "*fp8e4nv"
ptrs = {"q_ptr": bf, "k_ptr": bf, "v_ptr": bf, "out_ptr": bf, "part_m_ptr": f32,
        "part_l_ptr": f32, "part_acc_ptr": f32, "qsl_ptr": i32, "seq_lens_ptr": i32,
        "block_table_ptr": i32, "pos_ptr": "*i64", "cos_sin_ptr": f32, "q_w_ptr": bf,
        "k_w_ptr": bf, "new_k_ptr": bf, "new_v_ptr": bf, "slot_ptr": "*i64"}
common = dict(KV_BLOCK_SIZE=16, DOT_FP32=False, FP32_PRECISION="tf32x3", PDL=True,
              EARLY_META=False, ROPE=False, QK_NORM=False, SKIP_LONG=False, SLIDING=False,
              CAP=0.0, SINKS=False, sinks_ptr=None, CHUNK=0, REQ_BLOCK=256, ONE_TOKEN=0)
# the GPU prefill tiles attention_plan picks (bf16): 96 (Phi-3-mini, 8 warps with the
# register cap prefill_register_cap gives), 160 (StableLM-2-12B: head_dim > 128) and 256
# (Gemma's, unpadded) without the cap, and an fp8 cache's split decode at 80
for d, group, bm, bn, warps in ((96, 4, 128, 32, 8), (96, 2, 64, 64, 4), (160, 4, 128, 32, 8),
                                (256, 2, 128, 32, 8)):
    plan = m.AttentionPlan(small_q=False, block_m=bm, block_q=bm // group, block_n=bn,
                           num_q_tiles=4, num_splits=1, num_warps=warps, num_stages=2)
    build(m._paged_attn_kernel, ptrs,
          dict(common, HEAD_DIM=d, HEAD_DIM_P2=m.head_tile(d), GROUP=group, GROUP_P2=group,
               BLOCK_Q=bm // group, BLOCK_M=bm, BLOCK_N=bn, USE_SPLITS=False, ZERO_PAD=True,
               FLAT=True),
          num_warps=warps, num_stages=2, **m.prefill_register_cap(plan, True, d))
build(m._paged_attn_kernel, dict(ptrs, k_ptr=f8, v_ptr=f8),
      dict(common, HEAD_DIM=80, HEAD_DIM_P2=128, GROUP=4, GROUP_P2=4, BLOCK_Q=4, BLOCK_M=16,
           BLOCK_N=64, USE_SPLITS=True, ZERO_PAD=False, FLAT=False),
      num_warps=2, num_stages=2)
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU run compiles it for real")
def test_padded_heads_compile_for_sm90(tmp_path: Any) -> None:
    """The masked builds compile for an H100/H200 (no GPU needed): prefill plans at 96 and
    160, and an fp8 cache's split decode at 80. 256-wide tiles (160 padded, Gemma's 256) take
    no register cap: at 128 registers ptxas fails ("Insufficient registers")."""
    from sm90 import compile_for_sm90

    sizes = compile_for_sm90(_SM90_SCRIPT, tmp_path)["_paged_attn_kernel"]
    assert len(sizes) == 5
