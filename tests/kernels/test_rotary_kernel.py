"""Rotary embedding: Triton (interpreted on CPU) against the torch reference and the old layer."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

try:
    import mrv2_kernels  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from mrv2_kernels import rotary_embedding, rotary_embedding_ref, rotary_embedding_triton
from mrv2_kernels.kv_cache import write_kv_ref, write_kv_triton

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

CPU_ONLY = pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU dispatch and CPU layer path")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
MAX_POS = 64


def randn(*shape: int, dtype: torch.dtype = F32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def random_positions(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, MAX_POS, (n,), generator=gen).to(DEVICE)


def cos_sin_table(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """The ``[MAX_POS, rotary_dim]`` ``[cos | sin]`` table RotaryEmbedding builds."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = torch.outer(torch.arange(MAX_POS, dtype=F32), inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 to rounding; bf16 within one ulp (a single rounding of the fp32 result)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if expected.dtype == F32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
        return
    a, e = actual.double(), expected.double()
    _, exp = torch.frexp(torch.maximum(a.abs(), e.abs()))
    ulp = torch.ldexp(torch.ones_like(a), exp - 8).clamp(min=2.0**-133)
    err = (a - e).abs() / ulp
    assert not err.isnan().any() and err.max() <= 1


def old_rotary(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin: torch.Tensor,
    head_dim: int,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RotaryEmbedding's torch code before the kernel, verbatim."""

    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(shape[0], -1, head_dim)
        half = rotary_dim // 2
        x1 = x[..., :half].float()
        x2 = x[..., half:rotary_dim].float()
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        if rotary_dim < head_dim:
            rotated = torch.cat([rotated, x[..., rotary_dim:]], dim=-1)
        return rotated.reshape(shape)

    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize(
    ("head_dim", "rotary_dim"), [(16, 16), (16, 8), (12, 6)], ids=["full", "partial", "odd-half"]
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (6, 1)], ids=["gqa", "mqa"])
def test_rotary_triton_matches_ref(
    dtype: torch.dtype, head_dim: int, rotary_dim: int, num_heads: int, num_kv_heads: int
) -> None:
    tokens = 5
    positions = random_positions(tokens, seed=head_dim + num_heads)
    cos_sin = cos_sin_table(rotary_dim)
    query = randn(tokens, num_heads * head_dim, dtype=dtype, seed=1)  # [T, H*D]
    key = randn(tokens, num_kv_heads, head_dim, dtype=dtype, seed=2)  # [T, Hk, D]
    want_q, want_k = rotary_embedding_ref(positions, query, key, cos_sin, head_dim, rotary_dim)
    q_in, k_in = query.clone(), key.clone()
    got_q, got_k = rotary_embedding_triton(
        positions, q_in, k_in, cos_sin, head_dim, rotary_dim, block_heads=4
    )
    assert got_q is q_in and got_k is k_in  # rotated in place
    assert_matches(got_q, want_q)
    assert_matches(got_k, want_k)
    # Dims past rotary_dim pass through untouched; the rotated ones really changed.
    for got, orig in ((got_q, query), (got_k, key)):
        g, o = got.reshape(tokens, -1, head_dim), orig.reshape(tokens, -1, head_dim)
        assert torch.equal(g[..., rotary_dim:], o[..., rotary_dim:])
        assert not torch.equal(g[..., :rotary_dim], o[..., :rotary_dim])


