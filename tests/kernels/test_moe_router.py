"""MoE routing kernels (:mod:`mrv2_kernels.moe_router`): Triton (interpreted on CPU) against
the torch references, the references against the routers' torch code before the kernels
(``torch.topk``, on inputs without ties), the tie rule on rows built with ties, and the sm_90
compile of both kernels.

The tie rule asserted: equal values go to the **lower expert index** (and, in
``grouped_topk``, equal group scores to the lower group), in the reference as in the kernel;
outputs are in descending order of the value chosen on. Random inputs here have no ties at
the compared positions (fp32 logits), or compare the kernel with the reference, which shares
the rule, so nothing depends on ``torch.topk``'s own order of equal values (which, on the
CPU, is not the lower index first)."""

from __future__ import annotations

import os
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

from mrv2_kernels import moe_router as mr
from mrv2_kernels.moe_router import (
    grouped_topk,
    grouped_topk_ref,
    grouped_topk_triton,
    softmax_topk,
    softmax_topk_ref,
    softmax_topk_triton,
    topk_lowest_index,
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

CPU_ONLY = pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU dispatch")
F32, BF16, I32 = torch.float32, torch.bfloat16, torch.int32


@pytest.fixture
def poisoned(poison: Callable[[ModuleType], None]) -> None:
    poison(mr)


def randn(*shape: int, dtype: torch.dtype = F32, seed: int = 0, scale: float = 2.0
          ) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def legacy_softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``SoftmaxTopKRouter.forward`` after its linear layer, before the kernel."""
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def legacy_grouped_topk(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                        renormalize: bool, routed_scaling_factor: float, scoring: str,
                        correction_bias: torch.Tensor | None, norm_min: float | None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``GroupedTopKRouter.forward`` after its linear layer, before the kernel (verbatim)."""
    num_experts = logits.shape[-1]
    logits = logits.float()
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)
    bias = correction_bias
    choice = scores if bias is None else scores + bias.float()
    if topk_group < n_group:
        grouped = choice.view(-1, n_group, num_experts // n_group)
        if bias is not None and grouped.shape[-1] >= 2:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = group_scores.topk(topk_group, dim=-1)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view_as(choice)
    ids = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20 if norm_min is None else total.clamp_min(norm_min))
    return weights * routed_scaling_factor, ids.to(torch.int32)


def assert_same_routing(got: tuple[torch.Tensor, torch.Tensor],
                        want: tuple[torch.Tensor, torch.Tensor], rtol: float = 1e-6) -> None:
    (w, ids), (want_w, want_ids) = got, want
    assert w.dtype == F32 and ids.dtype == I32
    assert w.shape == want_w.shape and ids.shape == want_ids.shape
    torch.testing.assert_close(ids, want_ids, rtol=0, atol=0)
    torch.testing.assert_close(w, want_w, rtol=rtol, atol=rtol * 1e-2)


# ------------------------------------------------------------------------- topk_lowest_index


@pytest.mark.parametrize("k", [1, 3, 7, 40])
def test_topk_lowest_index_is_a_stable_descending_sort(k: int) -> None:
    """Many ties (small integers), negatives, zeros and infinities: the same indices as a
    stable descending sort (equal values in increasing index order)."""
    gen = torch.Generator().manual_seed(k)
    values = torch.randint(-4, 5, (6, 40), generator=gen).float() / 4
    values[0, ::7] = float("-inf")
    values[1, 3::5] = float("inf")
    values[2] = 0.0
    values = values.to(DEVICE)
    want = values.sort(dim=-1, descending=True, stable=True)[1][:, :k]
    assert torch.equal(topk_lowest_index(values, k), want)
    positive = values.abs()
    want = positive.sort(dim=-1, descending=True, stable=True)[1][:, :k]
    assert torch.equal(topk_lowest_index(positive, k, nonnegative=True), want)


