"""MLA (absorbed form) over the paged latent cache: the Triton kernels against the torch refs.

Runs under ``TRITON_INTERPRET=1`` on CPU (root conftest), tiny shapes (R = 32 or 48, P = 16,
H = 4 or 5); with ``MRV2_TEST_GPU=1`` on a CUDA machine the same tests run compiled, plus the
GPU-only ones at DeepSeek-V2-Lite shapes. Outputs start as NaN; slots no request owns hold large
values (or NaN), so any read past a request's keys shows up.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from mrv2_kernels.mla_attention import (
    mla_cache_write,
    mla_cache_write_ref,
    mla_cache_write_triton,
    mla_decode_attention,
    mla_decode_attention_ref,
    mla_decode_attention_triton,
    mla_decode_plan,
)

DEVICE = "cuda" if os.environ.get("MRV2_TEST_GPU") and torch.cuda.is_available() else "cpu"
GPU = pytest.mark.skipif(DEVICE != "cuda", reason="needs MRV2_TEST_GPU=1 and a CUDA device")
POISON = 3.0e3

# The interpreter turns 1-element arrays into loop bounds; numpy warns about it, harmlessly.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


@dataclass
class Case:
    q_latent: torch.Tensor
    q_pe: torch.Tensor
    cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    qsl: torch.Tensor
    qlens: list[int]
    lens: list[int]
    scale: float

    @property
    def num_real(self) -> int:
        return sum(self.qlens)

    def args(self) -> tuple[Any, ...]:
        return (self.q_latent, self.q_pe, self.cache, self.block_table, self.seq_lens, self.qsl,
                max(self.qlens))  # fmt: skip

    def slots(self) -> list[int]:
        """The cache slot of every query token (then -1 for the padding tokens)."""
        bs = self.cache.shape[1]
        out = []
        for i, (q, s) in enumerate(zip(self.qlens, self.lens, strict=True)):
            out += [int(self.block_table[i, p // bs]) * bs + p % bs for p in range(s - q, s)]
        return out + [-1] * (self.q_latent.shape[0] - len(out))


def make_case(
    reqs: list[tuple[int, int]],
    *,
    heads: int = 4,
    rank: int = 32,
    rope: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    pad_tokens: int = 2,
    seed: int = 0,
    poison: float = POISON,
    device: str = DEVICE,
) -> Case:
    """``reqs``: (query_len, seq_len) per request; random, non-contiguous block ids."""
    gen = torch.Generator().manual_seed(seed)
    qlens, lens = [q for q, _ in reqs], [s for _, s in reqs]
    per_req = [math.ceil(s / block_size) for s in lens]
    num_blocks = sum(per_req) + 3  # spare blocks stay poisoned
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(reqs), max(per_req) + 2), int(perm[-1]), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(per_req):
        table[i, :nb] = perm[used : used + nb]
        used += nb
    cache = torch.randn(num_blocks, block_size, rank + rope, generator=gen)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for i, s in enumerate(lens):
        pos = torch.arange(s)
        owned[table[i, pos // block_size].long(), pos % block_size] = True
    sign = torch.where(torch.rand(cache.shape, generator=gen) < 0.5, -1.0, 1.0)
    cache = torch.where(owned[:, :, None], cache, poison * sign)
    num_tokens = sum(qlens) + pad_tokens
    q_latent = torch.randn(num_tokens, heads, rank, generator=gen)
    q_pe = torch.randn(num_tokens, heads, rope, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    return Case(
        q_latent=q_latent.to(device, dtype),
        q_pe=q_pe.to(device, dtype),
        cache=cache.to(device, dtype),
        block_table=table.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        qsl=qsl.to(device),
        qlens=qlens,
        lens=lens,
        scale=(rank + rope) ** -0.5,
    )


def nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def tol(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 2e-3 if dtype == torch.float16 else 1e-4


def run_both(c: Case, **kw: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse) of the ref and of the kernels, each into NaN-filled buffers."""
    ref = nan_like(c.q_latent)
    ref_lse = torch.full(c.q_latent.shape[:2], float("nan"), device=c.q_latent.device)
    mla_decode_attention_ref(*c.args(), c.scale, ref, lse=ref_lse)
    out = nan_like(c.q_latent)
    lse = torch.full_like(ref_lse, float("nan"))
    got = mla_decode_attention_triton(*c.args(), c.scale, out, lse=lse, **kw)
    assert got is out
    return ref, ref_lse, out, lse


