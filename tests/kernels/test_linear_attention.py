"""Gated DeltaNet ops (causal conv1d, gated delta rule, the rule without its delta term as
Mamba-2's SSM): Triton (interpreted on CPU) against the torch reference, and the reference
against HF transformers, ``F.conv1d`` and the published Mamba-2 recurrence."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

try:
    import mrv2_kernels  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from mrv2_kernels import causal_conv1d as cc
from mrv2_kernels import linear_attention as la
from mrv2_kernels.linear_attention import (
    causal_conv1d,
    causal_conv1d_ref,
    causal_conv1d_triton,
    gated_delta_rule,
    gated_delta_rule_ref,
    gated_delta_rule_triton,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

sys.path.insert(0, str(Path(__file__).parent))
from state_batches import BF16, DEVICE, F32, Batch, make_batch, rand, randn  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

CPU_ONLY = pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU dispatch")
WIDTH = 4


@pytest.fixture
def poisoned(poison: Callable[[ModuleType], None]) -> None:
    poison(la)
    poison(cc)  # (the conv's outputs)


# (query length, start, state row). Rows 3 and 6 are in no sequence; row 1 holds garbage
# that a fresh sequence (start 0) must ignore; the padding sequences alias rows 2 and 0.
MIXED = [
    (5, 3, 2),  # prefill chunk continuing a state
    (0, 0, 2),  # padding aliasing row 2
    (1, 7, 0),  # decode
    (2, 4, 4),  # shorter than W - 1: the new conv state keeps part of the old one
    (3, 0, 1),  # new sequence over a garbage row
    (2, 0, 5),  # new and shorter than W - 1
    (0, 5, 0),  # padding aliasing row 0, with a "start" > 0
]
NUM_ROWS = 7
UNTOUCHED = [3, 6]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32 to rounding; bf16 within an ulp or so (the interpreter truncates to bf16)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == F32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-3)


# --------------------------------------------------------------------------- causal conv1d


def conv_inputs(dim: int, dtype: torch.dtype, batch: Batch, bias: bool, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    x = randn(batch.num_tokens, dim, dtype=dtype, seed=seed)
    weight = randn(dim, WIDTH, seed=seed + 1, scale=0.5)
    b = randn(dim, seed=seed + 2) if bias else None
    state = randn(NUM_ROWS, WIDTH - 1, dim, dtype=dtype, seed=seed + 3)
    return x, weight, b, state


@pytest.mark.parametrize("dtype,activation,bias", [
    (F32, "silu", True), (BF16, "silu", True), (F32, None, False),
])
def test_causal_conv1d_triton_matches_ref(dtype: torch.dtype, activation: str | None,
                                          bias: bool, poisoned: None) -> None:
    batch = make_batch(MIXED, pad_tokens=2)
    x, weight, b, state0 = conv_inputs(20, dtype, batch, bias)
    meta = (batch.qsl, batch.seq_lens, batch.rows)
    want_state = state0.clone()
    want = causal_conv1d_ref(x, weight, b, want_state, *meta, activation)
    got_state = state0.clone()
    got = causal_conv1d_triton(x, weight, b, got_state, *meta, activation, block_t=2, block_d=8)
    close(got, want, dtype)
    assert not got.isnan().any()
    assert torch.equal(got[batch.real_tokens:], torch.zeros_like(got[batch.real_tokens:]))
    assert torch.equal(got_state, want_state)  # copies of inputs: exact, every row
    assert torch.equal(got_state[UNTOUCHED], state0[UNTOUCHED])
    assert not torch.equal(want_state[1], state0[1])


def test_causal_conv1d_ref_matches_conv1d() -> None:
    """Each sequence against ``F.conv1d`` (``padding=W - 1`` truncated when fresh; over the
    stored context otherwise), and the new state against the last ``W - 1`` inputs."""
    seqs = [(5, 3, 0), (2, 4, 1), (3, 0, 2), (1, 0, 3)]
    batch = make_batch(seqs)
    dim = 6  # on the CPU: no TF32 in F.conv1d
    x = randn(batch.num_tokens, dim, seed=10).cpu()
    weight, bias = randn(dim, WIDTH, seed=11).cpu(), randn(dim, seed=12).cpu()
    state0 = randn(4, WIDTH - 1, dim, seed=13).cpu()
    state = state0.clone()
    out = causal_conv1d_ref(x, weight, bias, state, batch.qsl.cpu(), batch.seq_lens.cpu(),
                            batch.rows.cpu(), "silu")
    bos = 0
    for length, start, row in seqs:
        xs = x[bos:bos + length].T[None]  # [1, D, L]
        if start > 0:
            full = torch.cat([state0[row].T[None], xs], dim=-1)
            want = F.conv1d(full, weight[:, None, :], bias, groups=dim)
        else:
            full = torch.cat([torch.zeros(1, dim, WIDTH - 1), xs], dim=-1)
            want = F.conv1d(xs, weight[:, None, :], bias, padding=WIDTH - 1,
                            groups=dim)[..., :length]
        torch.testing.assert_close(out[bos:bos + length], F.silu(want[0].T))
        assert torch.equal(state[row], full[0].T[-(WIDTH - 1):])
        bos += length


@pytest.mark.parametrize("fn", [causal_conv1d_triton, causal_conv1d_ref])
def test_causal_conv1d_chunk_split(fn: Callable[..., torch.Tensor]) -> None:
    """A sequence run in chunks of 4, 1 and 2 tokens equals it run whole."""
    dim = 5
    x = randn(7, dim, seed=20)
    weight, bias = randn(dim, WIDTH, seed=21), randn(dim, seed=22)
    garbage = randn(1, WIDTH - 1, dim, seed=23)
    whole_state = garbage.clone()
    whole = fn(x, weight, bias, whole_state, *_meta([(7, 0, 0)]), "silu")
    state = garbage.clone()
    parts = []
    for bos, length in ((0, 4), (4, 1), (5, 2)):
        meta = _meta([(length, bos, 0)])
        parts.append(fn(x[bos:bos + length], weight, bias, state, *meta, "silu"))
    torch.testing.assert_close(torch.cat(parts), whole)
    assert torch.equal(state, whole_state)


def _meta(seqs: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return make_batch(seqs).meta


# ------------------------------------------------------------------------ gated delta rule


def gdr_inputs(hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, num_tokens: int,
               seed: int = 0, kscale: float = 1.0) -> tuple[torch.Tensor, ...]:
    q = randn(num_tokens, hk, dk, dtype=dtype, seed=seed)
    k = randn(num_tokens, hk, dk, dtype=dtype, seed=seed + 1, scale=kscale)
    v = randn(num_tokens, hv, dv, dtype=dtype, seed=seed + 2)
    g = -(rand(num_tokens, hv, seed=seed + 3) * 0.7 + 0.01)
    beta = torch.sigmoid(randn(num_tokens, hv, seed=seed + 4)).to(dtype)
    state = randn(NUM_ROWS, hv, dk, dv, seed=seed + 5, scale=0.5)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("dtype,hk,hv,dk,dv,block_v,l2norm", [
    (F32, 1, 2, 24, 20, 8, True),
    (BF16, 1, 2, 24, 20, 8, True),
    (F32, 2, 2, 16, 16, None, False),
])
def test_gated_delta_rule_triton_matches_ref(dtype: torch.dtype, hk: int, hv: int, dk: int,
                                             dv: int, block_v: int | None, l2norm: bool,
                                             poisoned: None) -> None:
    batch = make_batch(MIXED, pad_tokens=2)
    q, k, v, g, beta, state0 = gdr_inputs(hk, hv, dk, dv, dtype, batch.num_tokens,
                                          kscale=1.0 if l2norm else 0.2)
    meta = (batch.qsl, batch.seq_lens, batch.rows)
    scale = dk ** -0.5
    want_state = state0.clone()
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *meta, scale, l2norm)
    got_state = state0.clone()
    got = gated_delta_rule_triton(q, k, v, g, beta, got_state, *meta, scale, l2norm,
                                  block_v=block_v)
    close(got, want, dtype)
    assert not got.isnan().any()
    assert torch.equal(got[batch.real_tokens:], torch.zeros_like(got[batch.real_tokens:]))
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-5)
    assert torch.equal(got_state[UNTOUCHED], state0[UNTOUCHED])
    assert not torch.allclose(want_state[1], state0[1])


def test_gated_delta_rule_strided_views(poisoned: None) -> None:
    """q/k/v as slices of one fused [T, ...] tensor (the conv output), g/beta transposed."""
    hk, hv, dk, dv = 1, 2, 8, 8
    batch = make_batch([(3, 2, 0), (1, 0, 1)])
    t = batch.num_tokens
    fused = randn(t, 2 * hk * dk + hv * dv, seed=30)
    q = fused[:, :dk].view(t, hk, dk)
    k = fused[:, dk:2 * dk].view(t, hk, dk)
    v = fused[:, 2 * dk:].view(t, hv, dv)
    g = -(rand(hv, t, seed=31) + 0.1).T
    beta = torch.sigmoid(randn(hv, t, seed=32)).T
    state0 = randn(2, hv, dk, dv, seed=33)
    meta = (batch.qsl, batch.seq_lens, batch.rows)
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *meta, 0.5)
    got = gated_delta_rule_triton(q, k, v, g, beta, got_state, *meta, 0.5)
    close(got, want, F32)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fn", [gated_delta_rule_triton, gated_delta_rule_ref])
def test_gated_delta_rule_chunk_split(fn: Callable[..., torch.Tensor]) -> None:
    """A sequence run in chunks of 3, 1 and 2 tokens equals it run whole."""
    hk, hv, dk, dv = 1, 2, 8, 4
    q, k, v, g, beta, state0 = gdr_inputs(hk, hv, dk, dv, F32, 6, seed=40)
    garbage = state0[:1]
    whole_state = garbage.clone()
    whole = fn(q, k, v, g, beta, whole_state, *_meta([(6, 0, 0)]), dk ** -0.5)
    state = garbage.clone()
    parts = []
    for bos, length in ((0, 3), (3, 1), (4, 2)):
        sl = slice(bos, bos + length)
        meta = _meta([(length, bos, 0)])
        parts.append(fn(q[sl], k[sl], v[sl], g[sl], beta[sl], state, *meta, dk ** -0.5))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, whole_state, rtol=1e-5, atol=1e-6)


def test_gated_delta_rule_ref_matches_hf() -> None:
    """Against transformers' ``torch_recurrent_gated_delta_rule`` (q/k l2-normed in the kernel,
    scale ``K ** -0.5``), per sequence: one with an initial state, one fresh."""
    hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    hk, hv, dk, dv = 2, 4, 12, 10
    seqs = [(4, 5, 1), (3, 0, 0)]
    batch = make_batch(seqs)
    q, k, v, g, beta, state0 = gdr_inputs(hk, hv, dk, dv, F32, batch.num_tokens, seed=50)
    state = state0.clone()
    out = gated_delta_rule_ref(q, k, v, g, beta, state, batch.qsl, batch.seq_lens, batch.rows,
                               dk ** -0.5)
    bos = 0
    for length, start, row in seqs:
        sl = slice(bos, bos + length)
        qh, kh = (t[sl][None].repeat_interleave(hv // hk, dim=2) for t in (q, k))
        want, want_state = hf.torch_recurrent_gated_delta_rule(
            qh, kh, v[sl][None], g[sl][None], beta[sl][None],
            initial_state=state0[row][None] if start > 0 else None,
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[sl], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state[row], want_state[0], rtol=1e-5, atol=1e-6)
        bos += length


# ----------------------------------------------- without the delta term: Mamba-2's SSM


def mamba2_inputs(groups: int, heads: int, dstate: int, headdim: int, dtype: torch.dtype,
                  num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Mamba-2's operands in the rule's names: ``C`` (q), ``B`` (k) per group, ``x`` (v) per
    head, ``g = dt * A`` and ``beta = dt`` (``dt`` softplus-like, in (0.05, 1.5))."""
    c = randn(num_tokens, groups, dstate, dtype=dtype, seed=seed)
    b = randn(num_tokens, groups, dstate, dtype=dtype, seed=seed + 1)
    x = randn(num_tokens, heads, headdim, dtype=dtype, seed=seed + 2)
    dt = rand(num_tokens, heads, seed=seed + 3) * 1.45 + 0.05
    a = -(rand(heads, seed=seed + 4) * 3.0 + 0.5)
    state = randn(NUM_ROWS, heads, dstate, headdim, seed=seed + 5, scale=0.5)
    return c, b, x, dt * a, dt.to(dtype), state


