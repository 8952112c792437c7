"""The chunked gated delta rule with a decay per key channel (Kimi Delta Attention, ``g`` ``[T,
Hv, K]``: ``mrv2_kernels.chunk_kda_kernels`` through ``chunk_gated_delta_rule_triton``, and the
chunked torch reference) against the token-serial reference ``gated_delta_rule_ref``: varlen
batches with chunk boundaries inside sequences, padding sequences and tokens, decays down to
``exp(-20)`` a token per channel, poisoned scratch and outputs; snapshots and resumes
(``state_table``), speculative decoding's ``row_slots``, raw gates, ``skip`` / ``out_dtype``;
``gated_delta_rule_auto``'s dispatch of such gates; the GPU build of the kernels."""

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
    CHUNKED_MIN_QUERY_LEN_DELTA,
    chunk_gated_delta_rule_ref,
    chunk_gated_delta_rule_triton,
    gated_delta_rule_auto,
)
from mrv2_kernels.linear_attention import default_state_table, gated_delta_rule_ref

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

sys.path.insert(0, str(Path(__file__).parent))
from state_batches import BF16, DEVICE, F32, I32, make_batch, rand, randn  # noqa: E402

if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

# (query length, start, state row) for chunks of 8 (GPU: 16). Row 3 is in no sequence.
SEQS = [
    (37, 5, 2),  # several chunks and a remainder, continuing a state
    (0, 0, 2),  # padding aliasing row 2
    (5, 0, 1),  # less than a chunk, fresh over a garbage row
    (16, 0, 4),  # whole chunks
    (1, 9, 0),  # decode
]
ROWS = 5
PAD = 3


@pytest.fixture
def poisoned(poison: Callable[[ModuleType], None]) -> None:
    poison(cdr)
    poison(la)


def run(fn: str) -> Callable[..., torch.Tensor]:
    """``"triton"`` (chunks of 8 and diagonal blocks of 4 on the CPU: two blocks below the
    diagonal a chunk; GPU: 16 / 4) or ``"ref"`` (chunks of 8)."""
    if fn == "triton":
        tiles = {"chunk": 8, "block_sub": 4} if DEVICE == "cpu" else {"chunk": 16,
                                                                      "block_sub": 4}
        return lambda *a, **kw: chunk_gated_delta_rule_triton(*a, **kw, **tiles)
    return lambda *a, **kw: chunk_gated_delta_rule_ref(*a, **kw, chunk=8)


def inputs(t: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, seed: int
           ) -> tuple[torch.Tensor, ...]:
    """q, k, v, a per-channel log decay (per token and channel from ~0 to -20: most channels
    keep their memory over a chunk, some drop it at once), beta."""
    q = randn(t, hk, dk, dtype=dtype, seed=seed)
    k = randn(t, hk, dk, dtype=dtype, seed=seed + 1)
    v = randn(t, hv, dv, dtype=dtype, seed=seed + 2)
    g = -20.0 * rand(t, hv, dk, seed=seed + 3) ** 4
    beta = torch.sigmoid(randn(t, hv, seed=seed + 4)).to(dtype)
    return q, k, v, g, beta


def check(got: torch.Tensor, want: torch.Tensor, got_state: torch.Tensor,
          want_state: torch.Tensor, dtype: torch.dtype, real: int) -> None:
    assert got.dtype == want.dtype and not got.isnan().any()
    if dtype == F32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-3)
    assert torch.equal(got[real:], torch.zeros_like(got[real:]))
    gpu16 = DEVICE == "cuda" and dtype != F32  # (one TF32 product: chunk_delta_rule's rule)
    torch.testing.assert_close(got_state, want_state, equal_nan=True,
                               **({"rtol": 3e-2, "atol": 5e-3} if gpu16
                                  else {"rtol": 1e-4, "atol": 2e-5}))