# ------------------------------------------------------------------------------ softmax top-k


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("experts", "top_k", "tokens"), [
    (8, 1, 17), (8, 2, 3), (8, 8, 1),
    (60, 1, 3), (60, 2, 1), (60, 8, 17), (60, 10, 3),
    (512, 1, 1), (512, 2, 3), (512, 8, 1), (512, 10, 3),
    (1000, 1, 3), (1000, 2, 1), (1000, 8, 3), (1000, 10, 1),
])
def test_softmax_topk_matches_reference(poisoned: None, experts: int, top_k: int, tokens: int,
                                        dtype: torch.dtype) -> None:
    logits = randn(tokens, experts, dtype=dtype, seed=experts * 31 + top_k)
    for renormalize in (False, True):
        got = softmax_topk_triton(logits, top_k, renormalize)
        assert_same_routing(got, softmax_topk_ref(logits, top_k, renormalize))
        if not renormalize:
            assert bool((got[0][:, :-1] >= got[0][:, 1:]).all())  # descending


@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (60, 8), (512, 10), (1000, 10)])
def test_softmax_topk_reference_is_the_routers_torch_code(experts: int, top_k: int) -> None:
    """fp32 logits (no ties): the reference gives exactly what ``torch.topk`` did."""
    logits = randn(17, experts, seed=experts)
    for renormalize in (False, True):
        assert_same_routing(softmax_topk_ref(logits, top_k, renormalize),
                            legacy_softmax_topk(logits, top_k, renormalize), rtol=0)


def test_softmax_topk_strided_rows_and_block_sizes(poisoned: None) -> None:
    """Rows of a wider tensor (row stride > E), fp16, and 1 or 8 rows a program."""
    wide = randn(9, 80, dtype=torch.float16, seed=5)
    logits = wide[:, 3:63]
    want = softmax_topk_ref(logits, 6, True)
    for block_t in (1, 8):
        assert_same_routing(softmax_topk_triton(logits, 6, True, block_t=block_t), want)


def test_softmax_topk_large_logits(poisoned: None) -> None:
    """Logits far past ``exp``'s range (the max is subtracted first, as in torch)."""
    logits = randn(3, 60, seed=8, scale=100.0)
    assert_same_routing(softmax_topk_triton(logits, 4, False), softmax_topk_ref(logits, 4, False))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("experts", [60, 1000])
