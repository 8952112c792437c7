"""The chunked gated delta rule (``mrv2_kernels.chunk_delta_rule``): the Triton kernels
(interpreted on CPU) and the chunked torch reference against the token-serial reference
``linear_attention.gated_delta_rule_ref``, over varlen batches whose sequences span less than
a chunk, exactly one, several plus a remainder, padding sequences and padding tokens; with the
token-serial op's keywords (``state_table`` snapshots and resumes, raw GDN / Mamba-2 gates,
``skip``, ``out_dtype``) against that reference given the same ones."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

try:
    import mrv2_kernels  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from mrv2_kernels import chunk_delta_rule as cdr
from mrv2_kernels import linear_attention as la
from mrv2_kernels.chunk_delta_rule import (
    CHUNKED_MIN_QUERY_LEN,
    CHUNKED_MIN_QUERY_LEN_DELTA,
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_ref,
    chunk_gated_delta_rule_triton,
    gated_delta_rule_auto,
    prefer_chunked,
    scan_warps_for,
)
from mrv2_kernels.linear_attention import default_state_table, gated_delta_rule_ref

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

sys.path.insert(0, str(Path(__file__).parent))
from state_batches import BF16, DEVICE, F32, I32, make_batch, rand, randn  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

CPU_ONLY = pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU dispatch")


@pytest.fixture
def poisoned(poison: Callable[[ModuleType], None]) -> None:
    poison(cdr)


# (query length, start, state row), for the CPU chunk of 16. Rows 3 and 6 are in no sequence;
# row 1 holds garbage a fresh sequence must ignore; the padding sequences alias rows 2 and 0.
MIXED = [
    (37, 5, 2),  # two chunks and 5 tokens, continuing a state
    (0, 0, 2),  # padding aliasing row 2
    (5, 0, 1),  # less than a chunk, fresh over a garbage row
    (16, 0, 4),  # exactly one chunk
    (1, 9, 0),  # decode
    (20, 3, 5),  # a chunk and 4 tokens, continuing
    (0, 4, 0),  # padding aliasing row 0, with a "start" > 0
]
NUM_ROWS = 7
UNTOUCHED = [3, 6]
PAD_TOKENS = 3


def gdr_inputs(hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, num_tokens: int,
               seed: int = 0, kscale: float = 1.0) -> tuple[torch.Tensor, ...]:
    q = randn(num_tokens, hk, dk, dtype=dtype, seed=seed)
    k = randn(num_tokens, hk, dk, dtype=dtype, seed=seed + 1, scale=kscale)
    v = randn(num_tokens, hv, dv, dtype=dtype, seed=seed + 2)
    g = -(rand(num_tokens, hv, seed=seed + 3) * 0.7 + 0.01)
    beta = torch.sigmoid(randn(num_tokens, hv, seed=seed + 4)).to(dtype)
    state = randn(NUM_ROWS, hv, dk, dv, seed=seed + 5, scale=0.5)
    return q, k, v, g, beta, state


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype = F32) -> None:
    """fp32 to rounding; bf16 outputs within an ulp or so."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == F32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-3)


def state_tol(dtype: torch.dtype) -> dict[str, float]:
    """The final states' tolerance: fp32's rounding, but for 16-bit inputs on the GPU, whose
    products take one TF32 product there (chunk_gated_delta_rule_triton's rule; ~1e-3 off the
    fp32 recurrence after a few dozen tokens, the outputs still within their bf16 ulp)."""
    if DEVICE == "cuda" and dtype != F32:
        return {"rtol": 3e-2, "atol": 5e-3}
    return {"rtol": 1e-4, "atol": 2e-5}


def tiles(kw: dict[str, int]) -> dict[str, Any]:
    """Tile overrides as given on the CPU; on the GPU, the products' tiles at least 16 and
    chunks of 16 unless given (MIXED's lengths are for those)."""
    if DEVICE == "cpu":
        return kw
    return {"chunk": 16, **{name: value if name in ("block_sub", "serial_below")
                            else max(value, 16) for name, value in kw.items()}}


