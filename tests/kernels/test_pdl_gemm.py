"""The PDL GEMM (on by default where kernels launch with PDL) against its torch
specification, its dispatch from the decode linear layers, and its sm_90 compile."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    import mrv2_kernels  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from mrv2_kernels import norm_gemv as ng
from mrv2_kernels._backend import arrival_counters, pdl_enabled
from mrv2_kernels.pdl_gemm import GemmTiles, pdl_gemm, pdl_gemm_ref, use_pdl_gemm

pg = sys.modules["mrv2_kernels.pdl_gemm"]  # the module (its name is also the function's)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)
# the interpreter's bf16 arithmetic is wrong: fp32 there, bf16 on a GPU
DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
TOL = 1e-4 if DEVICE == "cpu" else 2e-2


def _inputs(m: int, n: int, k: int, bias: bool, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(DTYPE).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(DTYPE).to(DEVICE)
    b = torch.randn(n, generator=g).to(DTYPE).to(DEVICE) if bias else None
    return x, w, b


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize(("m", "n", "k", "bias", "early"), [
    (5, 40, 72, False, False),    # every edge ragged: rows, features, a partial last K tile
    (35, 32, 48, True, True),     # three row tiles, the first K tile before the loop
    (16, 48, 16, True, False),    # one K tile
    (3, 24, 40, False, True),
])
def test_matches_the_specification(m: int, n: int, k: int, bias: bool, early: bool,
                                   gated: bool) -> None:
    x, w, b = _inputs(m, 2 * n if gated else n, k, bias, seed=m + n + k)
    tiles = GemmTiles(16, 16, 16, 2, 4) if DEVICE == "cpu" else None
    out = pdl_gemm(x, w, b, gated=gated, tiles=tiles, early=early)
    want = pdl_gemm_ref(x, w, b, gated=gated)
    assert out.shape == (m, n) and out.dtype == x.dtype
    err = (out.float() - want.float()).abs().max().item()
    assert err <= TOL * (1 + want.float().abs().max().item()), err


def test_early_first_tile_gives_the_same_bits() -> None:
    x, w, b = _inputs(20, 40, 56, True, seed=7)
    tiles = GemmTiles(16, 16, 16, 2, 4) if DEVICE == "cpu" else None
    late = pdl_gemm(x, w, b, tiles=tiles, early=False)
    assert torch.equal(pdl_gemm(x, w, b, tiles=tiles, early=True), late)


@pytest.mark.parametrize(("m", "n", "k", "splits", "gated", "bias", "early"), [
    (5, 40, 72, 3, False, True, False),   # a ragged last split
    (35, 24, 100, 4, True, True, True),   # three row tiles, the SwiGLU after the sum
    (3, 24, 40, 8, False, False, True),   # more splits asked than K tiles: 3 run
])
def test_split_reduction(m: int, n: int, k: int, splits: int, gated: bool, bias: bool,
                         early: bool) -> None:
    """Split-K: the last program of each tile sums the partials in split order, so a repeat
    gives the same bits, and it leaves the tile's arrival counter at zero for the next launch."""
    x, w, b = _inputs(m, 2 * n if gated else n, k, bias, seed=m + k + splits)
    tiles = GemmTiles(16, 16, 16, 2, 4, splits) if DEVICE == "cpu" else GemmTiles(
        64, 32, 32, 3, 4, splits)
    out = pdl_gemm(x, w, b, gated=gated, tiles=tiles, early=early)
    want = pdl_gemm_ref(x, w, b, gated=gated)
    err = (out.float() - want.float()).abs().max().item()
    assert err <= TOL * (1 + want.float().abs().max().item()), err
    assert torch.equal(pdl_gemm(x, w, b, gated=gated, tiles=tiles, early=early), out)
    counters = arrival_counters(x.device, 1)
    assert counters is not None and int(counters.abs().sum()) == 0


def test_errors_name_the_argument() -> None:
    x, w, _ = _inputs(4, 8, 16, False, seed=1)
    with pytest.raises(ValueError, match="do not fit"):
        pdl_gemm(x, w[:, :8])
    with pytest.raises(ValueError, match="even number of rows"):
        pdl_gemm(x, w[:7], gated=True)
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        pdl_gemm(x, w, torch.zeros(4, device=DEVICE))


