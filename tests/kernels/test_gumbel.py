"""Gumbel-max sampling: the hash contract, Triton (interpreted on CPU) against the reference."""

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

from mrv2_kernels import (
    gumbel_noise_ref,
    gumbel_sample,
    gumbel_sample_ref,
    gumbel_sample_triton,
    mix32_ref,
    row_key_ref,
    uniform_hash_ref,
    uniform_hash_triton,
)
from mrv2_kernels.gumbel import gumbel_sample_cpu, gumbel_sample_rows

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

I64 = torch.int64
M32 = 0xFFFFFFFF
EXTREME_SEEDS = [0, 1, -1, 2**63 - 1, -(2**63), 0x1234_5678_9ABC_DEF0, -987654321]


# ------------------------------------------------------------------ pure-Python hash (the spec)


def py_mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def py_uniform(seed: int, pos: int, v: int) -> float:
    s, p = seed & 0xFFFF_FFFF_FFFF_FFFF, pos & 0xFFFF_FFFF_FFFF_FFFF
    key = py_mix32((s & M32) ^ 0x9E3779B9)
    key = py_mix32(key ^ (s >> 32))
    key = py_mix32(key ^ (p & M32))
    key = py_mix32(key ^ (p >> 32))
    h = py_mix32((py_mix32(key ^ v) + key) & M32)
    return ((h >> 9) + 0.5) * 2.0**-23


def t64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=I64, device=DEVICE)


def test_golden_values() -> None:
    """Pinned values: changing the hash breaks seeded reproducibility, so it must be loud."""
    xs = [0, 1, 0x9E3779B9, M32, 123456789]
    golden = [0, 1753845952, 33350994, 1734902346, 2834422664]
    assert [py_mix32(x) for x in xs] == golden
    assert mix32_ref(t64(xs)).tolist() == golden
    assert row_key_ref(t64([42]), t64([7])).tolist() == [2066775519]
    u = uniform_hash_ref(t64([42, -1]), t64([7, 2**33 + 1]), 3).tolist()
    assert u == [
        [0.2508290410041809, 0.12527889013290405, 0.7234317660331726],
        [0.4405372738838196, 0.2497888207435608, 0.5780938267707825],
    ]


def test_ref_matches_python_spec() -> None:
    seeds = EXTREME_SEEDS
    positions = [0, 1, 2**31 - 1, 2**32 + 5, 4095, 2**40, 17]
    vocab = 37
    u = uniform_hash_ref(t64(seeds), t64(positions), vocab).cpu()
    assert u.dtype == torch.float32
    for n, (s, p) in enumerate(zip(seeds, positions, strict=True)):
        assert u[n].tolist() == [py_uniform(s, p, v) for v in range(vocab)]


def test_uniform_triton_bit_identical() -> None:
    g = torch.Generator().manual_seed(0)
    seeds = EXTREME_SEEDS + torch.randint(-(2**62), 2**62, (3,), generator=g).tolist()
    positions = [3, 2**33 + 1, 0, 65535, 2**31, 999, 1, 12, 4096, 77]
    vocab = 300
    out = torch.full((len(seeds), vocab + 20), -7.0, device=DEVICE)[:, :vocab]  # strided rows
    uniform_hash_triton(t64(seeds), t64(positions), out)
    want = uniform_hash_ref(t64(seeds), t64(positions), vocab)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))
    assert float(want.min()) > 0.0 and float(want.max()) < 1.0


def test_noise_is_standard_gumbel() -> None:
    """Mean ~ Euler-Mascheroni, variance ~ pi^2 / 6 over many (position, vocab) draws."""
    seeds = torch.full((64,), 1234, dtype=I64, device=DEVICE)
    g = gumbel_noise_ref(seeds, torch.arange(64, device=DEVICE), 4096).double()
    assert torch.isfinite(g).all()
    assert abs(float(g.mean()) - 0.5772156649) < 0.01
    assert abs(float(g.var()) - 3.14159265**2 / 6) < 0.03


# ------------------------------------------------------------------------------ sampling