def check_against_serial(fn: Callable[..., torch.Tensor], dtype: torch.dtype, hk: int, hv: int,
                         dk: int, dv: int, l2norm: bool, delta: bool, seed: int = 0,
                         **kw: Any) -> None:
    """``fn`` on the MIXED batch against the token-serial reference: outputs (zeros on the
    padding tokens), every state row (those outside the batch unchanged)."""
    batch = make_batch(MIXED, pad_tokens=PAD_TOKENS)
    q, k, v, g, beta, state0 = gdr_inputs(hk, hv, dk, dv, dtype, batch.num_tokens, seed=seed,
                                          kscale=1.0 if l2norm else 0.2)
    scale = dk ** -0.5 if delta else 1.0
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *batch.meta, scale, l2norm,
                                delta=delta)
    got = fn(q, k, v, g, beta, got_state, *batch.meta, scale, l2norm, delta=delta, **kw)
    close(got, want, dtype)
    assert not got.isnan().any()
    assert torch.equal(got[batch.real_tokens:], torch.zeros_like(got[batch.real_tokens:]))
    torch.testing.assert_close(got_state, want_state, **state_tol(dtype))
    assert torch.equal(got_state[UNTOUCHED], state0[UNTOUCHED])
    assert not torch.allclose(want_state[1], state0[1])


# ------------------------------------------------------------------------------ reference


@pytest.mark.parametrize("chunk,delta,l2norm", [
    (16, True, True), (4, True, False), (64, True, True), (16, False, False), (3, False, True),
])
def test_ref_matches_token_serial(chunk: int, delta: bool, l2norm: bool) -> None:
    """The chunked torch reference against the token-serial one (a chunk of 64: every
    sequence in one partial chunk)."""
    check_against_serial(lambda *a, **kw: chunk_gated_delta_rule_ref(*a, **kw, chunk=chunk),
                         F32, 2, 4, 12, 10, l2norm, delta, seed=1)


def test_ref_hard_cases() -> None:
    """Repeated keys (``I + A`` far from the identity), no decay and near-total decay: the
    triangular solve and the masked decays stay exact, nothing overflows."""
    batch = make_batch([(40, 0, 0), (19, 2, 1)])
    q, k, v, g, beta, state0 = gdr_inputs(1, 2, 8, 8, F32, batch.num_tokens, seed=2)
    k[:, :] = k[:1]  # one key for every token
    beta = torch.full_like(beta, 0.98)
    g[:20] = 0.0
    g[20:] = -30.0 * rand(batch.num_tokens - 20, 2, seed=3)
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *batch.meta, 0.3)
    got = chunk_gated_delta_rule_ref(q, k, v, g, beta, got_state, *batch.meta, 0.3, chunk=16)
    close(got, want)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=2e-5)


# --------------------------------------------------------------------------------- Triton


@pytest.mark.parametrize("dtype,hk,hv,dk,dv,l2norm,kw", [
    (F32, 1, 2, 24, 20, True, {"block_v": 8, "block_k": 8}),  # GQA, odd K / V, 3 K / V blocks
    (BF16, 1, 2, 16, 16, True, {}),
    (F32, 2, 2, 16, 12, False, {"chunk": 32, "block_sub": 8}),  # 4 sub-blocks
    (F32, 1, 2, 8, 8, True, {"serial_below": 17}),  # 5 and 1 tokens (and 16) token-serial
    (F32, 1, 1, 8, 8, True, {"block_sub": 16}),  # one sub-block
])
def test_triton_matches_token_serial(dtype: torch.dtype, hk: int, hv: int, dk: int, dv: int,
                                     l2norm: bool, kw: dict[str, int], poisoned: None) -> None:
    check_against_serial(chunk_gated_delta_rule_triton, dtype, hk, hv, dk, dv, l2norm, True,
                         **tiles(kw))


@pytest.mark.parametrize("chunk,block_sub", [(64, 16), (32, 8)])
def test_triton_slow_decay_series(chunk: int, block_sub: int, poisoned: None) -> None:
    """A chunk of 61 tokens (of 64; of 32, and 29 after it) whose decays barely fade (``g``
    near 0): the inverse's blocks far below the diagonal matter, so both factors of the series
    ``(I - N)(I + N^2)`` do (4 diagonal blocks)."""
    batch = make_batch([(61, 0, 0)])
    q, k, v, _, beta, state0 = gdr_inputs(1, 2, 16, 8, F32, batch.num_tokens, seed=95)
    g = -(rand(batch.num_tokens, 2, seed=96) * 0.02 + 0.001)
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *batch.meta, 0.25)
    got = chunk_gated_delta_rule_triton(q, k, v, g, beta, got_state, *batch.meta, 0.25,
                                        chunk=chunk, block_sub=block_sub)
    close(got, want)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("serial_below", [0, 100])
