"""The Mamba-1 selective scan: Triton (interpreted on CPU) against the torch reference on
varlen batches (a decode row, prefill rows, a chunk continuing from state, padding; prefix
caching's snapshots and resumed states; speculative decoding's row slots), and the reference
against HF transformers' ``mamba_selective_scan``."""

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

from mrv2_kernels import selective_scan as ss
from mrv2_kernels.recurrent_state import default_state_table
from mrv2_kernels.selective_scan import selective_scan_ref, selective_scan_triton

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

sys.path.insert(0, str(Path(__file__).parent))
from state_batches import BF16, DEVICE, F32, I32, make_batch, rand, randn  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

#: (query length, start, state row): a prefill chunk continuing a state, padding aliasing a
#: row, a decode row, a fresh prefill over a garbage row, a one-token fresh sequence, padding
#: with a "start" > 0. Rows 3 and 6 belong to no sequence.
MIXED = [(5, 3, 2), (0, 0, 2), (1, 7, 0), (6, 0, 1), (1, 0, 5), (0, 5, 0)]
NUM_ROWS, UNTOUCHED = 7, [3, 6]
DIM, DSTATE = 40, 16  # (40 channels: a partial channel block)


@pytest.fixture
def poisoned(poison: Callable[[ModuleType], None]) -> None:
    poison(ss)


