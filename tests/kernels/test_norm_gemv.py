"""The fused norm + GEMV (+ SwiGLU) decode kernel against the unfused chain it replaces."""

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

from mrv2_kernels.norm import rms_norm_ref, silu_and_mul_ref
from mrv2_kernels.norm_gemv import (
    NORM_GEMV_MAX_M,
    decode_linear,
    norm_gemv,
    norm_gemv_ref,
    norm_gemv_triton,
    use_norm_gemv,
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

BF16, F16 = torch.bfloat16, torch.float16
POISON = float("nan")


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int, gated: bool = False,
            ) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = 2 * n if gated else n

    def t(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale + shift).to(dtype).to(DEVICE)

    return {"x": t(m, k), "residual": t(m, k), "norm_weight": t(k, scale=0.2, shift=1.0),
            "weight": t(rows, k, scale=k**-0.5), "bias": t(rows, scale=0.5)}


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in ulps of ``want``'s dtype at ``want``'s magnitude (at least 1/16:
    near zero, the fp32 sums' order errors are absolute, not relative)."""
    mant = 7 if want.dtype == BF16 else 10
    w = want.float()
    exp = torch.frexp(w.abs().clamp(min=2.0**-4))[1]
    ulp = torch.ldexp(torch.ones_like(w), exp - 1 - mant)
    return float(((got.float() - w).abs() / ulp).max())


def _check_close(got: torch.Tensor, want: torch.Tensor, gated: bool) -> None:
    """fp16 rounds to nearest under the interpreter as on the GPU, so the only differences left
    are the fp32 accumulation order (and a rounding it flips, which can carry through the
    SwiGLU's two): a few ulps. The interpreter truncates fp32 -> bf16, and the chain rounds
    every normed input twice, all in the same direction: there bf16 is only checked to about
    its precision, relative to the largest output (enough to catch any indexing error)."""
    assert torch.isfinite(got.float()).all()
    if got.dtype == F16 or DEVICE == "cuda":
        assert _ulps(got, want) <= (3 if gated else 2)
    else:
        err = (got.float() - want.float()).abs().max()
        assert float(err) <= 2.0**-5 * float(want.float().abs().max())


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (3, 33, 64), (5, 17, 200)])
def test_matches_the_unfused_chain(dtype: torch.dtype, gated: bool, with_residual: bool,
                                   m: int, n: int, k: int) -> None:
    a = _inputs(m, n, k, dtype, seed=m * 31 + n + k, gated=gated)
    res = a["residual"] if with_residual else None
    got, got_res = norm_gemv_triton(a["x"], a["weight"], a["bias"], norm_weight=a["norm_weight"],
                                    eps=1e-6, residual=res, gated=gated)
    want, want_res = norm_gemv_ref(a["x"], a["weight"], a["bias"], norm_weight=a["norm_weight"],
                                   eps=1e-6, residual=res, gated=gated)
    assert got.shape == want.shape == (m, n) and got.dtype == dtype
    _check_close(got, want, gated)
    if with_residual:
        assert got_res is not None and want_res is not None
        if dtype == F16 or DEVICE == "cuda":
            assert torch.equal(got_res, want_res)  # one rounding of an exact fp32 sum
        else:
            assert _ulps(got_res, want_res) <= 1
        assert got_res.data_ptr() != res.data_ptr()  # fresh: other programs still read it
    else:
        assert got_res is None and want_res is None


def test_plain_gemv_and_spec_is_the_chain() -> None:
    """Without a norm it is ``linear`` (+ SwiGLU); the reference is literally the chain."""
    a = _inputs(2, 24, 80, F16, seed=7, gated=True)
    x, w, b = a["x"], a["weight"], a["bias"]
    got, none = norm_gemv_triton(x, w, b, gated=True)
    assert none is None
    chain = silu_and_mul_ref((x.float() @ w.float().T + b.float()).to(F16))
    assert _ulps(got, chain) <= 3
    plain, _ = norm_gemv_triton(x, w[:24], b[:24])
    assert _ulps(plain, (x.float() @ w[:24].float().T + b[:24].float()).to(F16)) <= 2
    normed, new_res = rms_norm_ref(x, a["norm_weight"], 1e-6, a["residual"])
    spec, spec_res = norm_gemv_ref(x, w, b, norm_weight=a["norm_weight"],
                                   residual=a["residual"], gated=True)
    assert torch.equal(spec_res, new_res)
    assert torch.equal(spec, silu_and_mul_ref((normed.float() @ w.float().T
                                               + b.float()).to(F16)))