def test_strided_gate_params_and_skip(serial_below: int, poisoned: None) -> None:
    """``A_log``, ``dt_bias`` and ``skip`` as strided views (columns of wider tensors), in the
    chunked kernels and, with ``serial_below``, in the token-serial one the short sequences
    take: the reference's results (the token-serial kernel read them at ``[h]``)."""
    batch = make_batch([(4, 0, 0), (8, 2, 1)])
    q, k, v, _, _, state0 = gdr_inputs(1, 2, 8, 8, F32, batch.num_tokens, seed=97)
    ab = randn(batch.num_tokens, 4, seed=98)
    a_log, dt_bias, skip = (randn(2, 2, seed=s)[:, 0] for s in (99, 100, 101))
    assert a_log.stride(0) == 2
    kw: dict[str, Any] = {"gate_params": (a_log, dt_bias), "skip": skip}
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(q, k, v, ab[:, :2], ab[:, 2:], want_state, *batch.meta, 0.3,
                                **kw)
    got = chunk_gated_delta_rule_triton(q, k, v, ab[:, :2], ab[:, 2:], got_state, *batch.meta,
                                        0.3, serial_below=serial_below, **kw)
    close(got, want)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("dtype,kw", [(F32, {"block_v": 8, "block_k": 4}), (BF16, {"chunk": 32})])
def test_triton_without_delta_matches_token_serial(dtype: torch.dtype, kw: dict[str, int],
                                                   poisoned: None) -> None:
    """Mamba-2's form (``delta=False``: no WY kernel), GQA (2 B/C groups over 4 heads)."""
    check_against_serial(chunk_gated_delta_rule_triton, dtype, 2, 4, 16, 12, False, False,
                         seed=3, **tiles(kw))


def test_triton_hard_cases(poisoned: None) -> None:
    """Repeated keys, no decay and near-total decay (as :func:`test_ref_hard_cases`)."""
    batch = make_batch([(40, 0, 0), (19, 2, 1)], pad_tokens=1)
    q, k, v, g, beta, state0 = gdr_inputs(1, 2, 8, 8, F32, batch.num_tokens, seed=2)
    k[:, :] = k[:1]
    beta = torch.full_like(beta, 0.98)
    g[:20] = 0.0
    g[20:] = -30.0 * rand(batch.num_tokens - 20, 2, seed=3)
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *batch.meta, 0.3)
    got = chunk_gated_delta_rule_triton(q, k, v, g, beta, got_state, *batch.meta, 0.3,
                                        **tiles({"block_sub": 4}))
    close(got, want)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=2e-5)


def test_triton_strided_views(poisoned: None) -> None:
    """q/k/v as slices of one fused [T, ...] tensor (the conv output), g/beta transposed."""
    hk, hv, dk, dv = 1, 2, 8, 8
    batch = make_batch([(19, 2, 0), (3, 0, 1)])
    t = batch.num_tokens
    fused = randn(t, 2 * hk * dk + hv * dv, seed=30)
    q = fused[:, :dk].view(t, hk, dk)
    k = fused[:, dk:2 * dk].view(t, hk, dk)
    v = fused[:, 2 * dk:].view(t, hv, dv)
    g = -(rand(hv, t, seed=31) + 0.1).T
    beta = torch.sigmoid(randn(hv, t, seed=32)).T
    state0 = randn(2, hv, dk, dv, seed=33)
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *batch.meta, 0.5)
    got = chunk_gated_delta_rule_triton(q, k, v, g, beta, got_state, *batch.meta, 0.5)
    close(got, want)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fn", [chunk_gated_delta_rule_triton, chunk_gated_delta_rule_ref])
@pytest.mark.parametrize("delta", [True, False])
def test_chunk_split(fn: Callable[..., torch.Tensor], delta: bool) -> None:
    """A 40-token sequence run in pieces of 7, 17 and 16 tokens (chunks no longer aligned to
    the whole run's) equals it run whole, from a garbage row."""
    q, k, v, g, beta, state0 = gdr_inputs(1, 2, 8, 4, F32, 40, seed=40)
    whole_state = state0[:1].clone()
    whole = fn(q, k, v, g, beta, whole_state, *make_batch([(40, 0, 0)]).meta, 0.4, delta=delta)
    state = state0[:1].clone()
    parts = []
    for bos, length in ((0, 7), (7, 17), (24, 16)):
        sl = slice(bos, bos + length)
        meta = make_batch([(length, bos, 0)]).meta
        parts.append(fn(q[sl], k[sl], v[sl], g[sl], beta[sl], state, *meta, 0.4, delta=delta))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, whole_state, rtol=1e-4, atol=1e-5)