def inputs(num_tokens: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Token inputs as the mixer passes them: ``B`` / ``C`` / ``dt`` row-strided slices of one
    projection, ``z`` a slice of another."""
    proj = randn(num_tokens, 2 * DSTATE + DIM + 3, dtype=dtype, seed=seed)
    xz = randn(num_tokens, 2 * DIM, dtype=dtype, seed=seed + 1)
    return {
        "x": xz[:, :DIM], "z": xz[:, DIM:],
        "dt": proj[:, :DIM], "b": proj[:, DIM:DIM + DSTATE],
        "c": proj[:, DIM + DSTATE:DIM + 2 * DSTATE],
        "a_log": (rand(DIM, DSTATE, seed=seed + 2) * 2.0 - 1.0),
        "d_skip": randn(DIM, seed=seed + 3), "dt_bias": randn(DIM, seed=seed + 4) - 1.0,
    }


def tokens(args: dict[str, torch.Tensor], sl: slice) -> dict[str, torch.Tensor]:
    """``args`` with the per-token inputs cut to the tokens ``sl``."""
    return {k: v[sl] if k in ("x", "z", "dt", "b", "c") else v for k, v in args.items()}


def run(fn: Callable[..., torch.Tensor], args: dict[str, torch.Tensor], state: torch.Tensor,
        meta: tuple[torch.Tensor, ...], **kwargs: object) -> torch.Tensor:
    return fn(args["x"], args["dt"], args["a_log"], args["b"], args["c"], args["d_skip"],
              args["z"], args["dt_bias"], state, *meta, **kwargs)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if dtype == F32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=2e-3)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("gated", [True, False])
def test_triton_matches_ref(dtype: torch.dtype, gated: bool, poisoned: None) -> None:
    """Mixed batch (module constant) with padding tokens: outputs (zero on padding) and the
    states written; rows of no sequence untouched."""
    batch = make_batch(MIXED, pad_tokens=3)
    args = inputs(batch.num_tokens, dtype)
    if not gated:
        args = {**args, "z": None, "d_skip": None, "dt_bias": None}  # type: ignore[dict-item]
    init = randn(NUM_ROWS, DIM, DSTATE, seed=9)
    want_state, got_state = init.clone(), init.clone()
    want = run(selective_scan_ref, args, want_state, batch.meta)
    got = run(selective_scan_triton, args, got_state, batch.meta, block_d=16)
    close(got, want, dtype)
    assert torch.all(got[batch.real_tokens:] == 0)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-5)
    for row in UNTOUCHED:
        assert torch.equal(got_state[row], init[row])
    assert not torch.equal(want_state[1], init[1])  # (the fresh sequence wrote its row)


@pytest.mark.parametrize("fn", [selective_scan_triton, selective_scan_ref])
def test_chunk_split(fn: Callable[..., torch.Tensor]) -> None:
    """A sequence run as a prefill of 4 tokens, a decode token and a chunk of 3 equals it run
    whole (from a garbage row: the first chunk starts from zeros)."""
    args = inputs(8, F32, seed=3)
    garbage = randn(1, DIM, DSTATE, seed=4)
    whole_state = garbage.clone()
    whole = run(fn, args, whole_state, make_batch([(8, 0, 0)]).meta)
    state, parts = garbage.clone(), []
    for bos, length in ((0, 4), (4, 1), (5, 3)):
        parts.append(run(fn, tokens(args, slice(bos, bos + length)), state,
                         make_batch([(length, bos, 0)]).meta))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, whole_state, rtol=1e-5, atol=1e-6)


def test_snapshots_and_resume_triton_matches_ref(poisoned: None) -> None:
    """A ``state_table``: sequence 0 (row 2) snapshots the states after 4 and 6 of its tokens
    into rows 5 and 6; sequence 1 (row 1) resumes at position 4 from row 3. Triton and the
    reference agree, and the snapshot after 4 tokens is what a whole run leaves after 4."""
    batch = make_batch([(5, 3, 2), (2, 4, 1), (1, 9, 0)])
    args = inputs(batch.num_tokens, F32, seed=7)
    table = default_state_table(4, DEVICE)
    table[2] = torch.tensor([2, -1, 4, 5, 6, 6], dtype=I32)
    table[1] = torch.tensor([3, 4, -1, 0, -1, 0], dtype=I32)
    init = randn(7, DIM, DSTATE, seed=8)
    want_state, got_state = init.clone(), init.clone()
    want = run(selective_scan_ref, args, want_state, batch.meta, state_table=table)
    got = run(selective_scan_triton, args, got_state, batch.meta, state_table=table)
    close(got, want, F32)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-5)
    # the resumed sequence read row 3, not its own row 1
    plain_state = init.clone()
    plain = run(selective_scan_ref, args, plain_state, batch.meta)
    assert not torch.allclose(plain[5:7], want[5:7])
    # the snapshot after 4 tokens: sequence 0 run as its first token alone
    one_state = init.clone()
    run(selective_scan_ref, tokens(args, slice(0, 1)), one_state, make_batch([(1, 3, 2)]).meta)
    torch.testing.assert_close(want_state[5], one_state[2])


def test_row_slots_triton_matches_ref(poisoned: None) -> None:
    """Speculative decoding's layout (3 rows a sequence): a verify chunk of 3 tokens and a
    prefill of 4 keep the states after each of their last 3 tokens."""
    batch = make_batch([(3, 5, 1), (4, 0, 0)])
    args = inputs(batch.num_tokens, F32, seed=11)
    init = randn(6, DIM, DSTATE, seed=12)
    want_state, got_state = init.clone(), init.clone()
    want = run(selective_scan_ref, args, want_state, batch.meta, row_slots=3)
    got = run(selective_scan_triton, args, got_state, batch.meta, row_slots=3)
    close(got, want, F32)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-5)


def test_ref_matches_hf() -> None:
    """One sequence from zeros: HF's ``mamba_selective_scan`` (its torch recurrence, batch of
    one, channels first) gives the same outputs and final state."""
    hf = pytest.importorskip("transformers.models.mamba.modeling_mamba")
    args = inputs(9, F32, seed=13)
    state = torch.zeros(1, DIM, DSTATE, device=DEVICE)
    got = run(selective_scan_ref, args, state, make_batch([(9, 0, 0)]).meta)
    scan = getattr(hf.mamba_selective_scan, "__wrapped__", hf.mamba_selective_scan)
    want, last = scan(
        args["x"].T[None].cpu(), args["dt"].T[None].cpu(), -args["a_log"].exp().cpu(),
        args["b"].T[None].cpu(), args["c"].T[None].cpu(), D=args["d_skip"].cpu(),
        z=args["z"].T[None].cpu(), delta_bias=args["dt_bias"].cpu(), delta_softplus=True,
        return_last_state=True, use_associative_scan=False)
    torch.testing.assert_close(got.cpu(), want[0].T, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state[0].cpu(), last[0], rtol=1e-4, atol=1e-5)


def test_rejects_bad_arguments() -> None:
    batch = make_batch([(2, 0, 0)])
    args = inputs(2, F32)
    with pytest.raises(ValueError, match=r"state must be \[R, 40, 16\]"):
        run(selective_scan_ref, args, torch.zeros(1, DIM, 8, device=DEVICE), batch.meta)
    with pytest.raises(TypeError, match="state must be fp32"):
        run(selective_scan_triton, args, torch.zeros(1, DIM, DSTATE, dtype=BF16,
                                                     device=DEVICE), batch.meta)
    with pytest.raises(ValueError, match=r"B must have shape \(2, 16\)"):
        run(selective_scan_ref, {**args, "b": args["b"][:, :8]},
            torch.zeros(1, DIM, DSTATE, device=DEVICE), batch.meta)