@pytest.mark.parametrize("fn,dtype,delta,raw,kw", [
    ("triton", F32, True, False, {}),
    ("triton", BF16, True, True, {"block_k": 8 if DEVICE == "cpu" else 16}),  # K blocks
    ("triton", F32, False, False, {"serial_below": 4}),  # short ones in the serial kernel
    ("triton", BF16, True, False, {"skip": True, "out_dtype": F32}),
    ("ref", F32, True, True, {}),
    ("ref", F32, False, False, {"skip": True}),
])
def test_matches_token_serial(fn: str, dtype: torch.dtype, delta: bool, raw: bool,
                              kw: dict[str, Any], poisoned: None) -> None:
    """Outputs (zeros on the padding tokens) and every state row (row 3, outside the batch,
    unchanged; row 1's garbage unread) against the token-serial reference; ``raw``: ``g`` /
    ``beta`` the raw projections with ``dt_bias`` ``[Hv, K]`` (strided views)."""
    batch = make_batch(SEQS, pad_tokens=PAD)
    hk, hv, dk, dv = 1, 2, 16, 8
    q, k, v, g, beta = inputs(batch.num_tokens, hk, hv, dk, dv, dtype, seed=10)
    kw = dict(kw)
    if raw:  # one [a | b] row a token
        ab = randn(batch.num_tokens, hv * dk + hv, seed=15, scale=2.0)
        g, beta = ab[:, : hv * dk].view(-1, hv, dk), ab[:, hv * dk:]
        kw["gate_params"] = (randn(hv, seed=16, scale=0.5) + 1.0, randn(hv, dk, seed=17))
    if kw.get("skip"):
        kw["skip"] = randn(hv, seed=18)
    state0 = randn(ROWS + 1, hv, dk, dv, seed=19, scale=0.5)
    state0[1] = float("nan")
    want_state, got_state = state0.clone(), state0.clone()
    ref_kw = {key: val for key, val in kw.items() if key not in ("block_k", "serial_below")}
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *batch.meta, dk ** -0.5,
                                delta, delta=delta, **ref_kw)
    got = run(fn)(q, k, v, g, beta, got_state, *batch.meta, dk ** -0.5, delta, delta=delta,
                  **(kw if fn == "triton" else ref_kw))
    check(got, want, got_state, want_state, dtype, batch.real_tokens)
    assert torch.equal(got_state[3], state0[3])
    assert not got_state[1].isnan().any()


@pytest.mark.parametrize("fn", ["triton", "ref"])
def test_state_table_and_row_slots(fn: str, poisoned: None) -> None:
    """Snapshots inside a chunk and at a chunk's last token, a resume from a snapshot row over
    a NaN row of the request's own (the source unchanged); then speculative decoding's rows
    (``row_slots=4``: the states after the last three counts, one of them at a chunk
    boundary)."""
    hv, dk, dv = 2, 8, 8
    batch = make_batch([(21, 0, 0), (19, 8, 1)], pad_tokens=1)
    q, k, v, g, beta = inputs(batch.num_tokens, 1, hv, dk, dv, F32, seed=30)
    state0 = randn(8, hv, dk, dv, seed=31, scale=0.5)
    state0[1] = float("nan")
    tbl = default_state_table(8, DEVICE)
    tbl[0] = torch.tensor((0, -1, 3, 4, 16, 5), dtype=I32)  # snapshots after 3 and 16 tokens
    tbl[1] = torch.tensor((6, 8, 13, 7, -1, 0), dtype=I32)  # resumes at 8 from row 6
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *batch.meta, 0.3,
                                state_table=tbl)
    got = run(fn)(q, k, v, g, beta, got_state, *batch.meta, 0.3, state_table=tbl)
    check(got, want, got_state, want_state, F32, batch.real_tokens)
    assert torch.equal(got_state[6], state0[6])
    assert not torch.isclose(got_state[[4, 5, 7]], state0[[4, 5, 7]]).all(-1).any()

    batch = make_batch([(17, 2, 0), (0, 0, 1), (5, 0, 2)], pad_tokens=1)
    q, k, v, g, beta = inputs(batch.num_tokens, 1, hv, dk, dv, F32, seed=40)
    state0 = randn(12, hv, dk, dv, seed=41, scale=0.5)
    want_state, got_state = state0.clone(), state0.clone()
    want = gated_delta_rule_ref(q, k, v, g, beta, want_state, *batch.meta, 0.3, row_slots=4)
    got = run(fn)(q, k, v, g, beta, got_state, *batch.meta, 0.3, row_slots=4)
    check(got, want, got_state, want_state, F32, batch.real_tokens)


@pytest.mark.parametrize("delta,length,chunked", [
    (True, CHUNKED_MIN_QUERY_LEN_DELTA - 1, False), (True, CHUNKED_MIN_QUERY_LEN_DELTA, True),
])
def test_auto_runs_vector_gates_chunked(monkeypatch: pytest.MonkeyPatch, delta: bool,
                                        length: int, chunked: bool) -> None:
    """A per-channel ``g`` takes the chunked form past the delta rule's threshold, as a
    per-head one (it ran token-serial at every length before)."""
    monkeypatch.delenv(cdr.CHUNKED_ENV_VAR, raising=False)
    called: list[str] = []
    monkeypatch.setattr(cdr, "chunk_gated_delta_rule", lambda *a, **k: called.append("chunk"))
    monkeypatch.setattr(cdr, "_serial_gated_delta_rule", lambda *a, **k: called.append("serial"))
    batch = make_batch([(length, 0, 0)])
    q, k, v, g, beta = inputs(length, 1, 2, 8, 8, F32, seed=50)
    state = randn(1, 2, 8, 8, seed=51)
    gated_delta_rule_auto(q, k, v, g, beta, state, *batch.meta, 0.3, delta=delta,
                          max_query_len=length)
    assert called == ["chunk" if chunked else "serial"]


