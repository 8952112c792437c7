"""fp8 (e4m3) KV caches: every write path stores what ``to_cache_dtype`` stores, bit for bit, and
paged attention over an fp8 cache is the reference's over the same cache.

Under ``TRITON_INTERPRET=1`` on CPU (root conftest); with ``MRV2_TEST_GPU=1`` on a CUDA machine
the compiled kernels. Inputs are chosen to hit saturation (beyond +-448), subnormals and ties.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_paged_attention import (
    DEVICE,
    MIXED,
    _check,
    _fused_rope,
    _rope_case,
    _rope_reference,
    make_batch,
)

from mrv2_kernels.kv_cache import FP8_KV_DTYPE, to_cache_dtype, write_kv_ref, write_kv_triton
from mrv2_kernels.paged_attention import paged_attention, paged_attention_ref
from mrv2_kernels.rotary import rotary_embedding_ref, rotary_embedding_triton

FP8 = FP8_KV_DTYPE

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


def _hard_values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values over e4m3's whole range and past it, with exact ties and subnormals."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-12, 10, shape,
                                                                    generator=gen).float())
    flat = x.view(-1)
    special = torch.tensor([1000.0, -3000.0, 448.0, 464.0, -460.0, 1.0625, 1.1875, 2.0**-9,
                            3 * 2.0**-10, -(2.0**-8), 2.0**-12, 0.0])  # ties and subnormals
    flat[: special.numel()] = special
    return x.to(DEVICE, dtype)


def _assert_same_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same bits; under the interpreter, whose fp8 conversion drops the sign of a zero
    (-0 comes out +0), the same values."""
    if DEVICE == "cuda":
        bad = got.view(torch.uint8) != want.view(torch.uint8)
        assert not bad.any(), (f"{int(bad.sum())} bytes differ; got {got[bad][:8].tolist()} "
                               f"want {want[bad][:8].tolist()}")
    else:
        assert torch.equal(got.float().nan_to_num(7.0), want.float().nan_to_num(7.0))


def test_to_cache_dtype_saturates_and_rounds_to_nearest_even() -> None:
    x = torch.tensor([1000.0, -3000.0, 464.0, 1.0625, 1.1875, 3 * 2.0**-10, 0.3])
    got = to_cache_dtype(x, FP8)
    assert got.dtype == FP8
    assert got.float().tolist() == [448.0, -448.0, 448.0, 1.0, 1.25, 2.0**-8, 0.3125]
    bf = torch.randn(5, dtype=torch.bfloat16)
    assert to_cache_dtype(bf, torch.bfloat16) is bf


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_kv_fp8_matches_ref(dtype: torch.dtype) -> None:
    tokens, heads, dim, block_size, blocks = 9, 2, 16, 4, 5
    key = _hard_values((tokens, heads, dim), dtype, seed=1)
    value = _hard_values((tokens, heads, dim), dtype, seed=2)
    gen = torch.Generator().manual_seed(3)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[2] = -1  # a padding token
    slots = slots.to(DEVICE)
    cache = torch.full((2, blocks, block_size, heads, dim), float("nan"), device=DEVICE).to(FP8)
    want, got = cache.clone(), cache.clone()
    write_kv_ref(key, value, want, slots)
    write_kv_triton(key, value, got, slots)
    _assert_same_fp8(got, want)
    flat = got.view(2, -1, heads, dim)
    kept = slots[slots >= 0]
    assert not flat[:, kept].float().isnan().any()
    assert flat[0, kept].float().abs().max() == 448.0  # saturated, not inf or NaN
    assert torch.equal(flat[0, kept].float(), key[slots >= 0].float().clamp(-448, 448).to(FP8)
                       .float())