def test_dispatch_from_the_decode_linears(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default only where kernels launch with PDL (never on the interpreter), with
    MRV2_PDL_GEMM=1 wherever Triton runs, never with 0; only for 3-64 rows of bf16/fp16 and
    small weights that the GEMV and the skinny kernel do not take; the SwiGLU fuses when the
    norm runs apart."""
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    calls: list[tuple[int, bool]] = []

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *,
            gated: bool = False, **kw: Any) -> torch.Tensor:
        calls.append((x.shape[0], gated))
        return pdl_gemm_ref(x, w, b, gated=gated)

    monkeypatch.setattr(ng, "pdl_gemm", spy)
    w = torch.randn(64, 32, dtype=torch.float16, device=DEVICE)  # K < N: not skinny's
    x = torch.randn(8, 32, dtype=torch.float16, device=DEVICE)
    monkeypatch.delenv("MRV2_PDL_GEMM", raising=False)
    assert use_pdl_gemm(x, w) == pdl_enabled(x)  # the default: where PDL launches
    monkeypatch.setattr(pg, "pdl_enabled", lambda t: True)
    assert use_pdl_gemm(x, w)
    monkeypatch.setenv("MRV2_PDL_GEMM", "0")
    assert not use_pdl_gemm(x, w)
    monkeypatch.setenv("MRV2_PDL_GEMM", "1")
    monkeypatch.setattr(pg, "pdl_enabled", lambda t: False)
    assert use_pdl_gemm(x, w)
    assert not use_pdl_gemm(x[:2], w) and not use_pdl_gemm(
        torch.randn(65, 32, device=DEVICE).half(), w)
    wide = torch.empty(6145, 1024, dtype=x.dtype, device=DEVICE)  # 0.6B's gate/up + a row
    x_wide = torch.randn(8, 1024, device=DEVICE).half()
    assert use_pdl_gemm(x_wide, wide[:6144]) and not use_pdl_gemm(x_wide, wide)
    assert not use_pdl_gemm(x.float(), w.float())
    monkeypatch.setattr(ng, "use_skinny", lambda x, w: False)
    ng.decode_linear(x, w)
    assert calls == [(8, False)]
    calls.clear()
    nw = torch.ones(32, dtype=torch.float16, device=DEVICE)
    monkeypatch.setattr(ng, "FUSED_NORM_MAX_ELEMS", 0)  # the norm runs as its own kernel
    y, _ = ng.norm_gemv(x, w, norm_weight=nw, gated=True)
    assert calls == [(8, True)] and y.shape == (8, 32)


_SM90_SCRIPT = r"""
from mrv2_kernels import pdl_gemm as g

bf = "*bf16"
ptrs = {"x_ptr": bf, "w_ptr": bf, "bias_ptr": bf, "out_ptr": bf, "ws_ptr": "*fp32",
        "cnt_ptr": "*i32"}
# multiples of 16, as a model's
sizes = ("N", "K", "K_CHUNK", "stride_x", "stride_w", "stride_o")
for gated in (False, True):
    for early in (False, True):
        for bm, split in ((64, 1), (128, 4)):  # the default tiles (default_tiles); split-K
            bk, stages = (64, 4) if gated else (128, 3)
            build(g._pdl_gemm_kernel, ptrs,
                  dict(BM=bm, BN=64, BK=bk, STAGES=stages, SPLIT_K=split, GATED=gated,
                       HAS_BIAS=True, PDL=True, EARLY=early), divisible=sizes, num_warps=4)
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU run compiles it for real")
def test_compiles_for_sm90(tmp_path: Any) -> None:
    """Every variant compiles for an H100/H200 (no GPU needed) with its default tiles, its
    loads pipelined (several stages of shared memory) and within a program's 232,448 bytes."""
    sys.path.insert(0, str(Path(__file__).parent))
    from sm90 import compile_for_sm90

    sizes = compile_for_sm90(_SM90_SCRIPT, tmp_path)["_pdl_gemm_kernel"]
    assert len(sizes) == 8 and all(64 * 1024 < s <= 232_448 for s in sizes), sizes
