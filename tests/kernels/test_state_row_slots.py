"""The linear-attention ops' ``row_slots`` (speculative decoding over per-request state): a
verify step keeps the state after each of a sequence's last ``S`` tokens in the sequence's own
``S`` rows, and the next step, starting at the accepted count, reads the state after the last
accepted token. Checked against runs that never saw the rejected tokens (the ops with one row a
sequence), for the causal conv and the gated delta rule with and without its delta term, Triton
(interpreted on CPU) and the reference; and Triton against the reference row by row."""

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

from mrv2_kernels import causal_conv1d as cc
from mrv2_kernels import linear_attention as la
from mrv2_kernels.chunk_delta_rule import (
    chunk_gated_delta_rule_ref,
    chunk_gated_delta_rule_triton,
    gated_delta_rule_auto,
)
from mrv2_kernels.linear_attention import (
    causal_conv1d_ref,
    causal_conv1d_triton,
    default_state_table,
    gated_delta_rule_ref,
    gated_delta_rule_triton,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

sys.path.insert(0, str(Path(__file__).parent))
from state_batches import DEVICE, I32, make_batch, randn  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

WIDTH = 4
SLOTS = 4  # 1 + 3 drafts
HK, HV, DK, DV, DIM = 1, 2, 8, 6, 5
KINDS = ["conv", "gdr", "ssm"]
CHUNK = 4 if DEVICE == "cpu" else 16  # the chunked form's tokens a chunk


@pytest.fixture
def poisoned(poison: Callable[[ModuleType], None]) -> None:
    poison(la)
    poison(cc)  # (the conv's outputs)


class Stream:
    """One op's inputs for a token stream of ``tokens`` positions (token ``p`` of a sequence
    is input row ``p``), run a chunk at a time."""

    def __init__(self, kind: str, tokens: int, seed: int = 0) -> None:
        self.kind = kind
        if kind == "conv":
            self.x = randn(tokens, DIM, seed=seed + 1)
            self.w, self.b = randn(DIM, WIDTH, seed=2, scale=0.5), randn(DIM, seed=3)
        else:
            self.q = randn(tokens, HK, DK, seed=seed + 5)
            self.k = randn(tokens, HK, DK, seed=seed + 6)
            self.v = randn(tokens, HV, DV, seed=seed + 7)
            self.g = -(randn(tokens, HV, seed=seed + 8).abs() * 0.3 + 0.01)
            self.beta = torch.sigmoid(randn(tokens, HV, seed=seed + 9))

    def state(self, rows: int, seed: int = 11) -> torch.Tensor:
        if self.kind == "conv":
            return randn(rows, WIDTH - 1, DIM, seed=seed)
        return randn(rows, HV, DK, DV, seed=seed, scale=0.5)

    def run(self, fn: str, idx: torch.Tensor, state: torch.Tensor,
            m: tuple[torch.Tensor, ...], slots: int,
            tbl: torch.Tensor | None = None) -> torch.Tensor:
        """The op over input rows ``idx`` (the step's tokens, in batch order)."""
        triton = fn == "triton"
        if self.kind == "conv":
            conv = causal_conv1d_triton if triton else causal_conv1d_ref
            return conv(self.x[idx], self.w, self.b, state, *m, "silu", tbl, slots)
        # the chunked form in chunks of 4 tokens: kept states in several chunks, the first's
        # (tl.dot's tiles on the GPU: chunks of 16, these sequences' one chunk)
        extra: dict[str, int] = {"chunk": CHUNK}
        if fn == "chunked":
            gdr: Callable[..., torch.Tensor] = chunk_gated_delta_rule_triton
            extra["block_sub"] = min(CHUNK, 8) // 2
        elif fn == "chunked_ref":
            gdr = chunk_gated_delta_rule_ref
        else:
            gdr, extra = (gated_delta_rule_triton if triton else gated_delta_rule_ref), {}
        return gdr(self.q[idx], self.k[idx], self.v[idx], self.g[idx], self.beta[idx], state,
                   *m, DK ** -0.5, True, delta=self.kind == "gdr", state_table=tbl,
                   row_slots=slots, **extra)


def tokens_of(seqs: list[tuple[int, int]], base: list[int]) -> torch.Tensor:
    """Input rows of a step: sequence ``i``'s ``(start, length)`` chunk of its own stream,
    whose positions begin at input row ``base[i]``."""
    idx = [base[i] + p for i, (start, n) in enumerate(seqs) for p in range(start, start + n)]
    return torch.tensor(idx, dtype=torch.long, device=DEVICE)


@pytest.mark.parametrize("kind,fn", [(kind, fn) for kind in KINDS for fn in (
    ["triton", "ref"] + (["chunked", "chunked_ref"] if kind != "conv" else []))])
def test_rejected_tokens_leave_no_trace(kind: str, fn: str, poisoned: None) -> None:
    """Four steps of three sequences: a prompt chunk, then verify steps of 1 + 3 tokens with
    0 to 3 accepted; each step's outputs and the final state equal a run (one row a sequence)
    that only ever saw the accepted tokens. ``chunked``: the delta rule's chunked form (chunks
    of 4: kept states in a later chunk than the first, and in the first, where one may be the
    initial state's own row)."""
    stream = Stream(kind, 3 * 32)
    base = [0, 32, 64]
    rows = [2, 0, 1]  # request rows; the speculative run's states are rows r * SLOTS + j
    spec = stream.state(3 * SLOTS, seed=12)
    plain = stream.state(3, seed=13)
    # (start, query length, tokens kept) per sequence and step: step 0 is a prompt chunk of
    # 7 / 2 / 5 tokens, steps 1-2 verify 1 + 3 (or fewer) tokens and keep the verified token
    # and the accepted drafts, step 3 mixes a decode, a verify and a long chunk.
    steps = [
        [(0, 7, 7), (0, 2, 2), (0, 5, 5)],
        [(7, 4, 3), (2, 4, 1), (5, 4, 4)],
        [(10, 4, 4), (3, 2, 2), (9, 3, 1)],
        [(14, 1, 1), (5, 4, 2), (10, 9, 9)],
    ]
    for step in steps:
        seqs = [(start, n) for start, n, _ in step]
        kept = [(start, k) for start, _, k in step]
        m = make_batch([(n, start, row) for (start, n), row in zip(seqs, rows, strict=True)]).meta
        out = stream.run(fn, tokens_of(seqs, base), spec, m, SLOTS)
        mk = make_batch([(k, start, i) for i, (start, k) in enumerate(kept)]).meta
        ref = stream.run("ref", tokens_of(kept, base), plain, mk, 1)
        # the kept tokens' outputs (a rejected draft's output is never used)
        q0, r0 = 0, 0
        for (_, n), (_, k) in zip(seqs, kept, strict=True):
            torch.testing.assert_close(out[q0:q0 + k].float(), ref[r0:r0 + k].float(),
                                       rtol=2e-5, atol=2e-5)
            q0, r0 = q0 + n, r0 + k
    # the last step: (14, 1) kept 1 -> 15; (5, 4) kept 2 -> 7; (10, 9) kept 9 -> 19
    for i, (row, count) in enumerate(zip(rows, [15, 7, 19], strict=True)):
        torch.testing.assert_close(spec[row * SLOTS + count % SLOTS], plain[i], rtol=2e-5,
                                   atol=2e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_triton_matches_ref_row_by_row(kind: str, poisoned: None) -> None:
    """One step of a verify (4 tokens), a short verify (2), a decode, a new prompt (6), a
    sequence resuming from a snapshot slot (table) and padding: every state row, including the
    rows no one should touch, equal between Triton and the reference; the snapshot slot
    unchanged."""
    stream = Stream(kind, 40)
    seqs = [(4, 9, 3), (2, 6, 0), (1, 13, 4), (6, 0, 1), (3, 8, 2), (0, 0, 0)]
    m = make_batch(seqs, pad_tokens=2).meta
    idx = torch.arange(sum(n for n, _, _ in seqs) + 2, device=DEVICE)
    slots_base = 5 * SLOTS  # two snapshot slots after five requests' rows
    tbl = default_state_table(5, DEVICE)
    tbl[2] = torch.tensor([slots_base + 1, 8, -1, 0, -1, 0], dtype=I32)  # resume at 8
    states = {}
    outs = {}
    for fn in ("triton", "ref"):
        state = stream.state(slots_base + 2, seed=21)
        outs[fn] = stream.run(fn, idx, state, m, SLOTS, tbl)
        states[fn] = state
    torch.testing.assert_close(outs["triton"].float(), outs["ref"].float(), rtol=2e-5,
                               atol=2e-5)
    torch.testing.assert_close(states["triton"], states["ref"], rtol=2e-5, atol=2e-5)
    untouched = stream.state(slots_base + 2, seed=21)
    torch.testing.assert_close(states["triton"][slots_base:], untouched[slots_base:])
    # a 4-token chunk at start 9 keeps counts 10..13 -> rows 3*4 + {2, 3, 0, 1}: all written;
    # a 1-token decode at 13 keeps only count 14 -> row 4*4 + 2, the other three untouched
    changed = (states["ref"] != untouched).flatten(1).any(1).tolist()
    assert all(changed[3 * SLOTS:4 * SLOTS])
    assert changed[4 * SLOTS:5 * SLOTS] == [False, False, True, False]


@pytest.mark.parametrize("kind", ["gdr", "ssm"])
def test_chunked_matches_token_serial_row_by_row(kind: str, poisoned: None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunked form (chunks of 4) against the token-serial reference on one step of
    verifies, a decode, prompts of 6 and 9 tokens and a resumed snapshot: outputs and every
    state row alike (the kept states, the untouched rows); ``gated_delta_rule_auto`` takes the
    chunked form for a long query with the rows."""
    stream = Stream(kind, 48)
    # (6, 5, 0): its first chunk keeps the state after 4 tokens in the initial state's own row
    seqs = [(4, 9, 3), (6, 5, 0), (1, 13, 4), (6, 0, 1), (9, 8, 2), (0, 0, 0)]
    m = make_batch(seqs, pad_tokens=2).meta
    idx = torch.arange(sum(n for n, _, _ in seqs) + 2, device=DEVICE)
    slots_base = 5 * SLOTS
    tbl = default_state_table(5, DEVICE)
    tbl[2] = torch.tensor([slots_base + 1, 8, -1, 0, -1, 0], dtype=I32)
    outs, states = {}, {}
    for fn in ("chunked", "ref"):
        states[fn] = stream.state(slots_base + 2, seed=21)
        outs[fn] = stream.run(fn, idx, states[fn], m, SLOTS, tbl)
    torch.testing.assert_close(outs["chunked"].float(), outs["ref"].float(), rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(states["chunked"], states["ref"], rtol=1e-4, atol=1e-4)
    from mrv2_kernels import chunk_delta_rule as cdr

    calls: list[int] = []
    chunked = cdr.chunk_gated_delta_rule

    def record(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs["row_slots"])
        return chunked(*args, **kwargs)

    monkeypatch.setattr(cdr, "chunk_gated_delta_rule", record)
    monkeypatch.setattr(cdr, "CHUNKED_MIN_QUERY_LEN", 4)
    monkeypatch.setattr(cdr, "CHUNKED_MIN_QUERY_LEN_DELTA", 4)
    monkeypatch.setattr(cdr, "CHUNKED_SERIAL_BELOW", 0)  # (every sequence through the chunks)
    state = stream.state(slots_base + 2, seed=21)
    out = gated_delta_rule_auto(stream.q[idx], stream.k[idx], stream.v[idx], stream.g[idx],
                                stream.beta[idx], state, *m, DK ** -0.5, True,
                                delta=kind == "gdr", state_table=tbl, max_query_len=9,
                                row_slots=SLOTS)
    assert calls == [SLOTS]
    torch.testing.assert_close(out.float(), outs["ref"].float(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, states["ref"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("slots", [0, 18, 2.0])
def test_bad_row_slots_refused(slots: object) -> None:
    stream = Stream("conv", 4)
    m = make_batch([(4, 0, 0)]).meta
    with pytest.raises(ValueError, match="row_slots must be an int in 1..17"):
        stream.run("ref", torch.arange(4, device=DEVICE), stream.state(4), m, slots)  # type: ignore[arg-type]