def test_softmax_topk_ties_go_to_the_lower_expert(poisoned: None, experts: int,
                                                  dtype: torch.dtype) -> None:
    """Rows built with equal logits (so equal probabilities): asserted ids by the rule, the
    same in the kernel and the reference, with equal weights for the tied experts.

    Row 0: four tied maxima at scattered experts, top-2: the two lowest of them.
    Row 1: a tie straddling the k-th place (one above it, three equal at k-1..k+1), top-3.
    Row 2: one dominant logit, every other probability underflows to 0 (all tied), top-4:
    the dominant expert, then experts 0, 1, 2 (skipping the dominant one's index)."""
    logits = -torch.rand(3, experts, generator=torch.Generator().manual_seed(1)) * 3 - 1
    tied = [experts - 1, 7, experts // 2 + 1, 30]
    logits[0, tied] = 1.0
    logits[1, 50] = 2.0
    logits[1, [experts - 2, 40, 9]] = 0.5
    logits[2] = -200.0
    logits[2, 1] = 100.0
    logits = logits.to(device=DEVICE, dtype=dtype)
    want_ids = {0: [7, 30], 1: [50, 9, 40], 2: [1, 0, 2, 3]}
    for top_k in (2, 3, 4):
        rows = [r for r, ids in want_ids.items() if len(ids) == top_k]
        want = torch.tensor([want_ids[r] for r in rows], dtype=I32, device=DEVICE)
        for renormalize in (False, True):
            ref = softmax_topk_ref(logits[rows], top_k, renormalize)
            got = softmax_topk_triton(logits[rows], top_k, renormalize)
            assert torch.equal(ref[1], want) and torch.equal(got[1], want), (top_k, got[1])
            assert_same_routing(got, ref)
    w, _ = softmax_topk_triton(logits[:2], 2, False)
    assert w[0, 0] == w[0, 1]  # the tied pair


def test_softmax_topk_no_tokens() -> None:
    logits = randn(0, 60)
    for fn in (softmax_topk_triton, softmax_topk_ref):
        w, ids = fn(logits, 4, True)
        assert w.shape == ids.shape == (0, 4) and w.dtype == F32 and ids.dtype == I32


def test_softmax_topk_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk(randn(2, 8), 9, True)
    with pytest.raises(ValueError, match="tokens, experts"):
        softmax_topk_triton(randn(2, 3, 8), 2, True)


# ------------------------------------------------------------------------------ grouped top-k

#: (experts, top_k, options, tokens): DeepSeek-V3 / GLM-4.5 ("noaux_tc"), DeepSeek-V2's
#: group-limited greedy (softmax, no bias), ERNIE (softmax, a bias, one group, ``norm_min``),
#: MiniMax (sigmoid, a bias, one group), GLM's small test configs, groups of one expert (a
#: group's score is then its best), every group kept.
GROUPED = [
    (256, 8, dict(n_group=8, topk_group=4, routed_scaling_factor=2.5), 3),
    (64, 6, dict(n_group=8, topk_group=3, renormalize=False, routed_scaling_factor=16.0,
                 scoring="softmax", bias=False), 5),
    (60, 4, dict(scoring="softmax", norm_min=1e-12), 4),
    (256, 8, dict(), 2),
    (16, 4, dict(n_group=4, topk_group=1), 17),
    (8, 3, dict(n_group=8, topk_group=3, renormalize=False), 3),
    (12, 5, dict(n_group=3, topk_group=3), 3),
    (96, 8, dict(n_group=6, topk_group=2, scoring="softmax", norm_min=2.0), 3),
    (32, 2, dict(n_group=4, topk_group=2, scoring="softmax", bias=False), 3),
    (32, 1, dict(n_group=4, topk_group=2), 3),
]


def grouped_args(experts: int, options: dict[str, Any], seed: int) -> dict[str, Any]:
    options = dict(options)
    bias = None
    if options.pop("bias", True):
        bias = randn(experts, seed=seed + 1, scale=0.3)
    return {"correction_bias": bias, **options}


@pytest.mark.parametrize(("experts", "top_k", "options", "tokens"), GROUPED,
                         ids=[f"E{e}-k{k}-{i}" for i, (e, k, _, _) in enumerate(GROUPED)])
def test_grouped_topk_matches_reference_and_the_routers_torch_code(
        poisoned: None, experts: int, top_k: int, options: dict[str, Any], tokens: int) -> None:
    """fp32 logits (the router's): the kernel against the reference (ids exactly, weights to
    fp32 rounding), the reference against ``GroupedTopKRouter``'s torch code (exactly)."""
    kwargs = grouped_args(experts, options, seed=experts + top_k)
    logits = randn(tokens, experts, seed=experts * 7 + top_k)
    ref = grouped_topk_ref(logits, top_k, **kwargs)
    assert_same_routing(grouped_topk_triton(logits, top_k, **kwargs), ref)
    legacy: dict[str, Any] = dict(n_group=1, topk_group=1, renormalize=True,
                                  routed_scaling_factor=1.0, scoring="sigmoid", norm_min=None)
    legacy.update(kwargs)
    assert_same_routing(ref, legacy_grouped_topk(logits, top_k, **legacy), rtol=0)


def test_grouped_topk_bf16_logits(poisoned: None) -> None:
    kwargs = grouped_args(64, dict(n_group=4, topk_group=2), seed=3)
    logits = randn(3, 64, dtype=BF16, seed=4)
    assert_same_routing(grouped_topk_triton(logits, 6, **kwargs),
                        grouped_topk_ref(logits, 6, **kwargs))


def test_grouped_topk_limits_the_groups() -> None:
    """With the groups limited the choice differs from the plain top-k (the case tests
    something), and every pick lies in one of the ``topk_group`` kept groups."""
    kwargs = grouped_args(256, dict(n_group=8, topk_group=2), seed=9)
    logits = randn(5, 256, seed=10)
    _, ids = grouped_topk_triton(logits, 8, **kwargs)
    _, plain = grouped_topk_triton(logits, 8, **{**kwargs, "topk_group": 8})
    assert not torch.equal(ids, plain)
    assert all(len(set((row // 32).tolist())) <= 2 for row in ids)


@pytest.mark.parametrize("bias", [False, True])
def test_grouped_topk_ties_go_to_the_lower_group_and_expert(poisoned: None, bias: bool) -> None:
    """16 experts in 4 groups of 4, one group kept, top-2, sigmoid scores. Groups 1 and 3 tie
    for the best (the same logits, at other places in the group): group 1 is kept. Inside
    it, experts 5 and 7 tie for the second place: 5 is picked. With a bias (zero on those
    experts) a group's score is its two best summed: still equal for groups 1 and 3."""
    logits = torch.full((1, 16), -3.0)
    logits[0, [4, 5, 7]] = torch.tensor([2.0, 1.0, 1.0])
    logits[0, [15, 12, 13]] = torch.tensor([2.0, 1.0, 1.0])
    logits[0, [0, 9]] = 1.5
    logits = logits.to(DEVICE)
    correction = None
    if bias:
        correction = torch.zeros(16, device=DEVICE)
        correction[[1, 2, 3, 10, 11]] = -0.5
    kwargs: dict[str, Any] = dict(n_group=4, topk_group=1, correction_bias=correction)
    want = torch.tensor([[4, 5]], dtype=I32, device=DEVICE)
    ref = grouped_topk_ref(logits, 2, **kwargs)
    got = grouped_topk_triton(logits, 2, **kwargs)
    assert torch.equal(ref[1], want) and torch.equal(got[1], want), got[1]
    assert_same_routing(got, ref)


def test_grouped_topk_rejects_bad_arguments() -> None:
    logits = randn(2, 12)
    cases: list[tuple[int, dict[str, Any]]] = [
        (2, dict(n_group=5)), (2, dict(n_group=3, topk_group=4)), (2, dict(scoring="relu")),
        (5, dict(n_group=3, topk_group=1)), (2, dict(correction_bias=randn(11)))]
    for top_k, kwargs in cases:
        with pytest.raises(ValueError):
            grouped_topk(logits, top_k, **kwargs)


# ------------------------------------------------------------------------------ dispatch


@CPU_ONLY
def test_cpu_dispatch_runs_the_reference_unless_triton_is_forced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def spy(name: str) -> Callable[..., Any]:
        real = getattr(mr, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)
        return run

    monkeypatch.setattr(mr, "softmax_topk_triton", spy("softmax_topk_triton"))
    monkeypatch.setattr(mr, "grouped_topk_triton", spy("grouped_topk_triton"))
    logits = randn(3, 60)
    monkeypatch.delenv("MRV2_KERNELS", raising=False)
    assert_same_routing(softmax_topk(logits, 4, True), softmax_topk_ref(logits, 4, True), 0)
    assert_same_routing(grouped_topk(logits, 4), grouped_topk_ref(logits, 4), 0)
    assert calls == []
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    assert_same_routing(softmax_topk(logits, 4, True), softmax_topk_ref(logits, 4, True))
    assert_same_routing(grouped_topk(logits, 4), grouped_topk_ref(logits, 4))
    assert calls == ["softmax_topk_triton", "grouped_topk_triton"]
    softmax_topk(logits.double(), 4, True)  # no kernel for fp64: the reference
    assert len(calls) == 2


# ------------------------------------------------------------------------------ sm_90 compile

_SM90_SCRIPT = r"""
from mrv2_kernels import moe_router as mr

f32, i32 = "*fp32", "*i32"
for dtype, experts, top_k, warps in (("*bf16", 512, 10, 1), ("*fp32", 1024, 8, 2),
                                     ("*bf16", 128, 8, 1)):
    build(mr._softmax_topk_kernel, {"logits_ptr": dtype, "w_ptr": f32, "ids_ptr": i32},
          dict(TOP_K=top_k, RENORM=True, BLOCK_T=1, BLOCK_E=experts, BLOCK_K=16, PDL=True),
          num_warps=warps)
ptrs = {"logits_ptr": f32, "bias_ptr": f32, "w_ptr": f32, "ids_ptr": i32}
for groups, size, keep, sigmoid in ((8, 32, 4, True), (1, 64, 1, False)):
    build(mr._grouped_topk_kernel, ptrs,
          dict(N_GROUP=groups, GROUP_SIZE=size, TOPK_GROUP=keep, TOP_K=8, SIGMOID=sigmoid,
               HAS_BIAS=sigmoid, RENORM=True, CLAMP=not sigmoid, BLOCK_G=groups,
               BLOCK_S=size, BLOCK_K=8, PDL=True), num_warps=1)
"""


def test_kernels_compile_for_sm90_without_repeated_math(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from sm90 import compile_for_sm90

    built = compile_for_sm90(_SM90_SCRIPT, tmp_path)
    assert sum(len(v) for v in built.values()) == 5, built
