"""The linear-attention ops' ``state_table`` (prefix caching of per-request state): a chunk
that starts at a snapshot's position resumes from the snapshot's row, and a chunk that covers a
snapshot position stores the state there, for the causal conv and the gated delta rule (with and
without its delta term), Triton (interpreted on CPU) against the reference and both against
runs without a table."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

import pytest
import torch

try:
    import mrv2_kernels  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from mrv2_kernels import causal_conv1d as cc
from mrv2_kernels import linear_attention as la
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
ROWS = 8  # rows 0-3: requests; 4-7: snapshot slots
HK, HV, DK, DV = 1, 2, 8, 6


@pytest.fixture
def poisoned(poison: Callable[[ModuleType], None]) -> None:
    poison(la)
    poison(cc)  # (the conv's outputs)


def meta(seqs: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``seqs``: (query length, start, row) -> query_start_loc, seq_lens, rows."""
    return make_batch(seqs).meta


def table(**rows: tuple[int, ...]) -> torch.Tensor:
    """The default table of 4 request rows, with ``r<i>=(src_row, src_pos, p0, row0, p1,
    row1)`` set."""
    t = default_state_table(4, DEVICE)
    for name, values in rows.items():
        t[int(name[1:])] = torch.tensor(values, dtype=I32)
    return t


class Op:
    """One op under test with its inputs: ``run(slice, state, meta, table)``."""

    def __init__(self, kind: str, fn: str, tokens: int) -> None:
        self.kind = kind
        triton = fn == "triton"
        if kind == "conv":
            dim = 5
            self.x = randn(tokens, dim, seed=1)
            self.w, self.b = randn(dim, WIDTH, seed=2, scale=0.5), randn(dim, seed=3)
            self.state0 = randn(ROWS, WIDTH - 1, dim, seed=4)
            # (Triton: channel blocks of 4, so two programs a sequence, the second masked,
            # each resuming and storing its slice of the snapshots)
            self.fn: Callable[..., torch.Tensor] = (partial(causal_conv1d_triton, block_d=4)
                                                    if triton else causal_conv1d_ref)
        else:
            self.q = randn(tokens, HK, DK, seed=5)
            self.k = randn(tokens, HK, DK, seed=6)
            self.v = randn(tokens, HV, DV, seed=7)
            self.g = -(randn(tokens, HV, seed=8).abs() * 0.3 + 0.01)
            self.beta = torch.sigmoid(randn(tokens, HV, seed=9))
            self.state0 = randn(ROWS, HV, DK, DV, seed=10, scale=0.5)
            self.fn = gated_delta_rule_triton if triton else gated_delta_rule_ref

    def run(self, sl: slice, state: torch.Tensor, m: tuple[torch.Tensor, ...],
            tbl: torch.Tensor | None) -> torch.Tensor:
        if self.kind == "conv":
            return self.fn(self.x[sl], self.w, self.b, state, *m, "silu", state_table=tbl)
        return self.fn(self.q[sl], self.k[sl], self.v[sl], self.g[sl], self.beta[sl], state, *m,
                       DK ** -0.5, True, delta=self.kind == "gdr", state_table=tbl)


KINDS = ["conv", "gdr", "ssm"]


@pytest.mark.parametrize("fn", ["triton", "ref"])
@pytest.mark.parametrize("kind", KINDS)
def test_snapshot_then_resume(kind: str, fn: str, poisoned: None) -> None:
    """Request 0 computes 9 tokens from scratch in one chunk, storing snapshots after 4 and 9
    tokens into rows 5 and 6; request 1 then resumes at position 4 from row 5 and computes
    tokens 4..8 over a garbage row of its own: its outputs and final state are request 0's, the
    snapshots are what 4- and 9-token runs leave, and no other row changes."""
    op = Op(kind, fn, 9)
    state = op.state0.clone()
    whole = op.run(slice(0, 9), state, meta([(9, 0, 0)]), table(r0=(0, -1, 4, 5, 9, 6)))
    plain4 = op.state0.clone()
    op.run(slice(0, 4), plain4, meta([(4, 0, 3)]), None)
    torch.testing.assert_close(state[5], plain4[3], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state[6], state[0], rtol=0, atol=0)
    for row in (1, 2, 3, 4, 7):
        assert torch.equal(state[row], op.state0[row])
    # Request 1 (row 2): resumes from row 5 at position 4; a table of its own there.
    before = state.clone()
    rest = op.run(slice(4, 9), state, meta([(5, 4, 2)]), table(r2=(5, 4, -1, 0, -1, 0)))
    torch.testing.assert_close(rest, whole[4:9], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state[2], state[0], rtol=1e-5, atol=1e-6)
    for row in (0, 1, 3, 4, 5, 6, 7):
        assert torch.equal(state[row], before[row])


@pytest.mark.parametrize("kind", KINDS)
def test_table_entries_outside_the_chunk_change_nothing(kind: str) -> None:
    """A source position that is not the chunk's start and snapshot positions outside the
    chunk (before it, at its start, after it) leave the run as it is without a table."""
    op = Op(kind, "triton", 3)
    m = meta([(3, 5, 1)])  # positions 5, 6, 7 (seq_len 8)
    tbl = table(r1=(6, 4, 5, 4, 9, 7))  # resume only at 4; snapshots after 5 and 9 tokens
    got_state, want_state = op.state0.clone(), op.state0.clone()
    got = op.run(slice(0, 3), got_state, m, tbl)
    want = op.run(slice(0, 3), want_state, m, None)
    assert torch.equal(got, want)
    assert torch.equal(got_state, want_state)