def make_inputs(
    seed: int, n: int = 5, vocab: int = 300, dtype: torch.dtype = torch.float32, pad: int = 13
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random logits (rows strided by ``vocab + pad``), some ``-inf``, some greedy rows."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(n, vocab + pad, generator=g) * 2.0
    full[torch.rand(n, vocab + pad, generator=g) < 0.2] = float("-inf")
    logits = full.to(dtype).to(DEVICE)[:, :vocab]
    seeds = torch.randint(-(2**62), 2**62, (n,), generator=g).to(DEVICE)
    positions = torch.randint(0, 2**20, (n,), generator=g).to(DEVICE)
    greedy = torch.zeros(n, dtype=torch.bool)
    greedy[1::3] = True
    return logits, seeds, positions, greedy.to(DEVICE)


def sample(fn: object, *args: torch.Tensor, **kw: int) -> torch.Tensor:
    out = torch.full((args[0].shape[0],), 777, dtype=I64, device=DEVICE)
    fn(*args, out, **kw)  # type: ignore[operator]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_matches_ref(dtype: torch.dtype) -> None:
    logits, seeds, positions, greedy = make_inputs(seed=1, dtype=dtype)
    assert not logits.is_contiguous()
    want = sample(gumbel_sample_ref, logits, seeds, positions, greedy)
    got = sample(gumbel_sample_triton, logits, seeds, positions, greedy)
    assert torch.equal(got, want)
    # Greedy rows are the plain argmax, sampled rows mostly are not.
    assert torch.equal(want[greedy], logits.float().argmax(1)[greedy])
    assert (want[~greedy] != logits.float().argmax(1)[~greedy]).any()
    assert torch.isfinite(logits.float().gather(1, want[:, None])).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_temperature_in_kernel_equals_dividing_first(dtype: torch.dtype) -> None:
    """``temperature=`` gives exactly the tokens of sampling ``logits.float() / t``."""
    logits, seeds, positions, greedy = make_inputs(seed=5, dtype=dtype)
    g = torch.Generator().manual_seed(9)
    temperature = (torch.rand(logits.shape[0], generator=g) * 1.5 + 0.05).to(DEVICE)
    scaled = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    want = sample(gumbel_sample_ref, scaled, seeds, positions, greedy)
    for fn in (gumbel_sample_ref, gumbel_sample_triton):
        got = torch.full_like(want, 777)
        fn(logits, seeds, positions, greedy, got, temperature)
        assert torch.equal(got, want), fn
    # the scale matters: unscaled sampling differs somewhere
    assert not torch.equal(sample(gumbel_sample_ref, logits, seeds, positions, greedy), want)


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_rows_read_from_per_request_tables(kernels: str, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    """``gumbel_sample_rows`` (the seed and temperature of each row's request read from
    tables, greedy below eps) gives the tokens of gathering them first; a top-k / top-p cut
    rides along; rows name requests in any order, some twice."""
    monkeypatch.setenv("MRV2_KERNELS", kernels)
    logits, seeds, positions, greedy = make_inputs(seed=7, n=6, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(11)
    temps = (torch.rand(9, generator=g) + 0.2).to(DEVICE)
    temps[[2, 5]] = torch.tensor([0.0, 1e-6], device=DEVICE)  # greedy requests (below eps)
    seed_table = torch.randint(-(2**62), 2**62, (9,), generator=g).to(DEVICE)
    rows = torch.tensor([5, 0, 8, 2, 0, 7], dtype=torch.int32, device=DEVICE)
    t = temps[rows.long()]
    want = torch.full((6,), 777, dtype=I64, device=DEVICE)
    gumbel_sample_ref(logits, seed_table[rows.long()], positions, t < 1e-5, want, t)
    assert (t < 1e-5).sum() == 2 and want[0] == logits[0].float().argmax()
    got = torch.full_like(want, 777)
    gumbel_sample_rows(logits, rows, seed_table, temps, positions, got, 1e-5)
    assert torch.equal(got, want)
    keys = torch.full((6,), -(2**31), device=DEVICE)  # no cut ...
    keys[0] = 2**31  # ... but row 0 keeps nothing
    got.fill_(777)
    gumbel_sample_rows(logits, rows, seed_table, temps, positions, got, 1e-5, keys)
    assert got[0] == 0 and torch.equal(got[1:], want[1:])  # (no other row's cut bites)
    with pytest.raises(ValueError, match=r"rows must be \[6\] int32/int64"):
        gumbel_sample_rows(logits, rows[:5], seed_table, temps, positions, got, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_threshold_in_kernel_equals_filtering_first(dtype: torch.dtype,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``threshold=`` (a top-k / top-p filter's order keys, after the temperature) gives
    exactly the tokens of sampling the filtered, divided logits; greedy rows are cut too."""
    from mrv2_kernels.top_k_top_p import top_k_top_p_keys, top_k_top_p_ref

    monkeypatch.setenv("MRV2_KERNELS", "triton")  # the keys from the kernels, on the CPU too
    logits, seeds, positions, greedy = make_inputs(seed=6, n=6, dtype=dtype)
    logits = logits.contiguous()
    g = torch.Generator().manual_seed(10)
    temperature = (torch.rand(6, generator=g) + 0.3).to(DEVICE)
    top_k = torch.tensor([5, 0, 40, 0, 1, 0], device=DEVICE)
    top_p = torch.tensor([1.0, 0.6, 0.9, 1.0, 0.5, 0.0], device=DEVICE)  # row 5 keeps nothing
    divisor = torch.where(greedy, 1.0, temperature)
    keys = top_k_top_p_keys(logits, top_k, top_p, divisor)
    filtered = top_k_top_p_ref(logits.float() / divisor[:, None], top_k, top_p)
    want = sample(gumbel_sample_ref, filtered, seeds, positions, greedy)
    assert keys[3] == -(2**31) and keys[5] == 2**31  # no filter / nothing kept
    for fn in (gumbel_sample_ref, gumbel_sample_cpu, gumbel_sample_triton):
        got = torch.full_like(want, 777)
        fn(logits, seeds, positions, greedy, got, temperature, keys)
        assert torch.equal(got, want), fn
    # the cut matters: sampling without it differs somewhere
    assert not torch.equal(sample(gumbel_sample_ref, logits.float() / divisor[:, None], seeds,
                                  positions, greedy), want)


@pytest.mark.parametrize(("block_v", "num_splits"), [(16, 1), (16, 3), (32, 100)])
def test_tiles_and_vocab_splits(block_v: int, num_splits: int) -> None:
    """Tile size and vocab splits (two-pass reduction) do not change the tokens."""
    logits, seeds, positions, greedy = make_inputs(seed=2, n=4, vocab=77)
    logits[3, :70] = float("-inf")  # only the last split has allowed tokens
    want = sample(gumbel_sample_ref, logits, seeds, positions, greedy)
    got = sample(
        gumbel_sample_triton,
        logits,
        seeds,
        positions,
        greedy,
        block_v=block_v,
        num_splits=num_splits,
    )
    assert torch.equal(got, want)


def test_greedy_ties_and_masked_rows() -> None:
    """Greedy == torch.argmax: ties (within and across tiles) go to the smallest index."""
    vocab = 300
    logits = torch.randn(5, vocab).clamp(max=2.0)
    logits[0, [250, 7, 130]] = 5.0  # tie across tiles -> 7
    logits[1, [40, 41, 99]] = 5.0  # tie inside one tile -> 40
    logits[2, :] = float("-inf")  # nothing allowed -> 0
    logits[3, :200] = float("-inf")  # only the last tiles allowed
    logits[4, 299] = 9.0  # the very last index
    logits = logits.to(DEVICE)
    greedy = torch.ones(5, dtype=torch.bool, device=DEVICE)
    seeds, positions = t64([1, 2, 3, 4, 5]), t64([9, 8, 7, 6, 5])
    want = torch.argmax(logits, dim=1)
    assert want.tolist()[:3] == [7, 40, 0] and int(want[4]) == 299
    for fn in (gumbel_sample_ref, gumbel_sample_triton):
        assert torch.equal(sample(fn, logits, seeds, positions, greedy), want)
    got = sample(gumbel_sample_triton, logits, seeds, positions, greedy, num_splits=3)
    assert torch.equal(got, want)  # splits of 128: ties across splits too
    # int32 flags work as well as bool
    got = sample(gumbel_sample_triton, logits, seeds, positions, greedy.to(torch.int32))
    assert torch.equal(got, want)


def test_batch_composition_invariance() -> None:
    """Same (seed, position, logits) -> same token whatever the batch order and neighbours."""
    logits, seeds, positions, greedy = make_inputs(seed=3, n=6, vocab=200)
    greedy[:] = False
    base = sample(gumbel_sample_triton, logits, seeds, positions, greedy)
    perm = torch.tensor([4, 0, 5, 2], device=DEVICE)
    other, oseeds, opos, ogreedy = make_inputs(seed=4, n=2, vocab=200)
    mixed = (
        torch.cat([logits[perm], other]),
        torch.cat([seeds[perm], oseeds]),
        torch.cat([positions[perm], opos]),
        torch.cat([greedy[perm], ogreedy]),
    )
    got = sample(gumbel_sample_triton, *mixed)
    assert torch.equal(got[:4], base[perm])
    assert torch.equal(sample(gumbel_sample_ref, *mixed), got)
    # A different position or seed changes the noise (and here, some token).
    shifted = sample(gumbel_sample_ref, logits, seeds, positions + 1, greedy)
    reseeded = sample(gumbel_sample_ref, logits, seeds + 1, positions, greedy)
    assert not torch.equal(shifted, base) and not torch.equal(reseeded, base)


def test_frequencies_match_softmax() -> None:
    """Chi-square: 2000 positions of one seeded request sample softmax(logits)."""
    vocab, draws = 8, 2000
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.25, float("-inf")])
    logits = row.expand(draws, vocab).contiguous().to(DEVICE)
    seeds = torch.full((draws,), 20240607, dtype=I64, device=DEVICE)
    positions = torch.arange(draws, dtype=I64, device=DEVICE) + 100
    greedy = torch.zeros(draws, dtype=torch.bool, device=DEVICE)
    tokens = sample(gumbel_sample_ref, logits, seeds, positions, greedy)
    counts = torch.bincount(tokens.cpu(), minlength=vocab).double()
    assert counts[7] == 0
    expected = torch.softmax(row.double(), 0)[:7] * draws
    chi2 = float(((counts[:7] - expected) ** 2 / expected).sum())
    assert chi2 < 30.0, (chi2, counts.tolist(), expected.tolist())  # 6 dof: p ~ 4e-5
    # The kernel draws the same tokens (a slice, to keep the interpreter fast).
    sub = slice(0, 12)
    got = sample(gumbel_sample_triton, logits[sub], seeds[sub], positions[sub], greedy[sub])
    assert torch.equal(got, tokens[sub])


def test_int64_row_offsets() -> None:
    """row * stride beyond int32 in the logits."""
    stride, vocab = 2**30 + 3, 50
    try:
        base = torch.empty(2 * stride + vocab, dtype=torch.float32, device=DEVICE)
    except (RuntimeError, MemoryError) as e:  # pragma: no cover - depends on the host
        pytest.skip(f"cannot reserve the sparse buffer: {e}")
    logits = base.as_strided((3, vocab), (stride, 1))
    g = torch.Generator().manual_seed(5)
    logits.copy_(torch.randn(3, vocab, generator=g).to(DEVICE))
    seeds, positions = t64([11, 12, 13]), t64([1, 2, 3])
    greedy = torch.tensor([False, True, False], device=DEVICE)
    want = sample(gumbel_sample_ref, logits, seeds, positions, greedy)
    assert torch.equal(sample(gumbel_sample_triton, logits, seeds, positions, greedy), want)


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    logits, seeds, positions, greedy = make_inputs(seed=6, n=3, vocab=64)
    want = sample(gumbel_sample_ref, logits, seeds, positions, greedy)
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    assert torch.equal(sample(gumbel_sample, logits, seeds, positions, greedy), want)
    monkeypatch.delenv("MRV2_KERNELS")
    assert torch.equal(sample(gumbel_sample, logits, seeds, positions, greedy), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_divide_rows_bit_identical(dtype: torch.dtype) -> None:
    """The Triton temperature pass gives torch's quotient bit for bit, strided rows included,
    and writes every element (the allocator's memory is poisoned first)."""
    from mrv2_kernels.gumbel import _divide_rows_kernel, divide_rows

    g = torch.Generator().manual_seed(5)
    base = (torch.randn(5, 300, generator=g) * 7).to(dtype).to(DEVICE)
    logits = base[:, :290]  # row stride 300
    divisor = torch.tensor([0.6, 1.0, 0.01, 1.7, 3.3], device=DEVICE)
    want = logits.float() / divisor[:, None]
    poison = torch.full((5, 290), float("nan"), device=DEVICE)
    _divide_rows_kernel[(5, 3)](logits, logits.stride(0), poison, poison.stride(0), 290,
                                divisor, BLOCK_V=128)
    assert torch.equal(poison, want)
    got = divide_rows(logits, divisor, block_v=64)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    with pytest.raises(ValueError, match="divisor must have shape"):
        divide_rows(logits, divisor[:4])