def test_rows_are_independent_and_outputs_fully_written() -> None:
    a = _inputs(6, 40, 128, F16, seed=11)
    kw = {"norm_weight": a["norm_weight"], "residual": a["residual"]}
    together, res_all = norm_gemv_triton(a["x"], a["weight"], a["bias"], **kw)
    alone, res_one = norm_gemv_triton(a["x"][4:5], a["weight"], a["bias"],
                                      norm_weight=a["norm_weight"],
                                      residual=a["residual"][4:5])
    assert torch.equal(together[4:5], alone)
    assert res_all is not None and res_one is not None and torch.equal(res_all[4:5], res_one)
    # outputs come from torch.empty: fill the allocator's cache with NaN first, then check
    # that nothing of it survives
    torch.full((1 << 16,), POISON, dtype=F16, device=DEVICE)
    again, res_again = norm_gemv_triton(a["x"], a["weight"], a["bias"], **kw)
    assert torch.isfinite(again.float()).all() and res_again is not None
    assert torch.isfinite(res_again.float()).all()
    assert torch.equal(again, together)


def test_strided_rows_and_leading_dims() -> None:
    a = _inputs(4, 20, 64, F16, seed=5)
    wide = torch.randn(4, 128).to(F16).to(DEVICE)
    wide[:, 32:96] = a["x"]
    strided = wide[:, 32:96]
    want, _ = norm_gemv_ref(a["x"], a["weight"], norm_weight=a["norm_weight"])
    got, _ = norm_gemv_triton(strided, a["weight"], norm_weight=a["norm_weight"])
    assert _ulps(got, want) <= 2
    got3, _ = norm_gemv_triton(a["x"].view(2, 2, 64), a["weight"], norm_weight=a["norm_weight"])
    assert got3.shape == (2, 2, 20) and torch.equal(got3.view(4, 20), got)


def test_errors_name_the_argument() -> None:
    a = _inputs(2, 8, 32, F16, seed=1, gated=True)
    with pytest.raises(ValueError, match="do not match"):
        norm_gemv_triton(a["x"], a["weight"][:, :16])
    with pytest.raises(ValueError, match="even row count"):
        norm_gemv_triton(a["x"], a["weight"][:15], gated=True)
    with pytest.raises(ValueError, match="bias must have shape"):
        norm_gemv_triton(a["x"], a["weight"], a["bias"][:8], gated=True)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        norm_gemv_triton(a["x"], a["weight"], norm_weight=a["norm_weight"][:8])
    with pytest.raises(ValueError, match="residual needs norm_weight"):
        norm_gemv_triton(a["x"], a["weight"], residual=a["residual"])
    with pytest.raises(ValueError, match="residual shape"):
        norm_gemv_triton(a["x"], a["weight"], norm_weight=a["norm_weight"],
                         residual=a["residual"][:1])
    empty, res = norm_gemv_triton(a["x"][:0], a["weight"], norm_weight=a["norm_weight"],
                                  residual=a["residual"][:0], gated=True)
    assert empty.shape == (0, 8) and res is not None and res.shape == (0, 32)


def test_dispatch_and_fallback_agree() -> None:
    """The dispatcher's unfused path (too many rows) gives the same results as the kernel."""
    a = _inputs(NORM_GEMV_MAX_M + 1, 24, 64, F16, seed=9, gated=True)
    x, res = a["x"], a["residual"]
    if DEVICE == "cuda":
        assert use_norm_gemv(x[:NORM_GEMV_MAX_M], a["weight"], a["norm_weight"])
        assert not use_norm_gemv(x, a["weight"], a["norm_weight"])
        assert not use_norm_gemv(x[:2].float(), a["weight"].float())
        wide = torch.randn(2, 2048, dtype=F16, device=DEVICE)  # rows x K past the norm's limit
        wide_w, wide_nw = torch.randn(64, 2048, dtype=F16, device=DEVICE), wide[0]
        assert use_norm_gemv(wide[:1], wide_w, wide_nw)
        assert not use_norm_gemv(wide, wide_w, wide_nw)
    else:
        assert not use_norm_gemv(x[:2], a["weight"])  # CPU: only when Triton is forced
    fused, fused_res = norm_gemv_triton(x, a["weight"], a["bias"], norm_weight=a["norm_weight"],
                                        residual=res, gated=True)
    chain, chain_res = norm_gemv(x, a["weight"], a["bias"], norm_weight=a["norm_weight"],
                                 residual=res.clone(), gated=True)
    assert _ulps(chain, fused) <= 3
    assert fused_res is not None and torch.equal(chain_res, fused_res)
    first, first_res = norm_gemv(x[:1], a["weight"], norm_weight=a["norm_weight"], gated=True)
    assert first_res is x[:1] or torch.equal(first_res, x[:1])  # no residual: x carries on


