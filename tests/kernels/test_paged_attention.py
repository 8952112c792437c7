"""Paged attention: the torch reference against a naive loop, and the Triton kernels against it.

Runs under ``TRITON_INTERPRET=1`` on CPU (root conftest), tiny shapes. Unused KV slots are
poisoned with large values so that reads past ``seq_len`` show up as big errors.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from mrv2_kernels.paged_attention import attention_plan, paged_attention, paged_attention_ref

POISON = 3.0e3
# CPU tensors under the interpreter; with MRV2_TEST_GPU=1 on a CUDA machine, the same tests
# run the compiled kernels.
DEVICE = "cuda" if os.environ.get("MRV2_TEST_GPU") and torch.cuda.is_available() else "cpu"

# The interpreter turns 1-element arrays into loop bounds; numpy warns about it, harmlessly.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)


@dataclass
class Batch:
    query: torch.Tensor
    kv_cache: torch.Tensor
    qsl: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    qlens: list[int]
    lens: list[int]
    num_real_tokens: int
    scale: float

    @property
    def bounds(self) -> dict[str, Any]:
        return {
            "max_query_len": max(self.qlens),
            "max_seq_len": max(self.lens),
            "num_reqs": len(self.qlens),
        }


def make_batch(
    reqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    pad_tokens: int = 0,
    seed: int = 0,
    poison: float = POISON,
) -> Batch:
    """``reqs``: (query_len, seq_len) per request. Block ids random and non-contiguous."""
    gen = torch.Generator().manual_seed(seed)
    qlens = [q for q, _ in reqs]
    lens = [s for _, s in reqs]
    blocks_per_req = [math.ceil(s / block_size) for s in lens]
    max_blocks = max(max(blocks_per_req), 1) + 2
    num_blocks = sum(blocks_per_req) + 7  # spare blocks stay poisoned
    perm = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    # Table entries past a request's blocks point at (poisoned) real blocks too.
    block_table[:] = perm[-1]
    used = 0
    for i, nb in enumerate(blocks_per_req):
        block_table[i, :nb] = perm[used : used + nb]
        used += nb

    kv = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    # Poison every slot no request may read.
    sign = torch.where(torch.rand(kv.shape, generator=gen) < 0.5, -1.0, 1.0)
    valid = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for i, s in enumerate(lens):
        for p in range(s):
            valid[block_table[i, p // block_size], p % block_size] = True
    kv = torch.where(valid[None, :, :, None, None], kv, poison * sign)

    num_real = sum(qlens)
    query = torch.randn(num_real + pad_tokens, num_heads, head_dim, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    return Batch(
        query=query.to(DEVICE, dtype),
        kv_cache=kv.to(DEVICE, dtype),
        qsl=qsl.to(DEVICE),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        block_table=block_table.to(DEVICE),
        qlens=qlens,
        lens=lens,
        num_real_tokens=num_real,
        scale=1.0 / math.sqrt(head_dim),
    )


def naive_attention(b: Batch) -> torch.Tensor:
    """Dense causal attention per request, per query token, per head: plain Python loops."""
    num_heads = b.query.shape[1]
    num_kv_heads, block_size = b.kv_cache.shape[3], b.kv_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(b.query.shape, dtype=torch.float32, device=b.query.device)
    for i, (qlen, seq_len) in enumerate(zip(b.qlens, b.lens, strict=True)):
        keys = []
        values = []
        for p in range(seq_len):
            blk = int(b.block_table[i, p // block_size])
            keys.append(b.kv_cache[0, blk, p % block_size].float())
            values.append(b.kv_cache[1, blk, p % block_size].float())
        for j in range(qlen):
            t = int(b.qsl[i]) + j
            pos = seq_len - qlen + j
            if pos < 0:
                continue
            for h in range(num_heads):
                k = torch.stack([keys[p][h // group] for p in range(pos + 1)])
                v = torch.stack([values[p][h // group] for p in range(pos + 1)])
                s = (k @ b.query[t, h].float()) * b.scale
                out[t, h] = torch.softmax(s, 0) @ v
    return out


MIXED = [(1, 23), (13, 13), (9, 30), (1, 5), (0, 0)]  # decode, prefill, chunked, decode, pad


def _tol(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 2e-3 if dtype == torch.float16 else 1e-4


def _check(out: torch.Tensor, ref: torch.Tensor, b: Batch, dtype: torch.dtype) -> None:
    n = b.num_real_tokens
    assert out.dtype == dtype and out.shape == b.query.shape
    assert torch.isfinite(out[:n].float()).all(), "a real row was not written"
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=_tol(dtype), rtol=_tol(dtype))


def test_ref_matches_naive() -> None:
    reqs = [(1, 9), (6, 6), (4, 11), (0, 0), (2, 2)]
    b = make_batch(
        reqs,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        block_size=4,
        dtype=torch.float32,
        pad_tokens=2,
    )
    ref = paged_attention_ref(
        b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale, **b.bounds
    )
    naive = naive_attention(b)
    torch.testing.assert_close(ref, naive, atol=1e-5, rtol=1e-5)
    assert (ref[b.num_real_tokens :] == 0).all()


def test_ref_bf16_close_to_naive() -> None:
    b = make_batch(
        [(3, 7), (1, 12)],
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        block_size=4,
        dtype=torch.bfloat16,
    )
    ref = paged_attention_ref(
        b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale, **b.bounds
    )
    assert ref.dtype == torch.bfloat16
    torch.testing.assert_close(ref.float(), naive_attention(b), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(
    ("block_size", "num_heads", "num_kv_heads", "head_dim", "dtype"),
    [
        (4, 4, 2, 16, torch.float32),
        (16, 2, 2, 32, torch.float32),
        (16, 8, 1, 16, torch.bfloat16),
        (4, 4, 2, 32, torch.bfloat16),
        (16, 4, 2, 64, torch.float32),
        (16, 6, 2, 16, torch.float16),  # group of 3: padded to 4 rows per token
    ],
)
def test_mixed_batch(
    block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    b = make_batch(
        MIXED,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        pad_tokens=3,
        seed=block_size + num_heads,
    )
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    ref = paged_attention_ref(*args, **b.bounds)
    out = paged_attention(*args, **b.bounds)
    _check(out, ref, b, dtype)
    assert (out[b.num_real_tokens :] == 0).all(), "padding tokens should come out as zeros"


@pytest.mark.parametrize(("block_m", "block_n"), [(16, 32), (64, 16)])
def test_mixed_batch_tile_sizes(block_m: int, block_n: int) -> None:
    """Several query tiles per request (block_m 16) and key tiles spanning blocks (block_n 32)."""
    b = make_batch(
        MIXED,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        pad_tokens=1,
        seed=3,
    )
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    ref = paged_attention_ref(*args, **b.bounds)
    poisoned = torch.full_like(b.query, float("nan"))
    out = paged_attention(*args, **b.bounds, out=poisoned, block_m=block_m, block_n=block_n)
    assert out is poisoned
    _check(out, ref, b, torch.float32)
    assert (out[b.num_real_tokens :] == 0).all()  # padding rows zeroed by the kernel itself


@pytest.mark.parametrize(
    ("num_splits", "dtype"),
    [(1, torch.float32), (3, torch.float32), (8, torch.bfloat16), (None, torch.float32)],
)
def test_uniform_decode_splits(num_splits: int | None, dtype: torch.dtype) -> None:
    # Varied lengths, a padded row with no query and one with a query but no context.
    reqs = [(1, 77), (1, 1), (1, 40), (0, 0), (1, 0), (1, 17)]
    b = make_batch(
        reqs,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=dtype,
        pad_tokens=2,
        seed=11,
    )
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    ref = paged_attention_ref(*args, **b.bounds)
    out = paged_attention(*args, **b.bounds, uniform_decode=True, num_splits=num_splits)
    _check(out, ref, b, dtype)
    assert (out[b.num_real_tokens :] == 0).all()
    no_key_token = int(b.qsl[4])  # request 4 has a query but no key to attend to
    assert (out[no_key_token] == 0).all()


def test_decode_splits_poisoned_out_and_loose_bound() -> None:
    """Split path with a loose max_seq_len (as for graph capture) and a NaN-filled output."""
    reqs = [(1, 50), (1, 9), (1, 33)]
    b = make_batch(
        reqs,
        num_heads=8,
        num_kv_heads=1,
        head_dim=16,
        block_size=16,
        dtype=torch.float32,
        pad_tokens=1,
        seed=5,
    )
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    ref = paged_attention_ref(*args, **b.bounds)
    out = torch.full_like(b.query, float("nan"))
    paged_attention(*args, max_query_len=1, max_seq_len=4096, num_reqs=3, out=out, num_splits=5)
    _check(out, ref, b, torch.float32)
    assert (out[-1] == 0).all()  # the combine kernel zeroes padding tokens


def test_small_query_split_path() -> None:
    """Spec-decode-sized queries (several tokens, causal inside the tile) with splits."""
    reqs = [(3, 40), (2, 2), (3, 21)]
    b = make_batch(
        reqs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32, seed=7
    )
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    ref = paged_attention_ref(*args, **b.bounds)
    out = paged_attention(*args, **b.bounds, num_splits=4)
    _check(out, ref, b, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_causal_tile_boundaries(num_splits: int) -> None:
    """Contexts around the key-tile size: the unmasked/masked loop split must be exact."""
    reqs = [(4, c + 4) for c in range(12, 19)] + [(1, 16), (1, 17), (1, 32)]
    b = make_batch(
        reqs, num_heads=2, num_kv_heads=1, head_dim=16, block_size=4, dtype=torch.float32, seed=13
    )
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    ref = paged_attention_ref(*args, **b.bounds)
    out = paged_attention(*args, **b.bounds, block_m=16, block_n=16, num_splits=num_splits)
    _check(out, ref, b, torch.float32)


@pytest.mark.parametrize("uniform_decode", [False, True])
def test_nan_poisoned_cache_never_read(uniform_decode: bool) -> None:
    """NaN in every slot no request owns: any unmasked load of one would poison the output."""
    reqs = [(1, 21), (1, 6), (1, 35)] if uniform_decode else MIXED
    b = make_batch(
        reqs,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.bfloat16,
        pad_tokens=2,
        seed=17,
        poison=float("nan"),
    )
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    ref = paged_attention_ref(*args, **b.bounds)
    out = paged_attention(*args, **b.bounds, uniform_decode=uniform_decode, num_splits=3)
    _check(out, ref, b, torch.bfloat16)


def test_attention_plan_defaults() -> None:
    query = torch.empty(4, 8, 16)
    kv = torch.empty(2, 1, 16, 2, 16)
    decode = attention_plan(query, kv, max_query_len=1, max_seq_len=1000, num_reqs=1)
    assert decode.small_q and decode.num_q_tiles == 1 and decode.block_q >= 1
    assert decode.num_splits == 4  # 8 interpreter "SMs" / (1 request x 2 kv heads)
    short = attention_plan(query, kv, max_query_len=1, max_seq_len=20, num_reqs=1)
    assert short.num_splits == 1  # no split below 2 * block_n keys
    prefill = attention_plan(query, kv, max_query_len=100, max_seq_len=1000, num_reqs=1)
    assert not prefill.small_q and prefill.num_splits == 1
    assert prefill.num_q_tiles * prefill.block_q >= 100
    spec = attention_plan(
        query, kv, max_query_len=9, max_seq_len=64, num_reqs=2, uniform_decode=True
    )
    assert spec.small_q and spec.num_q_tiles == 1


def test_triton_backend_end_to_end() -> None:
    """The backend: write this step's K/V into the cache, then attend; against the refs."""
    from mrv2.attention.triton_backend import TritonAttentionBackend
    from mrv2.contract.attention import AttentionMetadata
    from mrv2_kernels.kv_cache import write_kv_ref

    reqs = [(1, 12), (6, 6), (0, 0)]
    b = make_batch(
        reqs,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        dtype=torch.float32,
        pad_tokens=1,
        seed=9,
    )
    block_size = 4
    slots = []
    for i, (qlen, seq_len) in enumerate(reqs):
        for p in range(seq_len - qlen, seq_len):
            slots.append(int(b.block_table[i, p // block_size]) * block_size + p % block_size)
    slots.append(-1)  # the padding token
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(len(slots), 2, 16, generator=gen).to(DEVICE)
    value = torch.randn(len(slots), 2, 16, generator=gen).to(DEVICE)
    meta = AttentionMetadata(
        num_reqs=3,
        num_tokens=len(slots),
        max_query_len=6,
        max_seq_len=12,
        query_start_loc=b.qsl,
        seq_lens=b.seq_lens,
        block_table=b.block_table,
        slot_mapping=slot_mapping,
        block_size=block_size,
    )
    backend = TritonAttentionBackend()
    assert backend.name == "triton"
    cache = b.kv_cache.clone()
    backend.write_kv(key, value, cache, slot_mapping)
    expected_cache = b.kv_cache.clone()
    write_kv_ref(key, value, expected_cache, slot_mapping)
    assert torch.equal(cache, expected_cache)
    out = backend.forward(b.query, cache, meta, b.scale)
    ref = paged_attention_ref(
        b.query, expected_cache, b.qsl, b.seq_lens, b.block_table, b.scale, **b.bounds
    )
    _check(out, ref, b, torch.float32)


@pytest.mark.parametrize("uniform_decode", [False, True])
def test_early_metadata_gives_the_same_bits(uniform_decode: bool,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The request's query range and length loaded before the wait for the previous kernel
    (``MRV2_PDL_EARLY_META``): only the order of the loads changes, never the result; padding
    rows still come out zero (their stores stay after the wait)."""
    from mrv2_kernels import paged_attention as module

    reqs = [(1, 77), (1, 1), (0, 0), (1, 17)] if uniform_decode else MIXED
    b = make_batch(reqs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                   dtype=torch.bfloat16, pad_tokens=2, seed=5)
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    kwargs: dict[str, Any] = {**b.bounds, "uniform_decode": uniform_decode}
    if uniform_decode:
        kwargs["num_splits"] = 3
    plain = paged_attention(*args, **kwargs, out=torch.full_like(b.query, float("nan")))
    monkeypatch.setattr(module, "pdl_early_meta", lambda t, default=False: True)
    early = paged_attention(*args, **kwargs, out=torch.full_like(b.query, float("nan")))
    assert torch.equal(early, plain) and not early.isnan().any()
    assert (early[b.num_real_tokens:] == 0).all()


@pytest.mark.parametrize(("reqs", "block_m", "early_meta"), [
    (MIXED, 16, False),
    (MIXED, 64, True),
    ([(1, 9), (37, 37), (1, 3), (0, 4), (1, 1), (20, 45), (1, 30)], 16, True),
    ([(29, 40)], 16, False),
    # more requests than one search load holds on the CPU (16): several loads are counted
    ([(1, 5 + 3 * i) if i % 4 else (7 + i, 9 + 2 * i) for i in range(21)], 16, False),
])
def test_flat_grid_gives_the_same_bits(reqs: list[tuple[int, int]], block_m: int,
                                       early_meta: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``flat_grid``: a prefill plan's programs walk the step's query tiles (each finds its
    request by counting tile starts) instead of query-tile bound x requests; every request's tiles,
    the gaps between requests, empty requests and the padding rows come out as with the
    (query tile, request) grid, bit for bit, and as the reference."""
    from mrv2_kernels import paged_attention as module

    if early_meta:  # the search then runs before the wait, with the other metadata loads
        monkeypatch.setattr(module, "pdl_early_meta", lambda t, default=False: True)
    b = make_batch(reqs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                   dtype=torch.float32, pad_tokens=3, seed=11)
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    grid = paged_attention(*args, **b.bounds, block_m=block_m, flat_grid=False,
                           out=torch.full_like(b.query, float("nan")))
    flat = paged_attention(*args, **b.bounds, block_m=block_m, flat_grid=True,
                           out=torch.full_like(b.query, float("nan")))
    assert torch.equal(flat, grid) and not flat.isnan().any()
    _check(flat, paged_attention_ref(*args, **b.bounds), b, torch.float32)
    assert (flat[b.num_real_tokens:] == 0).all()


def test_tiles_last_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tile axis is slowest by default on the paged kernel's flat grid only (the default
    prefill path); ``MRV2_ATTN_TILES_LAST`` 1 / 0 turns it on / off everywhere; a value
    given wins."""
    from mrv2_kernels.paged_attention import TILES_LAST_ENV_VAR, prefill_tiles_last

    monkeypatch.delenv(TILES_LAST_ENV_VAR, raising=False)
    assert prefill_tiles_last(None, True) and not prefill_tiles_last(None, False)
    monkeypatch.setenv(TILES_LAST_ENV_VAR, "1")
    assert prefill_tiles_last(None, True) and prefill_tiles_last(None, False)
    monkeypatch.setenv(TILES_LAST_ENV_VAR, "0")
    assert not prefill_tiles_last(None, True) and not prefill_tiles_last(None, False)
    assert prefill_tiles_last(True, False) and not prefill_tiles_last(False, True)


def test_flat_grid_order_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flat grid's order, per step on the device: its tiles slowest while the longest
    sequence's keys, every kv head's K and V, fit the L2 cache (50 MiB off CUDA); forced
    either way by ``tiles_last`` or ``MRV2_ATTN_TILES_LAST``."""
    from mrv2_kernels.paged_attention import TILES_LAST_ENV_VAR, flat_tiles_last_keys

    kv = torch.empty(2, 3, 4, 8, 128, dtype=torch.bfloat16)  # 8 kv heads of 128: 4 KiB a key
    monkeypatch.delenv(TILES_LAST_ENV_VAR, raising=False)
    assert flat_tiles_last_keys(None, kv) == 12_800
    assert flat_tiles_last_keys(None, kv.to(torch.float32)) == 6_400
    assert flat_tiles_last_keys(True, kv) == 2**31 - 1 and flat_tiles_last_keys(False, kv) == -1
    monkeypatch.setenv(TILES_LAST_ENV_VAR, "1")
    assert flat_tiles_last_keys(None, kv) == 2**31 - 1
    monkeypatch.setenv(TILES_LAST_ENV_VAR, "0")
    assert flat_tiles_last_keys(None, kv) == -1 and flat_tiles_last_keys(True, kv) == 2**31 - 1


def test_prefill_grid_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The (tile, request) grid for prompts of about one length (no more programs than the
    flat grid, several requests), its tiles slowest while the keys fit the L2 cache; the flat
    grid otherwise (a mixed step, one request, a CUDA graph's baked ``max_query_len``);
    ``flat_grid`` and ``MRV2_ATTN_FLAT_GRID`` force either. Same bits as the flat grid."""
    from mrv2_kernels import paged_attention as module

    monkeypatch.delenv(module.FLAT_GRID_ENV_VAR, raising=False)
    monkeypatch.delenv(module.TILES_LAST_ENV_VAR, raising=False)
    rule = module.prefill_flat_grid
    assert not rule(None, 4 * 32, 4096 // 32 + 4, 4)  # 4 x 1,024 in 32-query tiles
    assert rule(None, 16 * 144, 8192 // 32 + 144, 144)  # the workload's mixed step
    assert rule(None, 128, 4096 // 32 + 1, 1)  # one prompt: the flat grid's per-step order
    assert rule(True, 1, 100, 4) and not rule(False, 1000, 10, 4)
    monkeypatch.setenv(module.FLAT_GRID_ENV_VAR, "1")
    assert rule(None, 4 * 32, 4096 // 32 + 4, 4)
    monkeypatch.setenv(module.FLAT_GRID_ENV_VAR, "0")
    assert not rule(None, 16 * 144, 8192 // 32 + 144, 144)
    monkeypatch.delenv(module.FLAT_GRID_ENV_VAR)

    launches: list[tuple[Any, bool, bool]] = []

    class Recorded:
        def __getitem__(self, grid: Any) -> Any:
            def run(*args: Any, **kwargs: Any) -> Any:
                launches.append((grid, kwargs["FLAT"], kwargs["TILES_LAST"]))
                return plain[grid](*args, **kwargs)
            return run

    plain = module._paged_attn_kernel
    uniform = make_batch([(12, 20), (11, 19), (12, 12)], num_heads=4, num_kv_heads=2,
                         head_dim=16, block_size=4, dtype=torch.float32, pad_tokens=0, seed=5)
    args = (uniform.query, uniform.kv_cache, uniform.qsl, uniform.seq_lens,
            uniform.block_table, uniform.scale)
    want = paged_attention(*args, **uniform.bounds, block_m=16, flat_grid=True)
    monkeypatch.setattr(module, "_paged_attn_kernel", Recorded())
    got = paged_attention(*args, **uniform.bounds, block_m=16)
    assert [(flat, last) for _, flat, last in launches] == [(False, True)]
    assert launches[0][0][2] == 2  # (tiles slowest: on z; 12 queries in 8-query tiles)
    assert torch.equal(got, want)
    launches.clear()  # keys past the L2 rule: the kv heads slowest
    monkeypatch.setattr(module, "flat_tiles_last_keys", lambda t, kv: 19)
    paged_attention(*args, **uniform.bounds, block_m=16)
    assert [(flat, last) for _, flat, last in launches] == [(False, False)]
    launches.clear()
    mixed = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                       dtype=torch.float32, pad_tokens=1, seed=3)
    paged_attention(mixed.query, mixed.kv_cache, mixed.qsl, mixed.seq_lens, mixed.block_table,
                    mixed.scale, **mixed.bounds, block_m=16, one_token_apart=False)
    assert [flat for _, flat, _ in launches] == [True]


def test_prefill_register_cap() -> None:
    """Eight-warp prefill plans (Qwen3-8B's 128 x 32 tiles) keep two programs on an SM on
    CUDA (at most 128 registers); decode plans, narrower plans and the interpreter get no cap."""
    from mrv2_kernels.paged_attention import AttentionPlan, prefill_register_cap

    def plan(warps: int, small_q: bool) -> AttentionPlan:
        return AttentionPlan(block_m=128, block_n=32, block_q=32, num_q_tiles=4, num_splits=1,
                             num_warps=warps, num_stages=2, small_q=small_q)

    assert prefill_register_cap(plan(8, False), True, 128) == {"maxnreg": 128}
    assert prefill_register_cap(plan(16, False), True, 128) == {"maxnreg": 64}
    assert prefill_register_cap(plan(4, False), True, 128) == {}
    assert prefill_register_cap(plan(8, True), True, 128) == {}
    assert prefill_register_cap(plan(8, False), False, 128) == {}
    # 256-wide head tiles (Gemma's heads; 160 padded): the accumulator alone needs the 128
    # registers, ptxas refuses the cap
    assert prefill_register_cap(plan(8, False), True, 256) == {}
    assert prefill_register_cap(plan(8, False), True, 160) == {}
    assert prefill_register_cap(plan(8, False), True, 96) == {"maxnreg": 128}


@pytest.mark.parametrize("fraction", [1.0, 1e-4])
def test_flat_grid_either_order_gives_the_same_bits(fraction: float,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The flat grid's order picked on the device (a step's longest sequence against the
    rule's keys; here under and over them, the same batch): every (tile, kv head) computed
    once, bit for bit the heads-slowest order's, padding rows zeroed, the reference's values."""
    from mrv2_kernels import paged_attention as module

    monkeypatch.delenv(module.TILES_LAST_ENV_VAR, raising=False)
    monkeypatch.setattr(module, "TILES_LAST_L2_FRACTION", fraction)
    b = make_batch([(1, 9), (37, 37), (0, 4), (20, 45), (1, 30)], num_heads=4,
                   num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32,
                   pad_tokens=3, seed=15)
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    keys = module.flat_tiles_last_keys(None, b.kv_cache)
    assert (int(b.seq_lens.max()) <= keys) == (fraction == 1.0)  # (both orders are tested)
    want = paged_attention(*args, **b.bounds, block_m=16, flat_grid=True, tiles_last=False,
                           out=torch.full_like(b.query, float("nan")))
    got = paged_attention(*args, **b.bounds, block_m=16, flat_grid=True,
                          out=torch.full_like(b.query, float("nan")))
    assert torch.equal(got, want) and not got.isnan().any()
    _check(got, paged_attention_ref(*args, **b.bounds), b, torch.float32)


def test_tiles_last_keeps_the_tiles_on_x_past_the_grid_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's grid y and z hold 65,535 blocks: a step with more query tiles than that keeps
    its tile axis on x (the default order) rather than failing to launch. (The flat grid is
    one axis, x, in either order.)"""
    from mrv2_kernels import paged_attention as module

    grids: list[tuple[int, ...]] = []
    real = module._paged_attn_kernel

    class Recorder:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr(module, "_paged_attn_kernel", Recorder())
    b = make_batch([(20, 45), (37, 37)], num_heads=4, num_kv_heads=2, head_dim=16,
                   block_size=4, dtype=torch.float32, seed=14)
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    flat = paged_attention(*args, **b.bounds, block_m=16, flat_grid=True, tiles_last=True,
                           one_token_apart=False)
    assert len(grids) == 1 and grids[-1][1:] == (1, 1)
    last = paged_attention(*args, **b.bounds, block_m=16, flat_grid=False, tiles_last=True,
                           one_token_apart=False)
    tiles = grids[-1][2]
    assert grids[-1] == (2, 2, tiles)  # (kv heads, requests, tiles): the tile axis on z
    monkeypatch.setattr(module, "MAX_GRID_YZ", tiles - 1)
    kept = paged_attention(*args, **b.bounds, block_m=16, flat_grid=False, tiles_last=True,
                           one_token_apart=False)
    assert grids[-1] == (tiles, 2, 2) and torch.equal(kept, last) and torch.equal(kept, flat)


@pytest.mark.parametrize("flat", [False, True])
def test_tiles_last_gives_the_same_bits(flat: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``tiles_last`` (and ``MRV2_ATTN_TILES_LAST=1``): the prefill grid with its query-tile
    axis slowest computes every tile as the default order does, bit for bit (padding rows
    zeroed too); a decode plan ignores it."""
    from mrv2_kernels.paged_attention import TILES_LAST_ENV_VAR

    b = make_batch([(1, 9), (37, 37), (0, 4), (20, 45), (1, 30)], num_heads=4,
                   num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32,
                   pad_tokens=3, seed=12)
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    want = paged_attention(*args, **b.bounds, block_m=16, flat_grid=flat, tiles_last=False,
                           out=torch.full_like(b.query, float("nan")))
    monkeypatch.setenv(TILES_LAST_ENV_VAR, "1")
    got = paged_attention(*args, **b.bounds, block_m=16, flat_grid=flat,
                          out=torch.full_like(b.query, float("nan")))
    assert torch.equal(got, want) and not got.isnan().any()
    _check(got, paged_attention_ref(*args, **b.bounds), b, torch.float32)
    d = make_batch([(1, 9), (1, 30)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                   dtype=torch.float32, seed=13)
    dargs = (d.query, d.kv_cache, d.qsl, d.seq_lens, d.block_table, d.scale)
    assert torch.equal(paged_attention(*dargs, **d.bounds, uniform_decode=True, tiles_last=True),
                       paged_attention(*dargs, **d.bounds, uniform_decode=True, tiles_last=False))


@pytest.mark.parametrize(("reqs", "flat", "dtype", "heads"), [
    (MIXED, True, torch.float32, (8, 2)),
    # one-token requests of 1, 15, 16 and 17 keys (around a 16-key tile), a one-token prompt,
    # a spec-decode-sized request, padding after
    ([(1, 16), (1, 17), (12, 40), (1, 1), (1, 15), (3, 9), (1, 33)], True, torch.float32, (8, 2)),
    ([(1, 16), (1, 17), (12, 40), (1, 1), (1, 15), (3, 9), (1, 33)], False, torch.bfloat16,
     (8, 2)),
    (MIXED, True, torch.float32, (12, 2)),  # groups of 6 (GLM-4.5's are 12): padded rows
])
def test_one_token_requests_apart(reqs: list[tuple[int, int]], flat: bool,
                                  dtype: torch.dtype, heads: tuple[int, int]) -> None:
    """``one_token_apart``: a prefill plan's requests of one query token attend in a launch of
    their own (the decode plan's tiles) before the rest; every row matches the reference and the
    single launch, the other requests' rows are the same bits, padding rows stay zero."""
    b = make_batch(reqs, num_heads=heads[0], num_kv_heads=heads[1], head_dim=16, block_size=4,
                   dtype=dtype, pad_tokens=2, seed=13)
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    assert b.bounds["max_query_len"] > 1  # a prefill plan
    out = {apart: paged_attention(*args, **b.bounds, flat_grid=flat, one_token_apart=apart,
                                  out=torch.full_like(b.query, float("nan")))
           for apart in (True, False)}
    _check(out[True], paged_attention_ref(*args, **b.bounds), b, dtype)
    _check(out[True], out[False], b, dtype)
    n = b.num_real_tokens
    longer = torch.cat([torch.full((q,), q != 1) for q, _ in reqs])
    assert torch.equal(out[True][:n][longer], out[False][:n][longer])
    assert (out[True][n:] == 0).all()


def test_one_token_apart_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two attention launches for a prefill plan with one-token requests apart, one without:
    by default apart from 128-row tiles on (``ONE_TOKEN_APART_MIN_BLOCK_M``), ``1`` / ``0``
    always / never; one launch for a decode plan either way (its requests all have one
    token)."""
    from mrv2_kernels import paged_attention as module

    b = make_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                   dtype=torch.float32, pad_tokens=1, seed=3)
    args = (b.query, b.kv_cache, b.qsl, b.seq_lens, b.block_table, b.scale)
    launches: list[int] = []

    class Counted:
        def __getitem__(self, grid: Any) -> Any:
            launches.append(1)
            return plain[grid]

    plain = module._paged_attn_kernel
    monkeypatch.setattr(module, "_paged_attn_kernel", Counted())
    assert module.ONE_TOKEN_APART_MIN_BLOCK_M == 128
    for setting, block_m, want in ((None, 128, 2), (None, 64, 1), ("1", 32, 2), ("0", 128, 1)):
        if setting is None:
            monkeypatch.delenv(module.ONE_TOKEN_ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(module.ONE_TOKEN_ENV_VAR, setting)
        launches.clear()
        paged_attention(*args, **b.bounds, block_m=block_m)
        assert len(launches) == want, (setting, block_m)
    d = make_batch([(1, 9), (1, 30)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                   dtype=torch.float32, pad_tokens=0, seed=4)
    monkeypatch.setenv(module.ONE_TOKEN_ENV_VAR, "1")
    launches.clear()
    paged_attention(d.query, d.kv_cache, d.qsl, d.seq_lens, d.block_table, d.scale, **d.bounds)
    assert len(launches) == 1


_SM90_SCRIPT = r"""
from mrv2_kernels import paged_attention as m

bf, f32, i32 = "*bf16", "*fp32", "*i32"
ptrs = {"q_ptr": bf, "k_ptr": bf, "v_ptr": bf, "out_ptr": bf, "part_m_ptr": f32,
        "part_l_ptr": f32, "part_acc_ptr": f32, "qsl_ptr": i32, "seq_lens_ptr": i32,
        "block_table_ptr": i32, "pos_ptr": "*i64", "cos_sin_ptr": f32, "q_w_ptr": bf,
        "k_w_ptr": bf, "new_k_ptr": bf, "new_v_ptr": bf, "slot_ptr": "*i64"}
common = dict(HEAD_DIM=128, HEAD_DIM_P2=128, KV_BLOCK_SIZE=16, DOT_FP32=False,
              FP32_PRECISION="tf32x3",
              PDL=True, EARLY_META=False, ROPE=False, QK_NORM=False, SKIP_LONG=False,
              SLIDING=False, CAP=0.0, SINKS=False, sinks_ptr=None, CHUNK=0)
# the GPU prefill tiles (attention_plan): 8B heads (group 4), 0.6B heads (group 2)
for group, bm, bn, warps in ((4, 128, 32, 8), (2, 64, 64, 4)):
    for flat, one in ((False, 0), (True, 0), (True, 2)):  # 2: one-token requests skipped
        build(m._paged_attn_kernel, ptrs,
              dict(common, GROUP=group, GROUP_P2=group, BLOCK_Q=bm // group, BLOCK_M=bm,
                   BLOCK_N=bn, USE_SPLITS=False, ZERO_PAD=True, FLAT=flat, REQ_BLOCK=256,
                   ONE_TOKEN=one),
              num_warps=warps, num_stages=2)
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU run compiles it for real")
def test_prefill_plans_compile_for_sm90_flat_or_not(tmp_path: Any) -> None:
    """The prefill plans' kernels compile for an H100/H200 (no GPU needed) with the flat grid's
    request search and without, and skipping one-token requests; neither costs shared memory
    (so no resident program per SM)."""
    from sm90 import compile_for_sm90

    sizes = compile_for_sm90(_SM90_SCRIPT, tmp_path)["_paged_attn_kernel"]
    assert len(sizes) == 6 and all(s > 0 for s in sizes)
    assert sizes[0] == sizes[1] == sizes[2] and sizes[3] == sizes[4] == sizes[5], sizes


def count_calls(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Wrap ``module.name`` so that every call appends to the returned list."""
    calls: list[int] = []
    plain = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return plain(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _rope_case(reqs: list[tuple[int, int]], dtype: torch.dtype, qk_norm: bool,
               seed: int, d: int = 16) -> tuple[Batch, dict[str, Any]]:
    """A batch whose step tokens come raw from one fused QKV buffer (strided slices), with
    their positions and slots; the new tokens' cache slots hold NaN until someone writes them.
    4 query heads, 2 kv heads of ``d``.
    """
    from mrv2.layers.rotary import RotaryEmbedding

    heads, kv_heads, bs = 4, 2, 4
    b = make_batch(reqs, num_heads=heads, num_kv_heads=kv_heads, head_dim=d, block_size=bs,
                   dtype=dtype, pad_tokens=1, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    num_tokens = b.query.shape[0]
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * d, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=1)
    positions, slots = [], []
    for i, (qlen, seq_len) in enumerate(reqs):
        for p in range(seq_len - qlen, seq_len):
            positions.append(p)
            slots.append(int(b.block_table[i, p // bs]) * bs + p % bs)
    positions.append(0)
    slots.append(-1)  # the padding token: never written
    slot_t = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    flat = b.kv_cache.view(2, -1, kv_heads, d)
    flat[:, slot_t[slot_t >= 0]] = float("nan")
    norm = None
    if qk_norm:
        norm = (torch.rand(d, generator=gen).add(0.5).to(DEVICE, dtype),
                torch.rand(d, generator=gen).add(0.5).to(DEVICE, dtype), 1e-6)
    rope = {"positions": torch.tensor(positions, dtype=torch.int64, device=DEVICE),
            "cos_sin": RotaryEmbedding(d, 128, base=100.0)._table(torch.device(DEVICE)),
            "q": q, "k": k, "v": v, "slots": slot_t, "qk_norm": norm}
    return b, rope


def _rope_reference(b: Batch, r: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """What a :func:`_rope_case` step must produce: ``(output, cache)`` of
    rotary_embedding_ref (on copies of q/k; its KV write into a copy of the cache) followed by
    paged_attention_ref."""
    from mrv2_kernels.rotary import rotary_embedding_ref

    d = b.query.shape[2]
    want_cache = b.kv_cache.clone()
    q_ref, _ = rotary_embedding_ref(r["positions"], r["q"].clone(), r["k"].clone(),
                                    r["cos_sin"], d, d, r["qk_norm"],
                                    kv_write=(r["v"], want_cache, r["slots"]))
    ref = paged_attention_ref(q_ref.reshape(b.query.shape[0], 4, d), want_cache, b.qsl,
                              b.seq_lens, b.block_table, b.scale, **b.bounds)
    return ref, want_cache


def _fused_rope(r: dict[str, Any]) -> Any:
    """The :class:`~mrv2_kernels.paged_attention.FusedRope` of a :func:`_rope_case` step."""
    from mrv2_kernels.paged_attention import FusedRope

    return FusedRope(r["positions"], r["cos_sin"], r["k"], r["v"], r["slots"], r["qk_norm"])


@pytest.mark.parametrize(
    ("dtype", "qk_norm", "num_splits", "qlen"),
    [(torch.bfloat16, True, 3, 1), (torch.float32, False, 2, 3), (torch.bfloat16, False, 1, 1),
     (torch.float32, True, 4, 2)],
)
def test_rope_inside_decode_attention(dtype: torch.dtype, qk_norm: bool, num_splits: int,
                                      qlen: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw query/key/value in: with splits the kernel normalizes and rotates the queries and
    stores the step's keys (rotated) and values before it reads them (their slots start as
    NaN); unsplit, the RoPE kernel runs first. Against rotary_embedding_ref + write_kv_ref +
    paged_attention_ref."""
    from mrv2_kernels import paged_attention_plan as module  # runs the RoPE kernel

    rope_kernel_calls = count_calls(monkeypatch, module, "rotary_embedding_triton")

    reqs = [(qlen, 37), (qlen, qlen), (0, 0), (qlen, 20)]
    b, r = _rope_case(reqs, dtype, qk_norm, seed=11)
    ref, want_cache = _rope_reference(b, r)
    num_tokens = b.query.shape[0]
    cache = b.kv_cache.clone()
    out = paged_attention(
        r["q"].reshape(num_tokens, 4, 16), cache, b.qsl, b.seq_lens, b.block_table, b.scale,
        **b.bounds, uniform_decode=True, num_splits=num_splits,
        out=torch.full((num_tokens, 4, 16), float("nan"), dtype=dtype, device=DEVICE),
        rope=_fused_rope(r),
    )
    assert attention_plan(b.query, cache, **b.bounds, uniform_decode=True).small_q
    assert len(rope_kernel_calls) == (1 if num_splits == 1 else 0)
    assert not cache.isnan().any(), "a new key or value was not stored"
    torch.testing.assert_close(cache.float(), want_cache.float(), atol=_tol(dtype),
                               rtol=_tol(dtype))
    untouched = torch.ones(cache.shape[1] * cache.shape[2], dtype=torch.bool, device=DEVICE)
    untouched[r["slots"][r["slots"] >= 0]] = False
    flat, want_flat = cache.view(2, -1, 2, 16), want_cache.view(2, -1, 2, 16)
    assert torch.equal(flat[:, untouched], want_flat[:, untouched])
    _check(out, ref, b, dtype)
    assert torch.equal(out[b.num_real_tokens:], torch.zeros_like(out[b.num_real_tokens:]))


def test_rope_with_a_prefill_plan_runs_the_rope_kernel_first() -> None:
    """A step the small-query plan cannot take (prefill chunks): same contract, through the
    RoPE kernel (with its cache write) and then attention."""
    reqs = [(1, 23), (13, 13), (9, 30)]
    b, r = _rope_case(reqs, torch.float32, True, seed=3)
    num_tokens = b.query.shape[0]
    ref, want_cache = _rope_reference(b, r)
    assert not attention_plan(b.query, b.kv_cache, **b.bounds).small_q
    cache = b.kv_cache.clone()
    out = paged_attention(
        r["q"].reshape(num_tokens, 4, 16), cache, b.qsl, b.seq_lens, b.block_table, b.scale,
        **b.bounds, rope=_fused_rope(r),
    )
    torch.testing.assert_close(cache, want_cache, atol=1e-5, rtol=0)
    _check(out, ref, b, torch.float32)
