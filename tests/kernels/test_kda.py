"""Kimi Delta Attention's form of the gated delta rule: the decay per key channel (``g``
``[T, Hv, K]``, ``S = diag(exp(g)) S`` before the delta update) in the token-serial op.
Triton (interpreted on CPU) against the torch reference over a varlen batch of decode and
prefill rows (a chunk continuing from a state, fresh rows over garbage, padding), raw gates
made inside the op, and the reference against HF transformers' Kimi-Linear recurrence."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

try:
    import mrv2_kernels  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from mrv2_kernels import chunk_delta_rule as cdr
from mrv2_kernels import linear_attention as la
from mrv2_kernels.linear_attention import gated_delta_rule_ref, gated_delta_rule_triton

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

sys.path.insert(0, str(Path(__file__).parent))
from state_batches import BF16, DEVICE, F32, make_batch, rand, randn  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

# (query length, start, state row): a prefill chunk continuing a state, padding aliasing a
# row, a decode, a fresh prefill over a garbage row, a second decode; rows 3 and 5 untouched
MIXED = [(5, 3, 2), (0, 0, 2), (1, 7, 0), (4, 0, 1), (1, 2, 4)]
NUM_ROWS = 6
UNTOUCHED = [3, 5]


@pytest.fixture
def poisoned(poison: Callable[[ModuleType], None]) -> None:
    poison(la)


def kda_inputs(hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, num_tokens: int,
               seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q/k/v, a per-channel log decay in [-2, -0.01] (channels decaying at very different
    rates), beta, a random state."""
    q = randn(num_tokens, hk, dk, dtype=dtype, seed=seed)
    k = randn(num_tokens, hk, dk, dtype=dtype, seed=seed + 1)
    v = randn(num_tokens, hv, dv, dtype=dtype, seed=seed + 2)
    g = -(rand(num_tokens, hv, dk, seed=seed + 3) * 2.0 + 0.01)
    beta = torch.sigmoid(randn(num_tokens, hv, seed=seed + 4)).to(dtype)
    state = randn(NUM_ROWS, hv, dk, dv, seed=seed + 5, scale=0.5)
    return q, k, v, g, beta, state


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == F32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-3)


@pytest.mark.parametrize("dtype,hk,hv,dk,dv,block_v", [
    (F32, 2, 2, 24, 20, 8),
    (BF16, 2, 2, 16, 16, None),
    (F32, 1, 2, 8, 12, 4),
])
def test_vector_gate_triton_matches_ref(dtype: torch.dtype, hk: int, hv: int, dk: int, dv: int,
                                        block_v: int | None, poisoned: None) -> None:
    batch = make_batch(MIXED, pad_tokens=2)
    q, k, v, g, beta, state0 = kda_inputs(hk, hv, dk, dv, dtype, batch.num_tokens)
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *batch.meta, dk ** -0.5)
    got = gated_delta_rule_triton(q, k, v, g, beta, got_state, *batch.meta, dk ** -0.5,
                                  block_v=block_v)
    close(got, want, dtype)
    assert not got.isnan().any()
    assert torch.equal(got[batch.real_tokens:], torch.zeros_like(got[batch.real_tokens:]))
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-5)
    assert torch.equal(got_state[UNTOUCHED], state0[UNTOUCHED])
    # the per-channel decay matters: one decay per head (the channels' mean) differs
    scalar_state = state0.clone()
    scalar = gated_delta_rule_ref(q, k, v, g.mean(-1), beta, scalar_state, *batch.meta,
                                  dk ** -0.5)
    assert not torch.allclose(scalar.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fn", [gated_delta_rule_triton, gated_delta_rule_ref])
def test_vector_gate_raw_gates(fn: Callable[..., torch.Tensor], poisoned: None) -> None:
    """``gate_params=(A_log [Hv], dt_bias [Hv, K])`` with the raw per-channel projection as
    ``g`` (a strided bf16 view, one softplus input past 20) and the raw ``b`` as ``beta``: the
    same as passing :func:`gates_from_logits`' results (HF's ``KimiLinearForgetGate``)."""
    hk, hv, dk, dv = 2, 2, 8, 8
    batch = make_batch([(4, 2, 0), (1, 3, 1), (3, 0, 2)], pad_tokens=1)
    t = batch.num_tokens
    q, k, v, _, _, state0 = kda_inputs(hk, hv, dk, dv, BF16, t, seed=20)
    raw = randn(t, hv * dk + hv, dtype=BF16, seed=21, scale=2.0)
    raw[0, 3] = 25.0
    a, b = raw[:, : hv * dk].view(t, hv, dk), raw[:, hv * dk:]
    a_log, dt_bias = randn(hv, seed=22, scale=0.5), randn(hv, dk, seed=23)
    g, beta = la.gates_from_logits(a, b, a_log, dt_bias)
    assert g.shape == (t, hv, dk)
    torch.testing.assert_close(
        g, -a_log.exp()[:, None] * torch.nn.functional.softplus(a.float() + dt_bias))
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *batch.meta, 0.3)
    got = fn(q, k, v, a, b, got_state, *batch.meta, 0.3, gate_params=(a_log, dt_bias))
    close(got, want, BF16)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"gate_params: dt_bias must have shape \(2, 8\)"):
        fn(q, k, v, a, b, got_state, *batch.meta, 0.3, gate_params=(a_log, dt_bias[:, 0]))