@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_too_wide_to_fuse_keeps_the_swiglu_in_the_gemv(
    with_residual: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row too wide for the fused norm (Qwen3-8B's K 4096 at decode) runs the norm kernel,
    then the plain GEMV with the SwiGLU fused in: the chain's results, two launches."""
    from mrv2_kernels import norm_gemv as module

    monkeypatch.setenv("MRV2_KERNELS", "triton")  # the dispatcher's Triton path on CPU too
    monkeypatch.setattr(module, "FUSED_NORM_MAX_ELEMS", 0)
    calls: list[dict[str, object]] = []
    kernel = module.norm_gemv_triton

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(kwargs)
        return kernel(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(module, "norm_gemv_triton", spy)
    a = _inputs(2, 24, 64, F16, seed=21, gated=True)
    res = a["residual"] if with_residual else None
    want, want_res = norm_gemv_ref(a["x"], a["weight"], a["bias"], norm_weight=a["norm_weight"],
                                   residual=res, gated=True)
    got, got_res = norm_gemv(a["x"], a["weight"], a["bias"], norm_weight=a["norm_weight"],
                             residual=None if res is None else res.clone(), gated=True)
    assert len(calls) == 1 and calls[0].get("gated") and "norm_weight" not in calls[0]
    assert _ulps(got, want) <= 3
    assert torch.equal(got_res, a["x"] if want_res is None else want_res)


def test_decode_linear_picks_the_gemv_for_output_projections() -> None:
    a = _inputs(1, 32, 64, F16, seed=13)
    x, w, b = a["x"], a["weight"], a["bias"]  # K >= N: an output projection
    tall = torch.randn(96, 64).to(F16).to(DEVICE)
    if DEVICE == "cuda":
        assert use_norm_gemv(x, w) and use_norm_gemv(x, tall)  # any N: weights stream early
        assert not use_norm_gemv(torch.randn(1, 8192, dtype=F16, device=DEVICE),
                                 torch.randn(8, 8192, dtype=F16, device=DEVICE))  # K too wide
    want = (x.float() @ w.float().T + b.float()).to(F16)
    assert _ulps(decode_linear(x, w, b), want) <= 2
    assert _ulps(decode_linear(x, tall), (x.float() @ tall.float().T).to(F16)) <= 2


@pytest.mark.skipif(DEVICE != "cuda", reason="real decode shapes: GPU only")
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize(("n", "k", "gated"), [(4096, 1024, False), (3072, 1024, True),
                                               (1024, 2048, False), (1024, 3072, False),
                                               (6144, 4096, False), (512, 8192, True)])
def test_decode_shapes_on_gpu(m: int, n: int, k: int, gated: bool) -> None:
    a = _inputs(m, n, k, BF16, seed=n + k, gated=gated)
    got, got_res = norm_gemv_triton(a["x"], a["weight"], norm_weight=a["norm_weight"],
                                    residual=a["residual"], gated=gated)
    want, want_res = norm_gemv_ref(a["x"], a["weight"], norm_weight=a["norm_weight"],
                                   residual=a["residual"], gated=gated)
    assert _ulps(got, want) <= (3 if gated else 2)
    assert got_res is not None and want_res is not None and torch.equal(got_res, want_res)


def test_early_weights_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights requested before the wait for the previous kernel (``MRV2_PDL_EARLY_WEIGHTS``):
    only the order of the loads changes, never the math."""
    from mrv2_kernels import norm_gemv as module

    a = _inputs(2, 40, 96, BF16, seed=3, gated=True)
    args = (a["x"], a["weight"], a["bias"])
    kwargs = {"norm_weight": a["norm_weight"], "eps": 1e-6, "residual": a["residual"],
              "gated": True}
    plain, plain_res = norm_gemv_triton(*args, **kwargs)
    monkeypatch.setattr(module, "pdl_early_weights", lambda t, default=False: True)
    early, early_res = norm_gemv_triton(*args, **kwargs)
    assert torch.equal(early, plain) and torch.equal(early_res, plain_res)