def test_rotary_in_place_on_fused_qkv_views() -> None:
    """Llama: q and k are column slices of the fused QKV output; v must stay as it was."""
    tokens, num_heads, num_kv_heads, head_dim = 4, 4, 2, 16
    qkv = randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=BF16, seed=3)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    q, k, v = qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]
    v_before, qkv_before = v.clone(), qkv.clone()
    positions = random_positions(tokens, seed=4)
    cos_sin = cos_sin_table(head_dim)
    want_q, want_k = rotary_embedding_ref(
        positions, qkv_before[:, :q_end], qkv_before[:, q_end:k_end], cos_sin, head_dim, head_dim
    )
    got_q, got_k = rotary_embedding_triton(positions, q, k, cos_sin, head_dim, head_dim)
    assert got_q is q and got_k is k
    assert_matches(qkv[:, :q_end], want_q)
    assert_matches(qkv[:, q_end:k_end], want_k)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_fused_qk_norm_matches_norm_then_rotate(dtype: torch.dtype) -> None:
    """Qwen3: per-head RMSNorm of q and k (own weights) fused into the rotation, in place on
    slices of the fused QKV output, equals rms_norm_ref per head followed by the rotation."""
    from mrv2_kernels import rms_norm_ref

    tokens, num_heads, num_kv_heads, head_dim, eps = 5, 4, 2, 16, 1e-6
    qkv = randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=7) * 3
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    q_w = (randn(head_dim, seed=8).abs() + 0.5).to(dtype)
    k_w = (randn(head_dim, seed=9).abs() + 0.5).to(dtype)
    positions = random_positions(tokens, seed=10)
    cos_sin = cos_sin_table(head_dim)
    before = qkv.clone()
    normed_q = rms_norm_ref(before[:, :q_end].reshape(tokens, -1, head_dim), q_w, eps)
    normed_k = rms_norm_ref(before[:, q_end:k_end].reshape(tokens, -1, head_dim), k_w, eps)
    want_q, want_k = rotary_embedding_ref(positions, normed_q.flatten(1), normed_k.flatten(1),
                                          cos_sin, head_dim, head_dim)
    ref_q, ref_k = rotary_embedding_ref(positions, before[:, :q_end], before[:, q_end:k_end],
                                        cos_sin, head_dim, head_dim, (q_w, k_w, eps))
    assert torch.equal(ref_q, want_q) and torch.equal(ref_k, want_k)
    got_q, got_k = rotary_embedding_triton(positions, qkv[:, :q_end], qkv[:, q_end:k_end],
                                           cos_sin, head_dim, head_dim, (q_w, k_w, eps))
    if dtype == F32:
        assert_matches(got_q, want_q)
        assert_matches(got_k, want_k)
    else:  # three bf16 roundings (norm, weight, rotation): 3 ulps of the head's scale
        for got, want in ((got_q, want_q), (got_k, want_k)):
            scale = want.float().abs().max()
            torch.testing.assert_close(got.float(), want.float(), rtol=0,
                                       atol=3 * 2.0**-7 * float(scale))
    assert torch.equal(qkv[:, k_end:], before[:, k_end:])  # v untouched
    # Partial rotary cannot fuse: the dispatcher norms first, then rotates; same result.
    q2, k2 = rotary_embedding(positions, before[:, :q_end].clone(),
                              before[:, q_end:k_end].clone(), cos_sin_table(8), head_dim, 8,
                              (q_w, k_w, eps))
    want2 = rotary_embedding_ref(positions, normed_q.flatten(1), normed_k.flatten(1),
                                 cos_sin_table(8), head_dim, 8)
    assert_matches(q2, want2[0])
    assert_matches(k2, want2[1])
    with pytest.raises(ValueError, match="rotary_dim == head_dim"):
        rotary_embedding_triton(positions, before[:, :q_end].clone(),
                                before[:, q_end:k_end].clone(), cos_sin_table(8), head_dim, 8,
                                (q_w, k_w, eps))


def test_rotary_out_of_place_and_int32_positions() -> None:
    tokens, head_dim = 3, 8
    positions = random_positions(tokens, seed=5).to(torch.int32)
    cos_sin = cos_sin_table(head_dim)
    query, key = randn(tokens, 2 * head_dim, seed=6), randn(tokens, head_dim, seed=7)
    q_before, k_before = query.clone(), key.clone()
    got_q, got_k = rotary_embedding_triton(
        positions, query, key, cos_sin, head_dim, head_dim, inplace=False
    )
    want_q, want_k = rotary_embedding_ref(positions.long(), query, key, cos_sin, head_dim, head_dim)
    assert torch.equal(query, q_before) and torch.equal(key, k_before)
    assert_matches(got_q, want_q)
    assert_matches(got_k, want_k)


def test_rotary_rejects_bad_arguments() -> None:
    positions = random_positions(2, seed=8)
    q, k = randn(2, 32), randn(2, 16)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_embedding_triton(positions, q, k, cos_sin_table(16), 16, 7)
    with pytest.raises(ValueError, match="cos_sin"):
        rotary_embedding_triton(positions, q, k, cos_sin_table(8), 16, 16)
    with pytest.raises(ValueError, match="token count"):
        rotary_embedding_triton(positions[:1], q, k, cos_sin_table(16), 16, 16)