@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_rope_kv_write_into_fp8_cache(qk_norm: bool) -> None:
    """The RoPE kernel's own cache write (prefill and mixed steps) into an fp8 cache: the same
    bits as rotating, then write_kv_ref."""
    tokens, heads, kv_heads, dim = 6, 4, 2, 16
    gen = torch.Generator().manual_seed(7)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 40).to(
        DEVICE, torch.bfloat16)
    q_end, k_end = heads * dim, (heads + kv_heads) * dim
    positions = torch.randint(0, 100, (tokens,), generator=gen).to(DEVICE)
    from mrv2.layers.rotary import RotaryEmbedding

    cos_sin = RotaryEmbedding(dim, 128, base=100.0)._table(torch.device(DEVICE))
    norm = None
    if qk_norm:
        norm = (torch.rand(dim, generator=gen).add(0.5).to(DEVICE, torch.bfloat16),
                torch.rand(dim, generator=gen).add(0.5).to(DEVICE, torch.bfloat16), 1e-6)
    slots = torch.tensor([3, 0, -1, 9, 14, 6], device=DEVICE)
    cache = torch.zeros(2, 4, 4, kv_heads, dim, device=DEVICE).to(FP8)
    qkv_ref = qkv.clone()
    want = cache.clone()
    _, k_ref = rotary_embedding_ref(positions, qkv_ref[:, :q_end], qkv_ref[:, q_end:k_end],
                                    cos_sin, dim, dim, norm)
    _, k_got = rotary_embedding_triton(positions, qkv[:, :q_end], qkv[:, q_end:k_end], cos_sin,
                                       dim, dim, norm, kv_write=(qkv[:, k_end:], cache, slots))
    # The cache holds exactly what the kernel wrote back to the key (in bf16), then rounded.
    write_kv_ref(k_got.view(tokens, kv_heads, dim), qkv[:, k_end:].view(tokens, kv_heads, dim),
                 want, slots)
    _assert_same_fp8(cache, want)
    torch.testing.assert_close(k_got.float(), k_ref.float(), atol=0.2, rtol=2e-2)
    assert cache.float().abs().max() > 0


