"""Top-k / top-p filtering: the sort-free kernel (Triton, interpreted on CPU) against the
reference, and the reference against the former sort-based formula.

Probability sums taken in another order can flip a token whose mass-before lies within float
rounding of top_p. Kept sets are therefore compared allowing a difference only for a token
whose exact (float64) mass-before is within 1e-5 of top_p; never for a top-k difference, and
never in the kept values. The inputs are seeded, so nothing here is flaky.
"""

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

from mrv2_kernels.top_k_top_p import (
    order_keys,
    top_k_top_p,
    top_k_top_p_keys,
    top_k_top_p_keys_ref,
    top_k_top_p_ref,
    top_k_top_p_triton,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

INF = float("inf")
TOL = 1e-5


def sort_formula(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The former sort-based ``apply_top_k_top_p``, verbatim."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k <= 0, vocab, top_k.clamp(max=vocab)).long()
    kth = sorted_logits.gather(1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def exact_mass_before(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """float64 probability (softmax over the top-k survivors) of the values strictly above each
    token; ``inf`` for tokens top-k drops."""
    x = logits.double().cpu()
    vocab = x.shape[1]
    k = torch.where(top_k.cpu() <= 0, vocab, top_k.cpu().clamp(max=vocab)).long()
    kth = x.sort(dim=1, descending=True).values.gather(1, (k - 1)[:, None])
    survive = (x >= kth) & (x > -INF)
    q = torch.softmax(x.masked_fill(~survive, -INF), dim=1).nan_to_num(0.0)
    above = (x[:, None, :] > x[:, :, None]).double()  # above[b, v, u] = x[b, u] > x[b, v]
    mb = (above * q[:, None, :]).sum(-1)
    return mb.masked_fill(~survive, INF)


def assert_filter_close(
    got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor,
    top_k: torch.Tensor, top_p: torch.Tensor,
) -> None:
    got, want, x = got.cpu(), want.cpu(), logits.float().cpu()
    assert got.dtype == torch.float32 and got.shape == x.shape
    kept = torch.isfinite(got)
    assert torch.equal(got[kept], x[kept])
    assert (got[~kept] == -INF).all()
    diff = kept ^ torch.isfinite(want)
    if diff.any():
        mb = exact_mass_before(x, top_k)
        near = (mb - top_p.cpu().double()[:, None]).abs() < TOL
        bad = diff & ~near
        assert not bad.any(), f"kept sets differ away from the top-p boundary: {bad.nonzero()}"


def make_batch(seed: int, vocab: int, dtype: torch.dtype = torch.float32) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seven rows covering every case: p only, k = 1, -inf entries, k >= V with a tiny p,
    heavy ties, an untouched row and an all -inf row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, vocab, generator=g) * 2.5
    x[2, torch.rand(vocab, generator=g) < 0.3] = -INF
    x[4] = (x[4] * 2).round() / 2  # ~25 distinct values: ties at both cuts
    x[6] = -INF
    top_k = torch.tensor([0, 1, 40, vocab + 5, 60, 0, 5], dtype=torch.int32)
    top_p = torch.tensor([0.9, 1.0, 0.8, 1e-7, 0.7, 1.0, 0.5])
    return x.to(dtype).to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE)


# ------------------------------------------------------------------ reference


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ref_matches_sort_formula(seed: int) -> None:
    """Without ties the reference is the former sort-based formula."""
    g = torch.Generator().manual_seed(seed)
    n, vocab = 12, 400
    x = torch.randn(n, vocab, generator=g) * torch.tensor([0.3, 1.0, 4.0]).repeat(4)[:, None]
    x[3, :350] = -INF
    top_k = torch.tensor([0, 1, 2, 5, 50, 399, 400, 1000, 0, -1, 17, 3])
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.95, 0.3, 1.0, 0.99, 0.6, 1e-6, 0.75, 1.0, 0.999])
    before = x.clone()
    want = top_k_top_p_ref(x, top_k, top_p)
    assert torch.equal(x, before)  # input untouched
    assert_filter_close(sort_formula(x, top_k, top_p), want, x, top_k, top_p)
    assert torch.isfinite(want).sum(1).tolist()[1] == 1  # k = 1
    assert int(torch.isfinite(want[10]).sum()) == 17  # k only