def check(c: Case, ref: torch.Tensor, ref_lse: torch.Tensor, out: torch.Tensor,
          lse: torch.Tensor) -> None:  # fmt: skip
    n, t = c.num_real, tol(c.q_latent.dtype)
    assert torch.isfinite(out[:n].float()).all(), "a real token's row was not written"
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=t, rtol=t)
    torch.testing.assert_close(lse[:n], ref_lse[:n], atol=t, rtol=t)
    assert out[n:].isnan().all() and lse[n:].isnan().all(), "padding tokens must stay untouched"


def naive(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, per head, plain loops over the cache rows: (out [T, H, R], lse [T, H])."""
    rank, bs = c.q_latent.shape[2], c.cache.shape[1]
    out = torch.zeros(c.q_latent.shape)
    lse = torch.zeros(c.q_latent.shape[:2])
    for i, (qlen, seq_len) in enumerate(zip(c.qlens, c.lens, strict=True)):
        rows = [c.cache[int(c.block_table[i, p // bs]), p % bs].float() for p in range(seq_len)]
        for j in range(qlen):
            t, pos = int(c.qsl[i]) + j, seq_len - qlen + j
            for h in range(c.q_latent.shape[1]):
                q = torch.cat([c.q_latent[t, h], c.q_pe[t, h]]).float()
                s = torch.stack([q @ r for r in rows[: pos + 1]]) * c.scale
                p = torch.softmax(s, 0)
                out[t, h] = sum(p[k] * rows[k][:rank] for k in range(pos + 1))
                lse[t, h] = torch.logsumexp(s, 0)
    return out, lse


DECODE = [(1, 23), (1, 5), (0, 0), (1, 40), (1, 1)]  # one decode token each; a padding request
VERIFY = [(3, 23), (1, 9), (0, 0), (3, 3), (3, 37)]  # verify steps of 1 + 2 drafts, a prefill


def test_ref_matches_naive() -> None:
    c = make_case(VERIFY, device="cpu")
    out = nan_like(c.q_latent)
    lse = torch.full(c.q_latent.shape[:2], float("nan"))
    mla_decode_attention_ref(*c.args(), c.scale, out, lse=lse)
    want, want_lse = naive(c)
    n = c.num_real
    torch.testing.assert_close(out[:n], want[:n], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:n], want_lse[:n], atol=1e-5, rtol=1e-5)
    assert out[n:].isnan().all() and lse[n:].isnan().all()


@pytest.mark.parametrize(
    ("reqs", "block_size", "dtype", "num_splits"),
    [
        (DECODE, 4, torch.float32, 1),
        (DECODE, 16, torch.bfloat16, 3),
        (VERIFY, 4, torch.float32, 3),
        (VERIFY, 16, torch.bfloat16, 1),
    ],
)
def test_decode_matches_ref(
    reqs: list[tuple[int, int]], block_size: int, dtype: torch.dtype, num_splits: int
) -> None:
    c = make_case(reqs, block_size=block_size, dtype=dtype, seed=block_size + num_splits)
    check(c, *run_both(c, num_splits=num_splits))


def test_odd_heads_rank_and_tiles() -> None:
    """H = 5 over head tiles of 2, R = 48 (not a power of two), 2 query tiles of 2 tokens."""
    c = make_case(VERIFY, heads=5, rank=48, block_size=4, seed=3)
    if DEVICE == "cuda":  # tl.dot needs 16 rows
        check(c, *run_both(c, num_splits=3, block_h=8, block_q=2))
    else:
        check(c, *run_both(c, num_splits=3, block_h=2, block_q=2))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_flat_grid_gives_the_same_bits(num_splits: int) -> None:
    """``flat_grid``: programs over the step's query tiles (each finds its request in
    ``query_start_loc``) write what the (query tile, request) grid writes, bit for bit, also
    under a mixed CUDA graph's bounds (``max_query_len`` = every token, padding requests with
    empty queries past the real ones)."""
    c = make_case([(7, 20), (0, 0), (5, 5), (1, 30), (3, 3)], block_size=4, seed=11)
    num_tokens = c.q_latent.shape[0]
    # graph-like bounds: 8 requests (3 padding ones, empty: query_start_loc ends repeated)
    qsl = torch.cat([c.qsl, c.qsl[-1:].expand(3)])
    bounds = (c.q_latent, c.q_pe, c.cache, torch.cat([c.block_table, c.block_table[:3]]),
              torch.cat([c.seq_lens, torch.zeros_like(c.seq_lens[:3])]), qsl, num_tokens)
    kw: dict[str, Any] = {"num_splits": num_splits, "block_q": 2, "max_seq_len": 64,
                          "block_h": 8 if DEVICE == "cuda" else 2}
    for args, num_reqs in ((c.args(), 5), (bounds, 8)):
        outs = []
        for flat in (False, True):
            out = nan_like(c.q_latent)
            lse = torch.full(c.q_latent.shape[:2], float("nan"), device=c.q_latent.device)
            mla_decode_attention_triton(*args, c.scale, out, lse=lse, num_reqs=num_reqs,
                                        flat_grid=flat, **kw)
            outs.append((out, lse))
        (grid, grid_lse), (flat_out, flat_lse) = outs
        torch.testing.assert_close(flat_out, grid, atol=0, rtol=0, equal_nan=True)
        torch.testing.assert_close(flat_lse, grid_lse, atol=0, rtol=0, equal_nan=True)
        ref = nan_like(c.q_latent)
        ref_lse = torch.full_like(grid_lse, float("nan"))
        mla_decode_attention_ref(*c.args(), c.scale, ref, lse=ref_lse)
        check(c, ref, ref_lse, flat_out, flat_lse)


def test_default_plan_loose_bounds_no_lse() -> None:
    """Default splits from a loose max_seq_len (as under graph capture); no lse asked for."""
    c = make_case([(1, 50), (1, 9), (1, 33)], block_size=16, seed=5, pad_tokens=1)
    ref = mla_decode_attention_ref(*c.args(), c.scale, nan_like(c.q_latent))
    out = mla_decode_attention_triton(*c.args(), c.scale, nan_like(c.q_latent),
                                      max_seq_len=4096, num_reqs=3)  # fmt: skip
    n = c.num_real
    torch.testing.assert_close(out[:n], ref[:n], atol=1e-4, rtol=1e-4)
    assert out[n:].isnan().all()


def test_nan_poisoned_cache_never_read() -> None:
    c = make_case(VERIFY, block_size=4, dtype=torch.bfloat16, poison=float("nan"), seed=7)
    check(c, *run_both(c, num_splits=3))


def test_write_then_attend_equals_decompressed_mha() -> None:
    """The absorbed-form math the model relies on, end to end through the kernels.

    Decompressed MLA per head h: keys ``[c W_UK[h] ; k_pe]``, values ``c W_UV[h]``, query
    ``[q_nope ; q_pe]``. Absorbed: ``q_latent = q_nope W_UK[h]^T`` attends over the cached
    ``[c ; k_pe]`` rows and ``out_latent W_UV[h]`` is the head's output.
    """
    heads, rank, rope, d_nope, d_v = 4, 32, 16, 8, 12
    c = make_case(VERIFY, heads=heads, rank=rank, rope=rope, seed=11)
    gen = torch.Generator().manual_seed(12)
    w_uk = (torch.randn(heads, rank, d_nope, generator=gen) / rank**0.5).to(DEVICE)
    w_uv = (torch.randn(heads, rank, d_v, generator=gen) / rank**0.5).to(DEVICE)
    q_nope = torch.randn(c.q_latent.shape[0], heads, d_nope, generator=gen).to(DEVICE)
    q_latent = torch.einsum("thn,hrn->thr", q_nope, w_uk).contiguous()
    scale = (d_nope + rope) ** -0.5

    # Each request's latent and rope rows, written into the cache as the steps would write them.
    gen_rows = torch.Generator().manual_seed(13)
    latents = [torch.randn(s, rank, generator=gen_rows).to(DEVICE) for s in c.lens]
    k_pes = [torch.randn(s, rope, generator=gen_rows).to(DEVICE) for s in c.lens]
    bs = c.cache.shape[1]
    slots = [int(c.block_table[i, p // bs]) * bs + p % bs for i, s in enumerate(c.lens)
             for p in range(s)]  # fmt: skip
    mla_cache_write_triton(torch.cat(latents), torch.cat(k_pes), c.cache,
                           torch.tensor(slots, device=DEVICE))  # fmt: skip

    out_latent = nan_like(c.q_latent)
    mla_decode_attention_triton(q_latent, c.q_pe, c.cache, *c.args()[3:], scale, out_latent,
                                num_splits=2)  # fmt: skip
    got = torch.einsum("thr,hrv->thv", out_latent, w_uv)

    want = torch.zeros_like(got)
    for i, (qlen, seq_len) in enumerate(zip(c.qlens, c.lens, strict=True)):
        k = torch.cat([torch.einsum("sr,hrn->hsn", latents[i], w_uk),
                       k_pes[i].expand(heads, -1, -1)], dim=-1)  # fmt: skip
        v = torch.einsum("sr,hrv->hsv", latents[i], w_uv)
        for j in range(qlen):
            t, pos = int(c.qsl[i]) + j, seq_len - qlen + j
            q = torch.cat([q_nope[t], c.q_pe[t]], dim=-1)  # [H, d_nope + rope]
            s = torch.einsum("hd,hsd->hs", q, k[:, : pos + 1]) * scale
            want[t] = torch.einsum("hs,hsv->hv", torch.softmax(s, -1), v[:, : pos + 1])
    n = c.num_real
    torch.testing.assert_close(got[:n], want[:n], atol=1e-4, rtol=1e-4)
    ref = mla_decode_attention_ref(q_latent, c.q_pe, c.cache, *c.args()[3:], scale,
                                   nan_like(c.q_latent))  # fmt: skip
    torch.testing.assert_close(torch.einsum("thr,hrv->thv", ref, w_uv)[:n], want[:n],
                               atol=1e-4, rtol=1e-4)  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "src_dtype", "block_size"),
    [(torch.float32, torch.float32, 4), (torch.bfloat16, torch.bfloat16, 16),
     (torch.bfloat16, torch.float32, 4)],
)  # fmt: skip
def test_cache_write_matches_ref(
    dtype: torch.dtype, src_dtype: torch.dtype, block_size: int
) -> None:
    """Strided inputs (views of one projection output), slot -1 rows skipped; bit for bit."""
    gen = torch.Generator().manual_seed(block_size)
    tokens, rank, rope, num_blocks = 9, 48, 16, 5
    fused = torch.randn(tokens, rank + rope + 8, generator=gen).to(DEVICE, src_dtype)
    latent, k_pe = fused[:, :rank], fused[:, rank + 8 :]
    cache = torch.randn(num_blocks, block_size, rank + rope, generator=gen) * 100
    cache = cache.to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.tensor([1, 4, 8])] = -1
    slots = slots.to(DEVICE)
    want = cache.clone()
    mla_cache_write_ref(latent, k_pe, want, slots)
    got = cache.clone()
    mla_cache_write_triton(latent, k_pe, got, slots)
    if dtype != src_dtype and DEVICE == "cpu":
        # The interpreter truncates fp32 -> bf16 where torch and the GPU round: one ulp apart.
        torch.testing.assert_close(got, want, atol=0.0, rtol=2.0**-7)
    else:
        assert torch.equal(got, want)
    flat, keep = want.view(-1, rank + rope), slots >= 0
    assert torch.equal(flat[slots[keep], :rank], latent[keep].to(dtype))
    assert torch.equal(flat[slots[keep], rank:], k_pe[keep].to(dtype))
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[keep]] = False
    assert torch.equal(got.view(-1, rank + rope)[untouched], cache.view(-1, rank + rope)[untouched])


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    c = make_case([(1, 6)], block_size=4, seed=2, pad_tokens=0)
    ref = mla_decode_attention_ref(*c.args(), c.scale, nan_like(c.q_latent))
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    got = mla_decode_attention(*c.args(), c.scale, nan_like(c.q_latent))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    cache = c.cache.clone()
    latent = torch.randn(2, 32, device=DEVICE)
    mla_cache_write(latent, latent[:, :16], cache, torch.tensor([0, -1], device=DEVICE))
    assert torch.equal(cache[0, 0], torch.cat([latent[0], latent[0, :16]]))


def test_plans() -> None:
    v2_lite = {"num_heads": 16, "kv_lora_rank": 512, "on_gpu": True, "num_sms": 132}
    b1 = mla_decode_plan(**v2_lite, max_query_len=1, max_seq_len=4096, num_reqs=1)
    assert (b1.block_h, b1.block_q, b1.block_n, b1.num_h_tiles) == (16, 1, 64, 1)
    assert (b1.num_splits, b1.num_warps) == (64, 8)  # 4096 keys / 64 per split, <= 64 splits
    assert b1.combine_h * b1.combine_r * 64 <= 4096
    short = mla_decode_plan(**v2_lite, max_query_len=1, max_seq_len=1024, num_reqs=1)
    assert short.num_splits == 16  # one 64-key step each
    b64 = mla_decode_plan(**v2_lite, max_query_len=1, max_seq_len=4096, num_reqs=64)
    assert (b64.num_splits, b64.num_warps) == (3, 4)  # cdiv(132, 64): one wave
    verify = mla_decode_plan(**v2_lite, max_query_len=2, max_seq_len=4096, num_reqs=8)
    assert verify.block_q == 2 and verify.num_q_tiles == 1  # both tokens share one KV read
    v3 = mla_decode_plan(**{**v2_lite, "num_heads": 128}, max_query_len=1, max_seq_len=4096,
                         num_reqs=64)  # fmt: skip
    assert v3.num_h_tiles == 8 and v3.num_splits == 1
    tiny = mla_decode_plan(num_heads=4, kv_lora_rank=32, on_gpu=True, max_query_len=1,
                           max_seq_len=64, num_reqs=2)  # fmt: skip
    assert tiny.block_h * tiny.block_q >= 16  # tl.dot rows on the GPU
    cpu = mla_decode_plan(num_heads=5, kv_lora_rank=48, on_gpu=False, max_query_len=3,
                          max_seq_len=40, num_reqs=4)  # fmt: skip
    assert (cpu.block_h, cpu.block_q, cpu.num_h_tiles, cpu.num_q_tiles) == (8, 4, 1, 1)


# ---------------------------------------------------------------------------------- GPU only


def _v2_lite(batch: int, seq: int, qlen: int = 1, seed: int = 0) -> Case:
    return make_case([(qlen, seq)] * batch, heads=16, rank=512, rope=64, block_size=16,
                     dtype=torch.bfloat16, pad_tokens=3, seed=seed,
                     poison=float("nan"))  # fmt: skip


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize(("batch", "qlen"), [(1, 1), (64, 1), (4, 2), (2, 4)])
def test_deepseek_v2_lite_shapes(batch: int, qlen: int) -> None:
    c = _v2_lite(batch, 4096, qlen, seed=batch)
    c.scale = 192**-0.5
    check(c, *run_both(c))
    check(c, *run_both(c, num_splits=1))


@pytest.mark.gpu
@GPU
def test_cuda_graph_capture_without_syncs() -> None:
    c = _v2_lite(8, 1000, seed=1)
    out = nan_like(c.q_latent)
    kw = {"max_seq_len": 4096, "num_reqs": 8}
    mla_decode_attention_triton(*c.args(), c.scale, out, **kw)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            mla_decode_attention_triton(*c.args(), c.scale, out, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out.fill_(float("nan"))
    c.seq_lens.copy_(torch.tensor([1000, 7, 500, 999, 1, 64, 300, 1000], device="cuda"))
    graph.replay()
    ref = mla_decode_attention_ref(*c.args(), c.scale, nan_like(c.q_latent))
    torch.testing.assert_close(out[:8].float(), ref[:8].float(), atol=2e-2, rtol=2e-2)


# The interpreter misses what only the compiler rejects (a non-constexpr global, a layout it
# cannot lower): compile the kernels for sm_90 at DeepSeek-V2-Lite shapes, no GPU needed.
_SM90_SCRIPT = r"""
from mrv2_kernels import mla_attention as m