@pytest.mark.parametrize("dtype,groups,heads,dstate,headdim,block_v", [
    (F32, 2, 4, 16, 8, None), (BF16, 2, 4, 16, 8, None), (F32, 1, 3, 24, 20, 8),
])
def test_gated_delta_rule_without_delta_triton_matches_ref(
        dtype: torch.dtype, groups: int, heads: int, dstate: int, headdim: int,
        block_v: int | None, poisoned: None) -> None:
    batch = make_batch(MIXED, pad_tokens=2)
    c, b, x, g, dt, state0 = mamba2_inputs(groups, heads, dstate, headdim, dtype,
                                           batch.num_tokens, seed=60)
    meta = (batch.qsl, batch.seq_lens, batch.rows)
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(c, b, x, g, dt, want_state, *meta, 1.0, False, delta=False)
    got = gated_delta_rule_triton(c, b, x, g, dt, got_state, *meta, 1.0, False, delta=False,
                                  block_v=block_v)
    close(got, want, dtype)
    assert torch.equal(got[batch.real_tokens:], torch.zeros_like(got[batch.real_tokens:]))
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-4)
    assert torch.equal(got_state[UNTOUCHED], state0[UNTOUCHED])
    with_delta = gated_delta_rule_ref(c, b, x, g, dt, state0.clone(), *meta, 1.0, False)
    assert not torch.allclose(with_delta.float(), want.float(), atol=1e-2)