@pytest.mark.parametrize(("reqs", "options"), [
    (MIXED, {}),  # a prefill plan: decode, prompt, chunk, decode, an empty request
    (MIXED, {"one_token_apart": True}),
    ([(1, 77), (1, 1), (1, 40), (0, 0), (1, 17)], {"uniform_decode": True, "num_splits": 3}),
    ([(1, 77), (1, 40), (1, 17)], {"uniform_decode": True, "num_splits": 1}),
])
def test_paged_attention_over_fp8_cache(reqs: list[tuple[int, int]],
                                        options: dict[str, Any]) -> None:
    """bf16 queries over an fp8 cache: the reference's output over the same cache, which is
    the reference's over its bf16 copy (the cache's values exactly)."""
    b = make_batch(reqs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                   dtype=torch.bfloat16, pad_tokens=2, seed=5)
    cache = to_cache_dtype(b.kv_cache.float() * 8, FP8)  # up to ~30: 3 mantissa bits matter
    args: tuple[Any, ...] = (b.query, cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    ref = paged_attention_ref(*args, **b.bounds)
    same = paged_attention_ref(b.query, cache.to(torch.bfloat16), *args[2:], **b.bounds)
    assert torch.equal(ref, same)
    out = paged_attention(*args, **b.bounds, **options,
                          out=torch.full_like(b.query, float("nan")))
    _check(out, ref, b, torch.bfloat16)
    assert (out[b.num_real_tokens:] == 0).all()


@pytest.mark.parametrize(("num_splits", "qlen"), [(3, 1), (1, 1), (2, 2)])
def test_rope_inside_decode_attention_fp8_cache(num_splits: int, qlen: int) -> None:
    """Decode attention that normalizes and rotates the step's keys and stores them (and the
    values) in an fp8 cache before reading them back: the cache as rotary_embedding_ref +
    write_kv_ref leave it, the output the reference's over that cache."""
    reqs = [(qlen, 37), (qlen, qlen), (0, 0), (qlen, 20)]
    b, r = _rope_case(reqs, torch.bfloat16, True, seed=11)
    b.kv_cache = to_cache_dtype(b.kv_cache, FP8)  # new tokens' slots stay NaN until written
    _, want_cache = _rope_reference(b, r)
    raw_q, raw_k = r["q"].clone(), r["k"].clone()  # (the RoPE kernel rotates them in place)
    num_tokens = b.query.shape[0]
    cache = b.kv_cache.clone()
    out = paged_attention(
        r["q"].reshape(num_tokens, 4, 16), cache, b.qsl, b.seq_lens, b.block_table, b.scale,
        **b.bounds, uniform_decode=True, num_splits=num_splits,
        out=torch.full((num_tokens, 4, 16), float("nan"), dtype=torch.bfloat16, device=DEVICE),
        rope=_fused_rope(r),
    )
    assert not cache.float().isnan().any(), "a new key or value was not stored"
    # The kernel rotates in fp32 registers, the reference in bf16 tensors: a bf16 rounding
    # apart, so an fp8 value may land one e4m3 step away (6%).
    torch.testing.assert_close(cache.float(), want_cache.float(), atol=1e-2, rtol=0.13)
    # So the output is compared with the reference's over the cache the kernel wrote.
    q_ref, _ = rotary_embedding_ref(r["positions"], raw_q, raw_k, r["cos_sin"], 16, 16,
                                    r["qk_norm"])
    ref = paged_attention_ref(q_ref.reshape(num_tokens, 4, 16), cache, b.qsl, b.seq_lens,
                              b.block_table, b.scale, **b.bounds)
    _check(out, ref, b, torch.bfloat16)


def test_decode_plan_takes_two_warps() -> None:
    """The H200 rule, for either cache: decode-sized query tiles (<= 16 rows) launch 2 warps a
    program once there is a program per multiprocessor; larger query tiles, a few requests
    (the plan splits keys) and prefill plans keep theirs."""
    from mrv2_kernels.paged_attention_plan import decode_warps

    assert decode_warps(True, 16, 32 * 8, 132, 4) == 2  # 32 requests x 8 kv heads
    assert decode_warps(True, 16, 132, 132, 4) == 2
    assert decode_warps(True, 16, 8 * 8, 132, 4) == 4  # 8 requests: splits instead
    assert decode_warps(True, 64, 256 * 8, 132, 4) == 4  # 16 draft tokens x 4 heads
    assert decode_warps(False, 128, 256 * 8, 132, 8) == 8  # prefill plan


_SM90_FP8_SCRIPT = r"""
from mrv2_kernels import kv_cache as kv, paged_attention as m, rotary as r

bf, f8, f32, i32 = "*bf16", "*fp8e4nv", "*fp32", "*i32"
ptrs = {"q_ptr": bf, "k_ptr": f8, "v_ptr": f8, "out_ptr": bf, "part_m_ptr": f32,
        "part_l_ptr": f32, "part_acc_ptr": f32, "qsl_ptr": i32, "seq_lens_ptr": i32,
        "block_table_ptr": i32, "pos_ptr": "*i64", "cos_sin_ptr": f32, "q_w_ptr": bf,
        "k_w_ptr": bf, "new_k_ptr": bf, "new_v_ptr": bf, "slot_ptr": "*i64"}
common = dict(HEAD_DIM=128, HEAD_DIM_P2=128, KV_BLOCK_SIZE=16, DOT_FP32=False,
              FP32_PRECISION="tf32x3",
              PDL=True, EARLY_META=False, SKIP_LONG=False, GROUP=4, GROUP_P2=4, ZERO_PAD=True,
              REQ_BLOCK=256, ONE_TOKEN=0, SLIDING=False, CAP=0.0, SINKS=False, sinks_ptr=None,
              CHUNK=0)
# prefill plan (8B heads' tiles), split decode with RoPE and the KV store inside
build(m._paged_attn_kernel, ptrs,
      dict(common, BLOCK_Q=32, BLOCK_M=128, BLOCK_N=32, USE_SPLITS=False, FLAT=True,
           ROPE=False, QK_NORM=False), num_warps=8, num_stages=2)
build(m._paged_attn_kernel, ptrs,
      dict(common, BLOCK_Q=1, BLOCK_M=16, BLOCK_N=64, USE_SPLITS=True, FLAT=False, ROPE=True,
           QK_NORM=True),
      num_warps=2, num_stages=2)  # an fp8 cache's decode plan: 2 warps
build(kv._write_kv_kernel, {"key_ptr": bf, "value_ptr": bf, "k_cache_ptr": f8,
                            "v_cache_ptr": f8, "slot_ptr": "*i64"},
      dict(HEAD_DIM=128, ROW=1024, BLOCK=1024, KV_BLOCK_SIZE=16), num_warps=4)
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU run compiles them for real")
def test_fp8_cache_kernels_compile_for_sm90(tmp_path: Any) -> None:
    """Loads converted from fp8 before the bf16 dots, the saturating stores: they compile for an
    H100/H200 (the interpreter would take a dot of mixed operand types)."""
    from sm90 import compile_for_sm90

    sizes = compile_for_sm90(_SM90_FP8_SCRIPT, tmp_path)
    assert len(sizes["_paged_attn_kernel"]) == 2 and len(sizes["_write_kv_kernel"]) == 1