def test_ref_tie_rule() -> None:
    """Ties are kept whole at the k-th value (as before) and at the top-p boundary (new)."""
    x = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.2, 1e-3], [0.4, 0.2, 0.2, 0.2, 1e-3]]))
    x = torch.cat([x, torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0]])])
    top_k = torch.tensor([0, 0, 2])
    top_p = torch.tensor([0.65, 0.35, 1.0])
    want = top_k_top_p_ref(x, top_k, top_p)
    # Row 0: the group of 0.2 has ~0.4 before it (< 0.65): all of it stays, though the sort
    # gives its third member ~0.8 >= 0.65 before it. Row 1: 0.4 >= 0.35 drops the group.
    assert torch.isfinite(want).tolist() == [[True] * 4 + [False], [True] + [False] * 4,
                                             [True] * 4 + [False]]
    old = torch.isfinite(sort_formula(x, top_k, top_p))
    assert old[0].sum() == 3 and torch.equal(old[1:], torch.isfinite(want[1:]))


# ------------------------------------------------------------------ Triton against the reference


@pytest.mark.parametrize(
    ("vocab", "dtype", "kw"),
    [
        (700, torch.float32, {}),  # in-register sort of the candidates (cap 128)
        (700, torch.float32, {"small_cap": 16}),  # both sorts: rows of <= 16 and of 17-128
        (300, torch.float32, {"cap": 16, "chunk": 64, "block_v": 32}),  # bisection, 5 chunks
        (1000, torch.bfloat16, {"block_v": 128}),  # bf16 read as fp32: many ties
    ],
)
def test_triton_matches_ref(vocab: int, dtype: torch.dtype, kw: dict[str, int]) -> None:
    x, top_k, top_p = make_batch(seed=vocab, vocab=vocab, dtype=dtype)
    before = x.clone()
    want = top_k_top_p_ref(x, top_k, top_p)
    out = torch.full(x.shape, float("nan"), device=DEVICE)  # poisoned
    got = top_k_top_p_triton(x, top_k, top_p, out, **kw)
    assert got is out and torch.equal(x, before)
    assert_filter_close(got, want, x, top_k, top_p)
    kept = torch.isfinite(want).sum(1).tolist()
    assert kept[1] == 1 and kept[5] == int(torch.isfinite(x[5]).sum()) and kept[6] == 0
    assert torch.equal(got[5].cpu(), x[5].float().cpu())  # untouched row copied