def mamba2_plain(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 c: torch.Tensor, h0: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's selective SSM as published (Dao & Gu, 2024), token by token in fp32: per head
    ``h`` (state ``[headdim, dstate]``) and token ``t``, ``H = exp(dt A_h) H + dt x_t B_t^T``,
    ``y_t = H C_t``; head ``h`` reads B/C group ``h // (heads / groups)``. No ``D`` term."""
    length, heads, headdim = x.shape
    groups, dstate = b.shape[1:]
    hs = torch.zeros(heads, headdim, dstate) if h0 is None else h0.clone()
    ys = torch.zeros(length, heads, headdim)
    for t in range(length):
        for h in range(heads):
            grp = h // (heads // groups)
            decay = torch.exp(dt[t, h] * a[h])
            hs[h] = decay * hs[h] + dt[t, h] * torch.outer(x[t, h], b[t, grp])
            ys[t, h] = hs[h] @ c[t, grp]
    return ys, hs


def test_gated_delta_rule_without_delta_is_mamba2() -> None:
    """The reference with ``delta=False`` against the published per-token Mamba-2 recurrence,
    and that against HF's torch paths of Nemotron-H (``mamba2_chunk_scan``, chunked, several
    chunks; ``mamba2_selective_state_update``, one token): outputs and final states (HF's and
    the published state are ``[heads, headdim, dstate]``, the rule's ``[heads, dstate,
    headdim]``)."""
    hf = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    groups, heads, dstate, headdim = 2, 4, 6, 5
    seqs = [(7, 3, 1), (5, 0, 0)]
    batch = make_batch(seqs)
    c, b, x, _, dt, state0 = (t.cpu() for t in mamba2_inputs(groups, heads, dstate, headdim,
                                                              F32, batch.num_tokens, seed=70))
    a = -(torch.rand(heads, generator=torch.Generator().manual_seed(71)) * 3.0 + 0.5)
    state = state0.clone()
    out = gated_delta_rule_ref(c, b, x, dt * a, dt, state, batch.qsl.cpu(),
                               batch.seq_lens.cpu(), batch.rows.cpu(), 1.0, False, delta=False)
    bos = 0
    for length, start, row in seqs:
        sl = slice(bos, bos + length)
        h0 = state0[row].transpose(1, 2) if start > 0 else None
        want, want_state = mamba2_plain(x[sl], dt[sl], a, b[sl], c[sl], h0)
        torch.testing.assert_close(out[sl], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state[row].transpose(1, 2), want_state, rtol=1e-5, atol=1e-5)
        y, final = hf.mamba2_chunk_scan(
            x[sl][None], dt[sl][None], a, b[sl][None], c[sl][None], chunk_size=3,
            initial_states=None if h0 is None else h0[None], return_final_states=True)
        torch.testing.assert_close(y[0], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[0], want_state, rtol=1e-5, atol=1e-5)
        bos += length
    # one decode token from a stored state: HF's recurrent form (its dt per head and channel)
    h0 = state0[2].transpose(1, 2).contiguous()
    want, want_state = mamba2_plain(x[:1], dt[:1], a, b[:1], c[:1], h0)
    hf_state = h0[None].clone()
    y = hf.mamba2_selective_state_update(
        hf_state, x[:1], dt[:1, :, None].expand(-1, -1, headdim),
        a[:, None, None].expand(-1, headdim, dstate), b[:1], c[:1])
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hf_state[0], want_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", [gated_delta_rule_triton, gated_delta_rule_ref])
def test_gated_delta_rule_without_delta_chunk_split(fn: Callable[..., torch.Tensor]) -> None:
    """Mamba-2's recurrence run in chunks of 3, 1 and 2 tokens equals it run whole."""
    c, b, x, g, dt, state0 = mamba2_inputs(1, 2, 8, 4, F32, 6, seed=80)
    whole_state = state0[:1].clone()
    whole = fn(c, b, x, g, dt, whole_state, *_meta([(6, 0, 0)]), 1.0, False, delta=False)
    state = state0[:1].clone()
    parts = []
    for bos, length in ((0, 3), (3, 1), (4, 2)):
        sl = slice(bos, bos + length)
        parts.append(fn(c[sl], b[sl], x[sl], g[sl], dt[sl], state, *_meta([(length, bos, 0)]),
                        1.0, False, delta=False))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, whole_state, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ dispatch, checks


@CPU_ONLY
def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    meta = _meta([(2, 1, 0)])
    x, weight, b, cstate = conv_inputs(4, F32, make_batch([(2, 1, 0)]), True)
    q, k, v, g, beta, state = gdr_inputs(1, 1, 4, 4, F32, 2)
    monkeypatch.delenv("MRV2_KERNELS", raising=False)
    c1, s1 = cstate.clone(), state.clone()
    conv = causal_conv1d(x, weight, b, c1, *meta, "silu")
    out = gated_delta_rule(q, k, v, g, beta, s1, *meta, 0.5)
    c2, s2 = cstate.clone(), state.clone()
    assert torch.equal(conv, causal_conv1d_ref(x, weight, b, c2, *meta, "silu"))
    assert torch.equal(out, gated_delta_rule_ref(q, k, v, g, beta, s2, *meta, 0.5))
    assert torch.equal(c1, c2) and torch.equal(s1, s2)
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    c3, s3 = cstate.clone(), state.clone()
    close(causal_conv1d(x, weight, b, c3, *meta, "silu"), conv, F32)
    close(gated_delta_rule(q, k, v, g, beta, s3, *meta, 0.5), out, F32)
    assert torch.equal(c3, c1)
    torch.testing.assert_close(s3, s1, rtol=1e-4, atol=1e-5)


def test_rejects_bad_arguments() -> None:
    meta = _meta([(2, 0, 0)])
    x, weight, b, cstate = conv_inputs(4, F32, make_batch([(2, 0, 0)]), True)
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_triton(x, weight, b, cstate[:, :2], *meta)
    with pytest.raises(TypeError, match="conv_state"):
        causal_conv1d_triton(x, weight, b, cstate.to(BF16), *meta)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_triton(x, weight, b, cstate, *meta, "gelu")
    q, k, v, g, beta, state = gdr_inputs(2, 3, 4, 4, F32, 2)
    with pytest.raises(ValueError, match="multiple"):
        gated_delta_rule_triton(q, k, v, g, beta, state, *meta, 0.5)
    q, k, v, g, beta, state = gdr_inputs(1, 1, 300, 4, F32, 2)
    with pytest.raises(ValueError, match="at most"):
        gated_delta_rule_triton(q, k, v, g, beta, state, *meta, 0.5)
    with pytest.raises(TypeError, match="fp32"):
        gated_delta_rule_triton(q, k, v, g, beta, state.to(BF16), *meta, 0.5)
    with pytest.raises(ValueError, match="seq_lens"):
        gated_delta_rule_triton(q, k, v, g, beta, state, meta[0], meta[1][:0], meta[2], 0.5)


@pytest.mark.parametrize("fn", [gated_delta_rule_triton, gated_delta_rule_ref])
def test_gated_delta_rule_raw_gates(fn: Callable[..., torch.Tensor], poisoned: None) -> None:
    """``gate_params=(A_log, dt_bias)``: ``g`` and ``beta`` given as the projections' raw
    strided values (one ``[b | a]`` row each), turned into the decay and write strength inside
    the op: the same as passing :func:`gates_from_logits`' results (a ``> 20`` softplus input
    included: its linear branch)."""
    hk, hv, dk, dv = 1, 2, 8, 8
    batch = make_batch([(4, 2, 0), (1, 0, 1)], pad_tokens=1)
    t = batch.num_tokens
    q, k, v, _, _, state0 = gdr_inputs(hk, hv, dk, dv, BF16, t, seed=50)
    ba = randn(t, 2 * hv, dtype=BF16, seed=51, scale=2.0)
    ba[0, hv] = 25.0
    a_log, dt_bias = randn(hv, seed=52, scale=0.5), randn(hv, seed=53)
    meta = (batch.qsl, batch.seq_lens, batch.rows)
    g, beta = la.gates_from_logits(ba[:, hv:], ba[:, :hv], a_log, dt_bias)
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *meta, 0.3)
    got = fn(q, k, v, ba[:, hv:], ba[:, :hv], got_state, *meta, 0.3,
             gate_params=(a_log, dt_bias))
    close(got, want, BF16)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"gate_params: A_log must have shape \(2,\)"):
        fn(q, k, v, ba[:, hv:], ba[:, :hv], got_state, *meta, 0.3,
           gate_params=(a_log[:1], dt_bias))