def test_all_padding(poisoned: None) -> None:
    """No sequences with tokens (only padding ones): zeros out, no row touched."""
    batch = make_batch([(0, 3, 1), (0, 0, 0)], pad_tokens=5)
    q, k, v, g, beta, state0 = gdr_inputs(1, 1, 8, 8, F32, batch.num_tokens)
    state = state0.clone()
    out = chunk_gated_delta_rule_triton(q, k, v, g, beta, state, *batch.meta, 0.5)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(state, state0)


# --------------------------------------------------- state_table, raw gates, skip, out_dtype


def run_fn(fn: str) -> Callable[..., torch.Tensor]:
    """The chunked op under test, in chunks of 8 (GPU: 16): ``"triton"`` or ``"ref"``."""
    if fn == "triton":
        chunk = 8 if DEVICE == "cpu" else 16
        return lambda *a, **kw: chunk_gated_delta_rule_triton(*a, **kw, chunk=chunk)
    return lambda *a, **kw: chunk_gated_delta_rule_ref(*a, **kw, chunk=8)


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 as its bit patterns (NaN rows compare equal to themselves)."""
    return t.view(torch.int32)


# (query length, start, state row) for chunks of 8, with their state_table rows (src_row,
# src_pos, snap_pos0, snap_row0, snap_pos1, snap_row1). Rows 0-3: requests (3 holds NaN: its
# request resumes from row 14); 4: a padding sequence's; 5: in nothing; 8-13, 15: snapshots
# stored; 14: the resumed request's source (read, never written); 16, 17: snapshot rows no
# chunk covers; 18: NaN, a source whose position is not its request's start.
SNAP_SEQS = [
    (21, 0, 0),  # fresh, 3 chunks: snapshots inside chunk 0 (3) and after chunk 1's first (9)
    (30, 5, 1),  # continuing: two in its chunk 1 (14, 18); resuming at 6 from row 18: not here
    (0, 2, 4),  # padding: its entry asks for a resume and snapshots; it does neither
    (45, 0, 2),  # 6 chunks: snapshots in the last but one (43) and at the last token (45)
    (19, 8, 3),  # resumes at 8 from row 14 over NaN: snapshots at its chunk 0's last token
]  # (16) and at its start (8: not covered, stores nothing)
SNAP_TABLE = {
    0: (0, -1, 3, 8, 9, 9),
    1: (18, 6, 14, 10, 18, 11),
    4: (14, 2, 2, 16, 3, 17),
    2: (2, -1, 43, 12, 45, 13),
    3: (14, 8, 16, 15, 8, 16),
}
SNAP_ROWS = 19
SNAP_WRITTEN = [8, 9, 10, 11, 12, 13, 15]
SNAP_UNTOUCHED = [4, 5, 14, 16, 17, 18]


@pytest.mark.parametrize("fn,delta,dtype", [
    ("triton", True, F32), ("triton", False, F32), ("triton", True, BF16), ("ref", True, F32),
    ("ref", False, F32),
])
def test_state_table_matches_token_serial(fn: str, delta: bool, dtype: torch.dtype,
                                          poisoned: None) -> None:
    """Snapshots inside a chunk, after a chunk's first token, two in one chunk, in a late
    chunk of a long sequence, at a chunk's last token and at a sequence's last; a request
    resuming from a snapshot row over a NaN row of its own (the source row unchanged); a
    source position that is not the request's start (its NaN row unread); a padding sequence
    and snapshot positions no chunk covers (nothing stored): against the token-serial
    reference with the same table."""
    batch = make_batch(SNAP_SEQS, pad_tokens=2)
    l2norm = delta
    q, k, v, g, beta, _ = gdr_inputs(1, 2, 8, 8, dtype, batch.num_tokens, seed=70,
                                     kscale=1.0 if l2norm else 0.3)
    state0 = randn(SNAP_ROWS, 2, 8, 8, seed=71, scale=0.5)
    state0[[3, 18]] = float("nan")
    tbl = default_state_table(SNAP_ROWS, DEVICE)
    for row, entry in SNAP_TABLE.items():
        tbl[row] = torch.tensor(entry, dtype=I32)
    scale = 8 ** -0.5 if delta else 1.0
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *batch.meta, scale, l2norm,
                                delta=delta, state_table=tbl)
    got = run_fn(fn)(q, k, v, g, beta, got_state, *batch.meta, scale, l2norm, delta=delta,
                     state_table=tbl)
    close(got, want, dtype)
    assert torch.equal(got[batch.real_tokens:], torch.zeros_like(got[batch.real_tokens:]))
    torch.testing.assert_close(got_state, want_state, equal_nan=True, **state_tol(dtype))
    assert not got_state[:4].isnan().any()
    assert torch.equal(bits(got_state[SNAP_UNTOUCHED]), bits(state0[SNAP_UNTOUCHED]))
    assert not torch.isclose(want_state[SNAP_WRITTEN], state0[SNAP_WRITTEN]).all(-1).any()


@pytest.mark.parametrize("fn", ["triton", "ref"])
def test_raw_gates(fn: str, poisoned: None) -> None:
    """``gate_params=(A_log, dt_bias)``: ``g`` and ``beta`` the projections' raw strided
    values (one ``[b | a]`` row a token; a ``> 20`` softplus input: its linear branch), turned
    into gates inside, over partial chunks (whose dead rows must add no decay)."""
    hk, hv, dk, dv = 1, 2, 8, 8
    batch = make_batch([(21, 3, 0), (0, 0, 1), (13, 0, 1)], pad_tokens=1)
    t = batch.num_tokens
    q, k, v, _, _, state0 = gdr_inputs(hk, hv, dk, dv, BF16, t, seed=50)
    ba = randn(t, 2 * hv, dtype=BF16, seed=51, scale=2.0)
    ba[0, hv] = 25.0
    a_log, dt_bias = randn(hv, seed=52, scale=0.5) - 1.0, randn(hv, seed=53)
    raw = (q, k, v, ba[:, hv:], ba[:, :hv])
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(*raw, want_state, *batch.meta, 0.3,
                                gate_params=(a_log, dt_bias))
    got = run_fn(fn)(*raw, got_state, *batch.meta, 0.3, gate_params=(a_log, dt_bias))
    close(got, want, BF16)
    assert torch.equal(got[batch.real_tokens:], torch.zeros_like(got[batch.real_tokens:]))
    torch.testing.assert_close(got_state, want_state, **state_tol(BF16))


@pytest.mark.parametrize("fn", ["triton", "ref"])
def test_mamba_gates_and_skip(fn: str, poisoned: None) -> None:
    """Mamba-2's form: the raw ``dt`` (``g`` and ``beta`` alike) made ``clamp(softplus(dt +
    dt_bias))`` with both clamp ends biting, ``o += D x``, bf16 ``x`` and an fp32 output."""
    groups, heads, dstate, headdim = 1, 2, 8, 4
    batch = make_batch([(19, 1, 0), (0, 0, 0), (10, 0, 1)], pad_tokens=1)
    t = batch.num_tokens
    c, b = randn(t, groups, dstate, seed=60, scale=0.5), randn(t, groups, dstate, seed=61)
    x = randn(t, heads, headdim, dtype=BF16, seed=62)
    dt = randn(t, heads, seed=63, scale=2.0)
    a_log, dt_bias = randn(heads, seed=64, scale=0.3), randn(heads, seed=65)
    d = randn(heads, seed=66)
    state0 = randn(NUM_ROWS, heads, dstate, headdim, seed=67)
    limits = (0.3, 1.5)
    _, step = la.mamba_gates(dt[: batch.real_tokens], a_log, dt_bias, limits)
    assert (step == 0.3).any() and (step == 1.5).any()
    kw: dict[str, Any] = {"delta": False, "gate_params": (a_log, dt_bias),
                          "dt_limits": limits, "skip": d, "out_dtype": F32}
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(c, b, x, dt, dt, want_state, *batch.meta, 1.0, False, **kw)
    got = run_fn(fn)(c, b, x, dt, dt, got_state, *batch.meta, 1.0, False, **kw)
    assert got.dtype == F32
    close(got, want)
    assert torch.equal(got[batch.real_tokens:], torch.zeros_like(got[batch.real_tokens:]))
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("max_query_len", [1, CHUNKED_MIN_QUERY_LEN])
def test_auto_takes_every_keyword(monkeypatch: pytest.MonkeyPatch, max_query_len: int,
                                  poison: Callable[[ModuleType], None]) -> None:
    """:func:`gated_delta_rule_auto` on the Triton path, token-serial or chunked (GPU chunks
    of 64), with every keyword at once (a snapshot, a resume, raw GDN gates, a skip on the
    delta rule, an fp32 output from bf16): the token-serial reference's results."""
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    # (the delta rule takes the chunked form from the short threshold too)
    monkeypatch.setattr(cdr, "CHUNKED_MIN_QUERY_LEN_DELTA", CHUNKED_MIN_QUERY_LEN)
    poison(cdr)
    poison(la)
    batch = make_batch([(35, 4, 0), (1, 7, 1)], pad_tokens=1)
    t, hv = batch.num_tokens, 2
    q, k, v, _, _, state0 = gdr_inputs(1, hv, 8, 8, BF16, t, seed=80)
    ba = randn(t, 2 * hv, seed=81)
    state0 = randn(4, hv, 8, 8, seed=82, scale=0.5)
    state0[0] = float("nan")
    tbl = default_state_table(4, DEVICE)
    tbl[0] = torch.tensor((2, 4, 22, 3, -1, 0), dtype=I32)  # resume from row 2, snapshot to 3
    kw: dict[str, Any] = {"state_table": tbl, "gate_params": (randn(hv, seed=83) - 1.0,
                                                              randn(hv, seed=84)),
                          "skip": randn(hv, seed=85), "out_dtype": F32}
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(q, k, v, ba[:, hv:], ba[:, :hv], want_state, *batch.meta, 0.3,
                                **kw)
    got = gated_delta_rule_auto(q, k, v, ba[:, hv:], ba[:, :hv], got_state, *batch.meta, 0.3,
                                max_query_len=max_query_len, **kw)
    assert got.dtype == F32
    close(got, want)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=2e-5)
    assert torch.equal(got_state[2], state0[2])