@pytest.mark.parametrize("kw", [{}, {"cap": 16, "small_cap": 16, "block_v": 64}])
def test_triton_refines_flat_top_p_rows(kw: dict[str, int]) -> None:
    """Top-p alone over flat rows: the threshold lies in the bulk, where the first pivots'
    bracket holds hundreds of values (2,048 values over 17 brackets; the threshold near 0.4 of
    the span from the max, in a bracket ~0.08 of it wide), more than ``cap``: a second pivot
    pass narrows it. Brackets straddling 0, a value at -FLT_MAX (its key's neighbour is -inf)
    and a top-k row (never refined) beside them."""
    vocab = 2048
    g = torch.Generator().manual_seed(11)
    u = torch.rand(6, vocab, generator=g)
    x = torch.stack([u[0], u[1] * 8.0, u[2] * 2.0 - 1.0, u[3] * 0.01, u[4], u[5] * 3.0])
    x[4, 100] = -3.4028234663852886e38
    top_k = torch.tensor([0, 0, 0, 0, 0, 1500])
    top_p = torch.tensor([0.5, 0.9, 0.7, 0.99, 0.6, 0.8])
    x, top_k, top_p = x.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE)
    want = top_k_top_p_ref(x, top_k, top_p)
    got = top_k_top_p_triton(x, top_k, top_p, **kw)
    assert_filter_close(got, want, x, top_k, top_p)
    kept = torch.isfinite(want).sum(1).tolist()
    assert all(100 < n < vocab for n in kept[:5]), kept  # cuts in the bulk of every row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_and_temperature_in_kernel(dtype: torch.dtype,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``temperature=`` filters ``logits.float() / t`` to the bit; the threshold keys keep
    exactly the values the write kept, and match the reference's keys (away from a top-p
    boundary within rounding, as the filters)."""
    x, top_k, top_p = make_batch(seed=21, vocab=600, dtype=dtype)
    g = torch.Generator().manual_seed(3)
    t = (torch.rand(x.shape[0], generator=g) * 1.5 + 0.2).to(DEVICE)
    scaled = x.float() / t[:, None]
    got = top_k_top_p_triton(x, top_k, top_p, temperature=t)
    assert torch.equal(got, top_k_top_p_triton(scaled, top_k, top_p))
    assert_filter_close(got, top_k_top_p_ref(scaled, top_k, top_p), scaled, top_k, top_p)
    monkeypatch.setenv("MRV2_KERNELS", "triton")  # the kernels, on the CPU too
    keys = top_k_top_p_keys(x, top_k, top_p, t)
    assert keys.dtype == torch.int64 and keys.shape == (x.shape[0],)
    kept = order_keys(scaled).long() >= keys[:, None]
    assert torch.equal(kept & torch.isfinite(scaled), torch.isfinite(got))
    want = top_k_top_p_keys_ref(x, top_k, top_p, t)
    assert keys[5] == want[5] == -(2**31) == keys[6] == want[6]  # untouched / all -inf rows
    assert torch.equal(keys[[1, 3]], want[[1, 3]])  # k = 1, a tiny p: the max, exactly
    monkeypatch.delenv("MRV2_KERNELS")
    again = top_k_top_p(x.float(), top_k, top_p, temperature=t)  # the dispatcher's path
    assert_filter_close(again, top_k_top_p_ref(scaled, top_k, top_p), scaled, top_k, top_p)


def test_triton_bf16_values_in_fp32() -> None:
    """bf16 logits converted to fp32 (every row full of ties), with top-k and top-p together."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(4, 500, generator=g) * 3).bfloat16().float().to(DEVICE)
    top_k = torch.tensor([20, 200, 0, 499], device=DEVICE)  # int64 this time
    top_p = torch.tensor([0.9, 0.5, 0.97, 0.999], device=DEVICE)
    want = top_k_top_p_ref(x, top_k, top_p)
    got = top_k_top_p_triton(x, top_k, top_p, cap=64, block_v=128)
    assert_filter_close(got, want, x, top_k, top_p)


def test_triton_edge_rows() -> None:
    """Exact agreement on hand-made rows: tie groups at both cuts, k equal to the number of
    finite values, a single finite value, p = 0 (drops everything), mass ties under
    bisection (cap 16)."""
    vocab = 64
    x = torch.full((7, vocab), -INF)
    x[0, :5] = torch.log(torch.tensor([0.4, 0.2, 0.2, 0.2, 1e-3]))  # top-p tie group kept
    x[1, :5] = torch.log(torch.tensor([0.4, 0.2, 0.2, 0.2, 1e-3]))  # ... and dropped
    x[2, 10:40] = 1.0  # 30 tied values, k = 3 keeps all of them
    x[2, 50] = 2.0
    x[3, 7] = -3.0  # single finite value
    x[4] = torch.linspace(-2.0, 2.0, vocab)
    x[5, :20] = torch.arange(20.0) % 4  # 4 groups of 5 tied values, k == number of finite
    x[6] = torch.where(torch.arange(vocab) % 2 == 0, 0.5, -0.0)  # -0.0 ties with 0.0
    x[6, :20] = 0.0  # 22 values 0.5, then 42 zeros holding the k-th value and 0.46 mass above
    top_k = torch.tensor([0, 0, 3, 1, 0, 20, 40])
    top_p = torch.tensor([0.65, 0.35, 0.5, 0.3, 0.0, 0.9, 0.5])
    x, top_k, top_p = x.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE)
    want = top_k_top_p_ref(x, top_k, top_p)
    assert torch.isfinite(want).sum(1).tolist() == [4, 1, 31, 1, 0, 15, 64]
    for kw in ({}, {"cap": 16, "block_v": 16}):
        got = top_k_top_p_triton(x, top_k, top_p, **kw)
        assert torch.equal(got, want), kw