@CPU_ONLY
def test_rotary_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    positions = random_positions(3, seed=9)
    cos_sin = cos_sin_table(16)
    query, key = randn(3, 32, seed=10), randn(3, 16, seed=11)
    want_q, want_k = old_rotary(positions, query, key, cos_sin, 16, 16)
    monkeypatch.delenv("MRV2_KERNELS", raising=False)
    got_q, got_k = rotary_embedding(positions, query, key, cos_sin, 16, 16)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q is not query
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    q_in, k_in = query.clone(), key.clone()
    got_q, got_k = rotary_embedding(positions, q_in, k_in, cos_sin, 16, 16)
    assert got_q is q_in and got_k is k_in  # the Triton path ran: in place
    assert_matches(got_q, want_q)
    assert_matches(got_k, want_k)


@CPU_ONLY
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rotary_layer_unchanged_on_cpu(partial: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer gives bit-identical results to its old torch code on CPU (llama3 scaling)."""
    from mrv2.layers import RotaryEmbedding

    head_dim = 16
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    rope = RotaryEmbedding(
        head_dim, MAX_POS, base=500000.0, scaling=scaling, rotary_dim=int(head_dim * partial)
    )
    assert rope._cos_sin is None  # built lazily, on the positions' device
    positions = random_positions(6, seed=12)
    query, key = randn(6, 4 * head_dim, seed=13), randn(6, 2, head_dim, seed=14)
    monkeypatch.delenv("MRV2_KERNELS", raising=False)
    got_q, got_k = rope(positions, query, key)
    table = rope._table(positions.device)
    assert table.device == positions.device
    want_q, want_k = old_rotary(positions, query, key, table, head_dim, rope.rotary_dim)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    got_q, got_k = rope(positions, query.clone(), key.clone())
    assert_matches(got_q, want_q)
    assert_matches(got_k, want_k)


# --- Fused KV-cache write (kv_write) ------------------------------------------------------


def assert_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: int) -> None:
    """Equal within ``ulps`` units in the last place of the (fp16/bf16) dtype."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    bits = {F16: 11, BF16: 8}[expected.dtype]
    a, e = actual.double(), expected.double()
    _, exp = torch.frexp(torch.maximum(a.abs(), e.abs()))
    ulp = torch.ldexp(torch.ones_like(a), exp - bits).clamp(min=2.0**-133)
    err = (a - e).abs() / ulp
    assert not err.isnan().any() and err.max() <= ulps


def kv_case(
    tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    num_blocks: int, dtype: torch.dtype, cache_dtype: torch.dtype, seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(qkv, positions, slots, cache)``: a never-zero fused QKV output ``[T, (Hq+2Hk)*D]``,
    slots with padding (-1, the last token included) and a NaN-poisoned cache."""
    qkv = randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, seed=seed)
    qkv = torch.where(qkv.abs() < 0.05, torch.full_like(qkv, 0.5), qkv).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.rand(tokens, generator=gen) < 0.3] = -1
    slots[-1] = -1
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                       dtype=cache_dtype, device=DEVICE)
    return qkv, random_positions(tokens, seed=seed + 2), slots.to(DEVICE), cache


def check_cache(cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                slots: torch.Tensor, exact: bool = True) -> None:
    """Exactly the real tokens' slots hold ``key``/``value`` (cast); every other one is NaN.
    ``exact=False``: within one ulp (the interpreter truncates fp32 -> bf16, torch rounds)."""
    tokens, (num_kv_heads, head_dim) = key.shape[0], cache.shape[3:]
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    real = slots[:tokens] >= 0
    kept = slots[:tokens][real].long()
    k = key.reshape(tokens, num_kv_heads, head_dim)[real].to(cache.dtype)
    v = value.reshape(tokens, num_kv_heads, head_dim)[real].to(cache.dtype)
    if exact:
        assert torch.equal(flat[0, kept], k) and torch.equal(flat[1, kept], v)
    else:
        assert_ulps(flat[0, kept], k, 1)
        assert_ulps(flat[1, kept], v, 1)
    assert not k.isnan().any() and not v.isnan().any()
    others = torch.ones(flat.shape[1], dtype=torch.bool, device=cache.device)
    others[kept] = False
    assert flat[:, others].isnan().all()
    assert 0 < kept.numel() < tokens  # both kinds of token occurred


def unfused(positions: torch.Tensor, qkv: torch.Tensor, cos_sin: torch.Tensor, cache: torch.Tensor,
            slots: torch.Tensor, dims: tuple[int, int, int, int], qk_norm: tuple | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two launches, as before the fusion: rotate on a copy of ``qkv``, then write_kv_triton."""
    num_heads, num_kv_heads, head_dim, rotary_dim = dims
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    qkv, cache = qkv.clone(), cache.clone()
    q, k = rotary_embedding_triton(positions, qkv[:, :q_end], qkv[:, q_end:k_end], cos_sin,
                                   head_dim, rotary_dim, qk_norm)
    t = qkv.shape[0]
    write_kv_triton(k.view(t, -1, head_dim), qkv[:, k_end:].view(t, -1, head_dim), cache,
                    slots[:t])
    return q, k, cache


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("block_heads", [None, 1])
def test_fused_kv_write_matches_ref(
    dtype: torch.dtype, block_size: int, norm: bool, block_heads: int | None
) -> None:
    """GQA (4 q heads, 2 kv heads), q/k/v slices of a fused QKV output, padding slots."""
    tokens, num_heads, num_kv_heads, head_dim, eps = 6, 4, 2, 16, 1e-6
    dims = (num_heads, num_kv_heads, head_dim, head_dim)
    qkv, positions, slots, cache = kv_case(tokens, num_heads, num_kv_heads, head_dim,
                                           block_size, 3, dtype, dtype, seed=block_size)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    cos_sin = cos_sin_table(head_dim)
    qk_norm = None
    if norm:
        qk_norm = ((randn(head_dim, seed=20).abs() + 0.5).to(dtype),
                   (randn(head_dim, seed=21).abs() + 0.5).to(dtype), eps)
    before = qkv.clone()
    want_q, want_k = rotary_embedding_ref(positions, before[:, :q_end], before[:, q_end:k_end],
                                          cos_sin, head_dim, head_dim, qk_norm)
    want_cache = cache.clone()
    write_kv_ref(want_k.view(tokens, -1, head_dim), before[:, k_end:].view(tokens, -1, head_dim),
                 want_cache, slots)
    check_cache(want_cache, want_k, before[:, k_end:], slots)  # the reference itself
    ref_cache = cache.clone()  # the reference path with kv_write: the same two steps
    ref_q, ref_k = rotary_embedding_ref(
        positions, before[:, :q_end], before[:, q_end:k_end], cos_sin, head_dim, head_dim,
        qk_norm, kv_write=(before[:, k_end:], ref_cache, slots))
    assert torch.equal(ref_q, want_q) and torch.equal(ref_k, want_k)
    assert torch.equal(ref_cache.nan_to_num(0.0), want_cache.nan_to_num(0.0))
    two_q, two_k, two_cache = unfused(positions, before, cos_sin, cache, slots, dims, qk_norm)

    q, k, v = qkv[:, :q_end], qkv[:, q_end:k_end], qkv[:, k_end:]
    got_q, got_k = rotary_embedding_triton(positions, q, k, cos_sin, head_dim, head_dim, qk_norm,
                                           block_heads=block_heads, kv_write=(v, cache, slots))
    assert got_q is q and got_k is k  # still rotated in place
    assert torch.equal(v, before[:, k_end:])  # value only read
    check_cache(cache, got_k, v, slots)  # the cache holds exactly the in-place key
    # Bit-identical to the two-launch path, cache NaNs included.
    assert torch.equal(got_q, two_q) and torch.equal(got_k, two_k)
    assert torch.equal(cache.isnan(), two_cache.isnan())
    assert torch.equal(cache.nan_to_num(0.0), two_cache.nan_to_num(0.0))
    if dtype == F16 and not norm and DEVICE == "cpu":  # the interpreter rounds fp16 to
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)  # nearest: exact
    elif not norm:  # bf16 is truncated by the interpreter, the GPU fuses multiply-adds: 1 ulp
        assert_ulps(got_q, want_q, 1)
        assert_ulps(got_k, want_k, 1)
    else:  # three roundings (norm, weight, rotation): 3 ulps of the head's scale
        ulp = torch.finfo(dtype).eps
        for got, want in ((got_q, want_q), (got_k, want_k)):
            scale = float(want.float().abs().max())
            torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=3 * ulp * scale)


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(F32, BF16), (BF16, F32)])
def test_fused_kv_write_casts_to_cache_dtype(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """The cache receives the key as written back to ``key`` (in its dtype), then cast."""
    tokens, num_heads, num_kv_heads, head_dim = 5, 2, 1, 8
    dims = (num_heads, num_kv_heads, head_dim, head_dim)
    qkv, positions, slots, cache = kv_case(tokens, num_heads, num_kv_heads, head_dim, 4, 3,
                                           dtype, cache_dtype, seed=30)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    cos_sin = cos_sin_table(head_dim)
    two_q, two_k, two_cache = unfused(positions, qkv, cos_sin, cache, slots, dims)
    got_q, got_k = rotary_embedding_triton(
        positions, qkv[:, :q_end], qkv[:, q_end:k_end].reshape(tokens, num_kv_heads, head_dim),
        cos_sin, head_dim, head_dim, kv_write=(qkv[:, k_end:], cache, slots.to(torch.int32)))
    check_cache(cache, got_k, qkv[:, k_end:], slots, exact=cache_dtype != BF16)
    assert torch.equal(got_q, two_q) and torch.equal(got_k.flatten(1), two_k)
    assert torch.equal(cache.nan_to_num(0.0), two_cache.nan_to_num(0.0))


def test_kv_write_partial_rotary_falls_back() -> None:
    """rotary_dim < head_dim: rotation, then write_kv_triton; the passed-through dims reach the
    cache too. Value as [T, Hk, D]; a longer (padded) int32 slot_mapping."""
    tokens, num_heads, num_kv_heads, head_dim, rotary_dim = 5, 4, 2, 16, 8
    qkv, positions, slots, cache = kv_case(tokens, num_heads, num_kv_heads, head_dim, 5, 3, BF16,
                                           BF16, seed=40)
    slots = torch.cat([slots, torch.tensor([1, 2], device=DEVICE)]).to(torch.int32)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    value = qkv[:, k_end:].view(tokens, num_kv_heads, head_dim)
    cos_sin = cos_sin_table(rotary_dim)
    want_cache = cache.clone()
    want_q, want_k = rotary_embedding_ref(positions, qkv[:, :q_end], qkv[:, q_end:k_end], cos_sin,
                                          head_dim, rotary_dim, kv_write=(value, want_cache, slots))
    got_q, got_k = rotary_embedding_triton(positions, qkv[:, :q_end], qkv[:, q_end:k_end],
                                           cos_sin, head_dim, rotary_dim,
                                           kv_write=(value, cache, slots))
    assert_matches(got_q, want_q)
    assert_matches(got_k, want_k)
    check_cache(cache, got_k, value, slots)
    check_cache(want_cache, want_k, value, slots)


def test_kv_write_rejects_bad_arguments() -> None:
    tokens, head_dim = 3, 8
    positions, cos_sin = random_positions(tokens, seed=50), cos_sin_table(head_dim)
    q, k, v = randn(tokens, 2 * head_dim), randn(tokens, head_dim), randn(tokens, head_dim)
    cache = torch.zeros(2, 2, 4, 1, head_dim, device=DEVICE)
    slots = torch.arange(tokens, device=DEVICE)

    def call(v: torch.Tensor = v, cache: torch.Tensor = cache, slots: torch.Tensor = slots,
             fn=rotary_embedding_triton) -> None:
        fn(positions, q.clone(), k.clone(), cos_sin, head_dim, head_dim,
           kv_write=(v, cache, slots))

    for fn in (rotary_embedding_triton, rotary_embedding_ref):
        with pytest.raises(ValueError, match="value"):
            call(v=randn(tokens, 2 * head_dim), fn=fn)
        with pytest.raises(ValueError, match="value"):
            call(v=randn(tokens - 1, head_dim), fn=fn)
        with pytest.raises(ValueError, match="kv_cache"):
            call(cache=torch.zeros(2, 2, 4, 2, head_dim, device=DEVICE), fn=fn)  # heads
        with pytest.raises(ValueError, match="kv_cache"):
            call(cache=torch.zeros(2, 2, 4, 1, 2 * head_dim, device=DEVICE), fn=fn)  # head_dim
        with pytest.raises(ValueError, match="slot_mapping"):
            call(slots=slots[:-1], fn=fn)
        with pytest.raises(ValueError, match="slot_mapping"):
            call(slots=slots[None], fn=fn)
        with pytest.raises(TypeError, match="slot_mapping"):
            call(slots=slots.float(), fn=fn)
    with pytest.raises(TypeError, match="fp32/bf16/fp16"):
        call(cache=cache.double())
    with pytest.raises(ValueError, match="contiguous"):
        call(cache=torch.zeros(2, 2, 4, 1, 2 * head_dim, device=DEVICE)[..., ::2])
    # No tokens: nothing to do, nothing written.
    empty = torch.empty(0, head_dim, device=DEVICE)
    rotary_embedding_triton(positions[:0], empty, empty.clone(), cos_sin, head_dim, head_dim,
                            kv_write=(empty.clone(), cache, slots[:0]))
    assert not cache.any()


@CPU_ONLY
def test_kv_write_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reference on CPU, Triton when forced (fused, and rotate-then-write for a cache dtype the
    fused kernel does not take); all three fill the cache alike."""
    tokens, num_heads, num_kv_heads, head_dim = 4, 2, 2, 8
    qkv, positions, slots, cache = kv_case(tokens, num_heads, num_kv_heads, head_dim, 3, 4, F16,
                                           F16, seed=60)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    cos_sin, value = cos_sin_table(head_dim), qkv[:, k_end:]
    monkeypatch.delenv("MRV2_KERNELS", raising=False)
    ref_cache = cache.clone()
    want_q, want_k = rotary_embedding(positions, qkv[:, :q_end], qkv[:, q_end:k_end], cos_sin,
                                      head_dim, head_dim, kv_write=(value, ref_cache, slots))
    check_cache(ref_cache, want_k, value, slots)
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    for cache_dtype in (F16, torch.float64):
        got_cache = cache.to(cache_dtype)
        q_in, k_in = qkv[:, :q_end].clone(), qkv[:, q_end:k_end].clone()
        got_q, got_k = rotary_embedding(positions, q_in, k_in, cos_sin, head_dim, head_dim,
                                        kv_write=(value, got_cache, slots))
        assert got_q is q_in and got_k is k_in  # the Triton path ran
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
        check_cache(got_cache, got_k, value, slots)


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "qk_norm"])
def test_early_metadata_gives_the_same_bits(norm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Positions, their cos/sin rows and the cache slots loaded before the wait for the previous
    kernel (``MRV2_PDL_EARLY_META``): the same rotated q/k and the same cache, padding slots
    (-1) still skipped."""
    from mrv2_kernels import rotary as module

    tokens, num_heads, num_kv_heads, head_dim, block_size = 6, 4, 2, 16, 5
    qkv, positions, slots, cache = kv_case(tokens, num_heads, num_kv_heads, head_dim,
                                           block_size, 3, BF16, BF16, seed=9)
    q_end, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    cos_sin = cos_sin_table(head_dim)
    qk_norm = ((randn(head_dim, seed=20).abs() + 0.5).to(BF16),
               (randn(head_dim, seed=21).abs() + 0.5).to(BF16), 1e-6) if norm else None
    runs = []
    for early in (False, True):
        monkeypatch.setattr(module, "pdl_early_meta", lambda t, default=False, e=early: e)
        x, c = qkv.clone(), cache.clone()
        q, k, v = x[:, :q_end], x[:, q_end:k_end], x[:, k_end:]
        rotary_embedding_triton(positions, q, k, cos_sin, head_dim, head_dim, qk_norm,
                                kv_write=(v, c, slots))
        runs.append((x, c))
    (x0, c0), (x1, c1) = runs
    assert torch.equal(x0, x1) and not torch.equal(x0, qkv)
    assert torch.equal(c0.isnan(), c1.isnan()) and torch.equal(c0.nan_to_num(0.0),
                                                               c1.nan_to_num(0.0))
    assert (slots < 0).any()  # the case has padding slots, which stay unwritten in both
    key = x1[:, q_end:k_end].reshape(tokens, num_kv_heads, head_dim)
    check_cache(c1, key, x1[:, k_end:].reshape(tokens, num_kv_heads, head_dim), slots)