@pytest.mark.parametrize("fn", [gated_delta_rule_triton, gated_delta_rule_ref])
def test_gated_delta_rule_mamba_gates_and_skip(fn: Callable[..., torch.Tensor],
                                               poisoned: None) -> None:
    """Mamba-2's form inside the op: the raw ``dt`` (``g`` and ``beta`` alike) made ``clamp(
    softplus(dt + dt_bias))`` (both clamp ends biting), ``g = -exp(A_log) dt``, ``beta = dt``,
    and ``o += D x`` with bf16 ``x`` and an fp32 output: the same as the plain op on
    :func:`mamba_gates`' results plus the skip in fp32."""
    groups, heads, dstate, headdim = 1, 2, 8, 4
    batch = make_batch([(3, 1, 0), (2, 0, 1)], pad_tokens=1)
    t = batch.num_tokens
    c, b = randn(t, groups, dstate, seed=60), randn(t, groups, dstate, seed=61)
    x = randn(t, heads, headdim, dtype=BF16, seed=62)
    dt = randn(t, heads, seed=63, scale=2.0)
    a_log, dt_bias = randn(heads, seed=64, scale=0.3), randn(heads, seed=65)
    d = randn(heads, seed=66)
    state0 = randn(NUM_ROWS, heads, dstate, headdim, seed=67)
    meta = (batch.qsl, batch.seq_lens, batch.rows)
    limits = (0.3, 1.5)
    g, beta = la.mamba_gates(dt, a_log, dt_bias, limits)
    assert (beta == 0.3).any() and (beta == 1.5).any()
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(c, b, x.float(), g, beta, want_state, *meta, 1.0, False,
                                delta=False)
    want[: batch.real_tokens] += d[:, None] * x[: batch.real_tokens].float()
    got = fn(c, b, x, dt, dt, got_state, *meta, 1.0, False, delta=False,
             gate_params=(a_log, dt_bias), dt_limits=limits, skip=d, out_dtype=F32)
    assert got.dtype == F32
    close(got, want, F32)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-5)