def test_vector_gate_ref_matches_hf() -> None:
    """Against transformers' ``recurrent_kimi_delta_attention`` (q/k l2-normed, scale ``K **
    -0.5``), per sequence: one continuing a state, one fresh."""
    hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    hk = hv = 2
    dk, dv = 12, 10
    seqs = [(4, 5, 1), (3, 0, 0)]
    batch = make_batch(seqs)
    q, k, v, g, beta, state0 = kda_inputs(hk, hv, dk, dv, F32, batch.num_tokens, seed=30)
    q, k, v, g, beta, state0 = (t.cpu() for t in (q, k, v, g, beta, state0))
    state = state0.clone()
    out = gated_delta_rule_ref(q, k, v, g, beta, state, batch.qsl.cpu(), batch.seq_lens.cpu(),
                               batch.rows.cpu(), dk ** -0.5)
    bos = 0
    for length, start, row in seqs:
        sl = slice(bos, bos + length)
        want, want_state = hf.recurrent_kimi_delta_attention(
            q[sl][None], k[sl][None], v[sl][None], g[sl][None], beta[sl][None],
            initial_state=state0[row][None] if start > 0 else None,
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[sl], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state[row], want_state[0], rtol=1e-5, atol=1e-6)
        bos += length


def test_vector_gate_auto_goes_chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`gated_delta_rule_auto` runs a per-channel ``g`` chunked where a long prompt
    does (it ran token-serial at every length before), with the reference's result; Mamba-2's
    ``dt_limits`` still refuse it in every form."""
    monkeypatch.setattr(cdr, "CHUNKED_MIN_QUERY_LEN_DELTA", 2)
    monkeypatch.delenv(cdr.CHUNKED_ENV_VAR, raising=False)
    chunked = cdr.chunk_gated_delta_rule
    calls: list[int] = []

    def spy(*args: object, **kw: object) -> torch.Tensor:
        calls.append(len(args))
        return chunked(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(cdr, "chunk_gated_delta_rule", spy)
    batch = make_batch([(6, 0, 0), (1, 4, 1)])
    q, k, v, g, beta, state0 = kda_inputs(1, 1, 8, 8, F32, batch.num_tokens, seed=40)
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *batch.meta, 0.5)
    got = cdr.gated_delta_rule_auto(q, k, v, g, beta, got_state, *batch.meta, 0.5,
                                    max_query_len=6)
    assert calls
    close(got, want, F32)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-5)
    for fn in (gated_delta_rule_ref, cdr.chunk_gated_delta_rule_ref,
               cdr.chunk_gated_delta_rule_triton):
        with pytest.raises(ValueError, match="per-channel"):
            fn(q, k, v, g, beta, got_state, *batch.meta, 0.5,
               gate_params=(torch.zeros(1, device=DEVICE), torch.zeros(1, 8, device=DEVICE)),
               dt_limits=(0.0, 1.0))