def test_dispatch_and_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    x, top_k, top_p = make_batch(seed=3, vocab=256)
    x, top_k, top_p = x[:4], top_k[:4], top_p[:4]
    want = top_k_top_p_ref(x, top_k, top_p)
    monkeypatch.delenv("MRV2_KERNELS", raising=False)
    assert_filter_close(top_k_top_p(x, top_k, top_p), want, x, top_k, top_p)
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    y = x.clone()
    assert top_k_top_p(y, top_k, top_p, out=y) is y  # in place
    assert_filter_close(y, want, x, top_k, top_p)
    with pytest.raises(ValueError, match="top_p"):
        top_k_top_p(x, top_k, top_p[:2])


# The interpreter misses what only the compiler rejects (a layout it cannot lower, a variable
# whose type differs between branches): compile every kernel of the filter, and the sampling
# kernel that applies its keys, for sm_90 at a 151,936-token vocabulary, no GPU needed.
_SM90_SCRIPT = r"""
from mrv2_kernels import gumbel as g
from mrv2_kernels import top_k_top_p_kernels as t

f32, i32, i64, x = "*fp32", "*i32", "*i64", "*bf16"
rows = {"x_ptr": x, "t_ptr": f32, "topk_ptr": i64, "topp_ptr": f32, "stat_ptr": f32}
counts = {"cnt_ptr": i32, "mass_ptr": f32, "piv_ptr": i32}
second = {"cnt2_ptr": i32, "mass2_ptr": f32, "piv2_ptr": i32, "flag_ptr": i32}
tiles = dict(CHUNK=8192, BLOCK=1024, TEMP=True)
wide = dict(tiles, BLOCK=256, NB=16, NCH_P2=32)
build(t._stats_kernel, rows, tiles, num_warps=4)
build(t._pivot_kernel, {**rows, **counts}, wide, num_warps=8)
build(t._refine_kernel, {**rows, **counts, **second}, dict(wide, CAP=4096), num_warps=8)
build(t._compact_kernel, {**rows, **counts, **second, "cand_ptr": f32, "bound_ptr": i64,
                          "base_ptr": f32}, dict(tiles, NB=16, NCH_P2=32), num_warps=4)
build(t._resolve_kernel, {"cand_ptr": f32, "topk_ptr": i64, "topp_ptr": f32, "stat_ptr": f32,
                          "bound_ptr": i64, "base_ptr": f32, "thr_ptr": i64},
      dict(CAP=4096, SMALL_CAP=512, NB=16, BLOCK=1024, NCH_P2=32), num_warps=8)
for in_place in (False, True):
    build(t._write_kernel, {"x_ptr": f32 if in_place else x, "t_ptr": f32, "out_ptr": f32,
                            "thr_ptr": i64},
          dict(CHUNK=8192, BLOCK=1024, IN_PLACE=in_place, TEMP=not in_place), num_warps=4)
for rows in (False, True):  # (rows: the tables read per row, gumbel_sample_rows)
    build(g._gumbel_sample_kernel,
          {"logits_ptr": x, "seeds_ptr": i64, "positions_ptr": i64, "greedy_ptr": "*u8",
           "temperature_ptr": f32, "cut_ptr": i64, "out_ptr": i64, "part_val_ptr": f32,
           "part_idx_ptr": i32, "rows_ptr": i32},
          dict(BLOCK_V=2048, SPLIT=True, FAST_LOG=True, TEMPERATURE=True, CUT=True, ROWS=rows),
          num_warps=8)
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU run compiles them for real")
def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    from sm90 import compile_for_sm90

    built = compile_for_sm90(_SM90_SCRIPT, tmp_path)
    assert len(built) == 7 and len(built["_write_kernel"]) == 2, built
    assert len(built["_gumbel_sample_kernel"]) == 2, built