_SM90_SCRIPT = r"""
import os, re, subprocess, tempfile
from triton.compiler import ASTSource
from mrv2_kernels import chunk_kda_kernels as m

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
bf, f32, i32 = "*bf16", "*fp32", "*i32"
INTS = ("qsl_ptr", "seq_lens_ptr", "rows_ptr", "tbl_ptr")
BF16 = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "beta_ptr")

def spills(fn, consts, name, **opts):
    build(fn, {n: i32 if n in INTS else bf if n in BF16 else f32
               for n in fn.arg_names if n.endswith("_ptr")}, consts, **opts)
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({p.name: "fp32" for p in fn.params if p.annotation == "fp32"})
    for n in fn.arg_names:
        if n.endswith("_ptr"):
            sig[n] = i32 if n in INTS else bf if n in BF16 else f32
    sig.update({k: "constexpr" for k in consts})
    const = {(fn.arg_names.index(k),): v for k, v in consts.items()}
    k = triton.compile(ASTSource(fn, sig, const, {}), target=GPUTarget("cuda", 90, 32),
                       options=opts)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    out = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    print("spill:" + name, sum(int(b) for b in re.findall(r"(\d+) bytes spill stores", out)))

spills(m._kda_gates_kernel, dict(CHUNK=64, BLOCK_K=32, REQ_BLOCK=64, RAW_GATES=True, PDL=True),
       "gates", num_warps=4)
spills(m._kda_wy_kernel, dict(L2NORM=True, CHUNK=64, SUB=16, LOG2_BLOCKS=2, BLOCK_K=16,
                              BLOCK_V=64, REQ_BLOCK=64, PREC="tf32", PDL=True),
       "wy", num_warps=8)
for slots in (1, 4):
    spills(m._kda_state_kernel, dict(L2NORM=True, DELTA=True, CHUNK=64, BLOCK_KF=128,
                                     BLOCK_V=32, BLOCK_T=8, PREC="tf32", HAS_TABLE=True,
                                     ROW_SLOTS=slots, PDL=True),
           f"state{slots}", num_warps=8, num_stages=1)
spills(m._kda_out_kernel, dict(L2NORM=True, DELTA=True, CHUNK=64, SUB=16, BLOCK_K=16,
                               BLOCK_V=64, REQ_BLOCK=64, PREC="tf32", HAS_SKIP=False,
                               PDL=True),
       "out", num_warps=8)
ptrs = {n: i32 if n in INTS else bf if n in BF16 else f32
        for n in m._kda_out_kernel.arg_names if n.endswith("_ptr")}
build(m._kda_out_kernel, ptrs, dict(L2NORM=False, DELTA=False, CHUNK=64, SUB=16, BLOCK_K=16,
                                    BLOCK_V=64, REQ_BLOCK=64, PREC="tf32x3", HAS_SKIP=True,
                                    PDL=True), num_warps=8)
ptrs = {n: i32 if n in INTS else bf if n in BF16 else f32
        for n in m._kda_state_kernel.arg_names if n.endswith("_ptr")}
build(m._kda_state_kernel, ptrs, dict(L2NORM=False, DELTA=False, CHUNK=64, BLOCK_KF=128,
                                      BLOCK_V=32, BLOCK_T=8, PREC="tf32x3", HAS_TABLE=False,
                                      ROW_SLOTS=1, PDL=True), num_warps=8, num_stages=1)
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU run compiles it for real")
def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    """The four kernels compiled for an H100/H200 at the GPU defaults for Kimi's heads (K = V
    = 128, the table and raw gates on; one state row a sequence and speculative decoding's
    four): shared memory within the 227 KB limit, no math repeated across threads, and ptxas
    reports no register spills but a few hundred bytes in the scan; the forms without the
    delta term (and with a skip) built too."""
    from sm90 import compile_for_sm90

    built = compile_for_sm90(_SM90_SCRIPT, tmp_path)
    spilled = {name[6:]: sizes[0] for name, sizes in built.items() if name.startswith("spill:")}
    # (the scan's [C, K] key and decay tiles beside its state: 208 / 316 bytes in 8 warps, where
    # the per-head scan spills 1,184 at its defaults; 4 warps spilled 2,316 / 1,532 here)
    assert spilled == {"gates": 0, "wy": 0, "state1": spilled["state1"],
                       "state4": spilled["state4"], "out": 0}, spilled
    assert spilled["state1"] <= 512 and spilled["state4"] <= 512, spilled
    assert len(built["_kda_out_kernel"]) == 2 and len(built["_kda_state_kernel"]) == 3
    for name, sizes in built.items():
        assert name.startswith("spill:") or all(size <= 232448 for size in sizes), name