@pytest.mark.parametrize("kind", KINDS)
def test_triton_matches_ref_with_a_table(kind: str, poisoned: None) -> None:
    """A mixed batch: a resumed chunk shorter than the conv width, a chunk with two snapshots
    (one after its first token), a decode whose one token is a snapshot position, and a
    padding sequence aliasing a row whose table asks for snapshots (it must store none)."""
    op = Op(kind, "triton", 12)
    seqs = [(2, 6, 0), (6, 0, 1), (0, 3, 3), (1, 8, 2)]
    tbl = table(r0=(7, 6, -1, 0, -1, 0), r1=(1, -1, 1, 4, 6, 5), r2=(2, -1, 9, 6, -1, 0),
                r3=(3, -1, 4, 7, 5, 7))
    ref = Op(kind, "ref", 12)
    got_state, want_state = op.state0.clone(), op.state0.clone()
    m = meta(seqs)
    got = op.run(slice(0, 9), got_state, m, tbl)
    want = ref.run(slice(0, 9), want_state, m, tbl)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-4, atol=1e-5)
    assert torch.equal(got_state[3], op.state0[3]) and torch.equal(got_state[7], op.state0[7])
    for row in (4, 5, 6):  # each snapshot was written
        assert not torch.equal(got_state[row], op.state0[row])


def test_bad_table_refused() -> None:
    op = Op("gdr", "triton", 2)
    with pytest.raises(ValueError, match="state_table must be"):
        op.run(slice(0, 2), op.state0.clone(), meta([(2, 0, 0)]),
               torch.zeros(4, 5, dtype=I32, device=DEVICE))
    with pytest.raises(TypeError, match="int32"):
        op.run(slice(0, 2), op.state0.clone(), meta([(2, 0, 0)]),
               default_state_table(4, DEVICE).long())


_SPILL_SCRIPT = r"""
import os, re, subprocess, sys, tempfile
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    sys.exit(3)
from mrv2_kernels import causal_conv1d as cc
from mrv2_kernels import linear_attention as la

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
if not os.path.exists(PTXAS):
    sys.exit(3)
INTS = ("qsl_ptr", "seq_lens_ptr", "rows_ptr", "tbl_ptr")
F32 = ("state_ptr", "g_ptr", "a_log_ptr", "dt_bias_ptr", "skip_ptr")


def spills(fn, consts, warps, state="*fp32"):
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({n: "fp32" for n in ("scale", "dt_lo", "dt_hi") if n in sig})
    for n in fn.arg_names:
        if n.endswith("_ptr"):
            sig[n] = "*i32" if n in INTS else state if n == "state_ptr" else (
                "*fp32" if n in F32 else "*bf16")
    sig.update({k: "constexpr" for k in consts})
    const = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    k = triton.compile(ASTSource(fn, sig, const, {}), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    out = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    name = f"{fn.__name__}/{consts['ROW_SLOTS']}" + ("/vec" if consts.get("VEC_GATE") else "")
    print(name, sum(int(b) for b in re.findall(r"(\d+) bytes spill stores", out)))


for slots in (1, 4):  # one state row a sequence, and speculative decoding's 1 + 3
    gdr = dict(L2NORM=True, DELTA=True, BLOCK_K=128, BLOCK_V=16, BLOCK_T=8, HAS_TABLE=True,
               RAW_GATES=True, MAMBA_GATES=False, HAS_SKIP=False, ROW_SLOTS=slots, PDL=True,
               EARLY=True, VEC_GATE=False)
    spills(la._gated_delta_rule_kernel, gdr, 4)
    spills(la._gated_delta_rule_kernel, {**gdr, "VEC_GATE": True}, 4)  # (Kimi's KDA)
    conv = dict(WIDTH=4, HAS_BIAS=False, SILU=True, BLOCK_T=16, BLOCK_D=256, BLOCK_W=4,
                HAS_TABLE=True, ROW_SLOTS=slots, PDL=True, EARLY=True)
    spills(cc._causal_conv1d_kernel, conv, 8, state="*bf16")
"""


def test_decode_kernels_do_not_spill_on_sm90(tmp_path: Path) -> None:
    """The delta rule (K = 128, the launch's [K, 16] tiles in 4 warps; per-head decays, and
    Kimi Delta Attention's per-channel ones) and the conv (16 x 256
    tiles in 8 warps) with the snapshot table and raw gates, their metadata and initial state
    loaded before the PDL wait (the GPU's default), one state row a sequence and four
    (speculative decoding's ``row_slots``), compiled for sm_90 and read by ptxas: no register
    spills (the [K, 32] / 4-warp delta rule spilled 172 bytes with the
    table, the conv in 4 warps 68-88; with them the delta rule took 9.5 us a decode call on
    an H200, where an H100 had taken 4.2 before the table)."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _SPILL_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode == 3:
        pytest.skip("no sm_90 ahead-of-time compile or ptxas in this Triton")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = dict(line.split() for line in proc.stdout.splitlines())
    assert got == {f"{k}/{n}{v}": "0" for k, vs in (("_gated_delta_rule_kernel", ("", "/vec")),
                                                    ("_causal_conv1d_kernel", ("",)))
                   for n in (1, 4) for v in vs}, got