# ------------------------------------------------------------------------ dispatch, checks


@pytest.mark.parametrize("env,delta,max_query_len,chunked", [
    (None, True, CHUNKED_MIN_QUERY_LEN_DELTA - 1, False),
    (None, True, CHUNKED_MIN_QUERY_LEN_DELTA, True),
    (None, False, CHUNKED_MIN_QUERY_LEN, True),
    ("0", True, CHUNKED_MIN_QUERY_LEN_DELTA, False),
    ("0", False, CHUNKED_MIN_QUERY_LEN, False),
])
def test_auto_dispatch_by_form(monkeypatch: pytest.MonkeyPatch, env: str | None, delta: bool,
                               max_query_len: int, chunked: bool) -> None:
    """A long query takes the chunked form: Mamba-2's rule (``delta=False``) from
    :data:`CHUNKED_MIN_QUERY_LEN` tokens, the delta rule from its own, longer
    :data:`CHUNKED_MIN_QUERY_LEN_DELTA`; ``MRV2_CHUNKED_DELTA_RULE=0`` keeps everything
    token-serial."""
    if env is None:
        monkeypatch.delenv(cdr.CHUNKED_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(cdr.CHUNKED_ENV_VAR, env)
    called: list[str] = []
    monkeypatch.setattr(cdr, "chunk_gated_delta_rule",
                        lambda *a, **k: called.append("chunked"))
    monkeypatch.setattr(cdr, "_serial_gated_delta_rule",
                        lambda *a, **k: called.append("serial"))
    batch = make_batch([(max_query_len, 0, 0)])
    q, k, v, g, beta, state = gdr_inputs(1, 2, 8, 8, F32, batch.num_tokens, seed=90)
    gated_delta_rule_auto(q, k, v, g, beta, state, *batch.meta, 0.3, delta=delta,
                          max_query_len=max_query_len)
    assert called == ["chunked" if chunked else "serial"]


@CPU_ONLY
def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    batch = make_batch([(5, 1, 0)])
    q, k, v, g, beta, state = gdr_inputs(1, 1, 4, 4, F32, 5)
    monkeypatch.delenv("MRV2_KERNELS", raising=False)
    s1, s2, s3 = state.clone(), state.clone(), state.clone()
    out = chunk_gated_delta_rule(q, k, v, g, beta, s1, *batch.meta, 0.5)
    assert torch.equal(out, chunk_gated_delta_rule_ref(q, k, v, g, beta, s2, *batch.meta, 0.5))
    assert torch.equal(s1, s2)
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    close(chunk_gated_delta_rule(q, k, v, g, beta, s3, *batch.meta, 0.5), out)
    torch.testing.assert_close(s3, s1, rtol=1e-4, atol=1e-5)


def test_prefer_chunked() -> None:
    """Decode and speculative decode stay token-serial; a prompt of the threshold's length
    goes chunked (with ``max_query_len``, also among many decodes)."""
    m = CHUNKED_MIN_QUERY_LEN
    assert not prefer_chunked(256, 256, 1)
    assert not prefer_chunked(256 * 4, 256, 4)
    assert not prefer_chunked(256 * 4, 256)  # the mean: 4
    assert not prefer_chunked(m - 1, 1)
    assert prefer_chunked(m, 1)
    assert prefer_chunked(m + 100, 101, m)  # one prompt among 100 decodes
    assert not prefer_chunked(m + 100, 101)  # the same by the mean
    assert not prefer_chunked(8, 2, 512)  # a bound past the tokens: the tokens bound it


@pytest.mark.parametrize("max_query_len,chunked", [(1, False), (CHUNKED_MIN_QUERY_LEN, True)])
def test_auto_dispatch(monkeypatch: pytest.MonkeyPatch, max_query_len: int, chunked: bool
                       ) -> None:
    calls: list[str] = []

    def spy(name: str) -> Callable[..., torch.Tensor]:
        def fn(*args: Any, **kw: Any) -> torch.Tensor:
            calls.append(name)
            # the chunked form keeps a step's short sequences token-serial
            assert kw.pop("serial_below", None) == (cdr.CHUNKED_SERIAL_BELOW
                                                    if name == "chunked" else None)
            return gated_delta_rule_ref(*args, **kw)
        return fn

    monkeypatch.setattr(cdr, "chunk_gated_delta_rule", spy("chunked"))
    monkeypatch.setattr(cdr, "_serial_gated_delta_rule", spy("serial"))
    n = CHUNKED_MIN_QUERY_LEN
    q, k, v, g, beta, state = gdr_inputs(1, 1, 4, 4, F32, n)
    gated_delta_rule_auto(q, k, v, g, beta, state, *make_batch([(n, 0, 0)]).meta, 0.5,
                          delta=False, max_query_len=max_query_len)  # (Mamba-2's: by default)
    assert calls == ["chunked" if chunked else "serial"]


def test_rejects_bad_arguments() -> None:
    batch = make_batch([(2, 0, 0)])
    q, k, v, g, beta, state = gdr_inputs(1, 1, 8, 4, F32, 2)
    with pytest.raises(ValueError, match="divide"):
        chunk_gated_delta_rule_triton(q, k, v, g, beta, state, *batch.meta, 0.5, chunk=8,
                                      block_sub=16)
    with pytest.raises(ValueError, match="power of two"):
        chunk_gated_delta_rule_triton(q, k, v, g, beta, state, *batch.meta, 0.5, chunk=24)
    with pytest.raises(ValueError, match="at most 4"):
        chunk_gated_delta_rule_triton(q, k, v, g, beta, state, *batch.meta, 0.5, chunk=64,
                                      block_sub=8)
    if DEVICE == "cuda":  # the launch Triton 3.6 faults on (compute-sanitizer, an H100)
        with pytest.raises(ValueError, match="faults"):
            chunk_gated_delta_rule_triton(q, k, v, g, beta, state, *batch.meta, 0.5, block_v=16,
                                          scan_warps=8)
    with pytest.raises(TypeError, match="fp32"):
        chunk_gated_delta_rule_triton(q, k, v, g, beta, state.to(BF16), *batch.meta, 0.5)
    with pytest.raises(ValueError, match="chunk"):
        chunk_gated_delta_rule_ref(q, k, v, g, beta, state, *batch.meta, 0.5, chunk=0)
    one = torch.ones(1, device=DEVICE)
    for fn in (chunk_gated_delta_rule_triton, chunk_gated_delta_rule_ref):
        with pytest.raises(ValueError, match="skip must have shape"):
            fn(q, k, v, g, beta, state, *batch.meta, 0.5, skip=torch.ones(2, device=DEVICE))
        with pytest.raises(ValueError, match="needs gate_params"):
            fn(q, k, v, g, beta, state, *batch.meta, 0.5, dt_limits=(0.1, 1.0))
        with pytest.raises(ValueError, match="dt_bias must have shape"):
            fn(q, k, v, g, beta, state, *batch.meta, 0.5, gate_params=(one, one[:0]))
        with pytest.raises(ValueError, match="state_table must be"):
            fn(q, k, v, g, beta, state, *batch.meta, 0.5,
               state_table=torch.zeros(1, 5, dtype=I32, device=DEVICE))
        # a column slice of a wider table: the token-serial kernels address rows of 6 ints
        wide = torch.zeros(2, 8, dtype=I32, device=DEVICE)
        with pytest.raises(TypeError, match="contiguous int32"):
            fn(q, k, v, g, beta, state, *batch.meta, 0.5, state_table=wide[:, :6])
    q, k, v, g, beta, state = gdr_inputs(1, 1, 300, 4, F32, 2)
    with pytest.raises(ValueError, match="at most"):
        chunk_gated_delta_rule_triton(q, k, v, g, beta, state, *batch.meta, 0.5)


# The GPU defaults of chunk_gated_delta_rule_triton at K = V = 128 (Qwen3-Next's heads): the
# plain builds and those with every option (a table, raw gates, speculative decoding's rows;
# Mamba-2's with a skip).
_SM90_SCRIPT = r"""
from mrv2_kernels import chunk_delta_rule_kernels as m

bf, f32, i32 = "*bf16", "*fp32", "*i32"
gates = {"a_log_ptr": f32, "dt_bias_ptr": f32}
for raw in (False, True):
    build(m._chunk_wy_kernel,
          {"k_ptr": bf, "v_ptr": bf, "g_ptr": f32, "beta_ptr": bf, "wk_ptr": f32,
           "wv_ptr": f32, "t_ptr": f32, "qsl_ptr": i32, **gates},
          dict(L2NORM=True, CHUNK=64, SUB=16, LOG2_BLOCKS=2, BLOCK_K=32, BLOCK_V=64,
               REQ_BLOCK=64, PREC="tf32", RAW_GATES=raw, MAMBA_GATES=False, PDL=True),
          num_warps=8)
for delta, extras in ((True, False), (False, False), (True, True), (False, True)):
    build(m._chunk_state_kernel,
          {"k_ptr": bf, "v_ptr": bf, "g_ptr": f32, "beta_ptr": bf, "wk_ptr": f32,
           "u_ptr": f32, "h_ptr": f32, "state_ptr": f32, "out_ptr": f32 if extras else bf,
           "qsl_ptr": i32, "seq_lens_ptr": i32, "rows_ptr": i32, "tbl_ptr": i32, **gates},
          dict(L2NORM=delta, DELTA=delta, CHUNK=64, BLOCK_KF=128, BLOCK_V=32, BLOCK_T=8,
               PREC="tf32", HAS_TABLE=extras, RAW_GATES=extras,
               MAMBA_GATES=extras and not delta, ROW_SLOTS=4 if extras else 1, PDL=True),
          num_warps=4, num_stages=2)
    build(m._chunk_out_kernel,
          {"q_ptr": bf, "k_ptr": bf, "v_ptr": bf, "g_ptr": f32, "beta_ptr": bf, "u_ptr": f32,
           "h_ptr": f32, "out_ptr": f32 if extras else bf, "qsl_ptr": i32, "skip_ptr": f32,
           **gates},
          dict(L2NORM=delta, DELTA=delta, CHUNK=64, BLOCK_K=32, BLOCK_V=64, REQ_BLOCK=64,
               PREC="tf32", RAW_GATES=extras, MAMBA_GATES=extras and not delta,
               HAS_SKIP=extras and not delta, PDL=True),
          num_warps=4)
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU run compiles it for real")
def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    """Both kernels compiled for an H100/H200 (no GPU needed) at the GPU tiles: what only the
    compiler rejects fails here, and shared memory stays far from the 227 KB limit (the first
    build, ``[C, K]`` operand tiles, needed 246 KB: it could not have launched)."""
    from sm90 import compile_for_sm90

    built = compile_for_sm90(_SM90_SCRIPT, tmp_path)
    assert len(built["_chunk_wy_kernel"]) == 2 and len(built["_chunk_state_kernel"]) == 4
    assert len(built["_chunk_out_kernel"]) == 4
    for name, sizes in built.items():
        assert all(0 < size <= 115712 for size in sizes), (name, sizes)


def test_gpu_default_scan_launch_is_never_the_refused_one() -> None:
    """The GPU's default scan warps for every state block the defaults pick (16 where V <=
    16: the forty-fourth session's CUDA run refused the tests' own small-V defaults, 8 warps
    then)."""
    assert scan_warps_for(16, on_gpu=True) == 4
    assert scan_warps_for(32, on_gpu=True) == 4
    assert scan_warps_for(16, on_gpu=False) == 1
    assert scan_warps_for(16, on_gpu=True, scan_warps=2) == 2
    with pytest.raises(ValueError, match="faults"):
        scan_warps_for(16, on_gpu=True, scan_warps=8)