bf, f32, i32 = "*bf16", "*fp32", "*i32"
for q_tok, splits, flat in ((1, True, False), (2, False, False), (2, True, True)):
    build(m._mla_decode_kernel,
          {"ql_ptr": bf, "qp_ptr": bf, "cache_ptr": bf, "out_ptr": bf, "lse_ptr": f32,
           "part_m_ptr": f32, "part_l_ptr": f32, "part_acc_ptr": f32, "qsl_ptr": i32,
           "seq_lens_ptr": i32, "block_table_ptr": i32},
          dict(NUM_HEADS=16, RANK=512, ROPE=64, RANK_P2=512, ROPE_P2=64, BLOCK_H=16,
               BLOCK_Q=q_tok, BLOCK_N=32, KV_BLOCK_SIZE=16, USE_SPLITS=splits, HAS_LSE=True,
               DOT_FP32=False, FP32_PRECISION="tf32x3", FLAT=flat, REQ_BLOCK=256),
          num_warps=8, num_stages=3)
build(m._mla_combine_kernel,
      {"part_m_ptr": f32, "part_l_ptr": f32, "part_acc_ptr": f32, "out_ptr": bf,
       "lse_ptr": f32, "qsl_ptr": i32},
      dict(NUM_HEADS=16, RANK=512, SPLITS_P2=32, COMBINE_H=1, COMBINE_R=128, HAS_LSE=True),
      num_warps=4)
build(m._mla_write_kernel, {"latent_ptr": bf, "pe_ptr": bf, "cache_ptr": bf, "slot_ptr": "*i64"},
      dict(RANK=512, ROPE=64, RANK_P2=512, ROPE_P2=64, KV_BLOCK_SIZE=16), num_warps=4)
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU run compiles them for real")
def test_kernels_compile_for_sm90(tmp_path: Any) -> None:
    from sm90 import compile_for_sm90

    shared = [size for sizes in compile_for_sm90(_SM90_SCRIPT, tmp_path).values()
              for size in sizes]
    assert len(shared) == 5 and max(shared) <= 100 * 1024, shared
