"""The Triton fused MoE (align, grouped gate/up and down GEMMs, combine) against its torch
reference."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

try:
    import mrv2_kernels  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from mrv2_kernels import fused_moe as fm
from mrv2_kernels import moe_align as ma
from mrv2_kernels.fused_moe import (
    fused_moe,
    fused_moe_ref,
    fused_moe_triton,
    moe_align,
    moe_align_ref,
    moe_max_blocks,
    moe_tiles,
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
GPU = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
#: Small tiles, so the interpreter runs several blocks and slices of each product.
SMALL = {"block_m": 16, "block_n1": 16, "block_k1": 16, "block_n2": 16, "block_k2": 32}


def _experts(num_experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return w13.to(dtype).to(DEVICE), w2.to(dtype).to(DEVICE)


def _tokens(num_tokens: int, hidden: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, hidden, generator=g).to(dtype).to(DEVICE)


def _routing(num_tokens: int, top_k: int, num_experts: int, seed: int = 2,
             allowed: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k of random logits (over the ``allowed`` experts only, if given)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if allowed is not None:
        keep = torch.zeros(num_experts, dtype=torch.bool)
        keep[allowed] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return weights.to(DEVICE), ids.to(torch.int32).to(DEVICE)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within a couple of output ulps plus a small fraction of the output scale: gate/up and
    the activation are rounded to the dtype after fp32 sums taken in another order, so an
    intermediate may differ by one ulp."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got.float()).all()
    ulp = {F32: 2.0**-23, BF16: 2.0**-7, F16: 2.0**-10}[want.dtype]
    err = (got.float() - want.float()).abs()
    scale = want.float().abs().max().item() if want.numel() else 0.0
    bound = 2 * ulp * want.float().abs() + (64 if want.dtype == F32 else 1) * ulp * scale
    assert (err <= bound).all(), f"max error {err.max().item():.4g} at scale {scale:.4g}"


def _poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer the Triton path allocates starts as NaN (floats) or 1 (ints: a real pair
    index and expert, so an unwritten slot computes something wrong instead of nothing)."""
    def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
              ) -> torch.Tensor:
        fill = float("nan") if dtype.is_floating_point else 1
        return torch.full(shape, fill, dtype=dtype, device=device)

    for module in (fm, ma):  # the GEMMs' buffers and the align step's
        monkeypatch.setattr(module, "_empty", empty)


# ------------------------------------------------------------------------------------- align


def _check_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    got = moe_align(topk_ids, num_experts, block_m)
    want = moe_align_ref(topk_ids, num_experts, block_m)
    max_blocks = moe_max_blocks(topk_ids.numel(), num_experts, block_m)
    assert got[0].shape == (max_blocks * block_m,) and got[1].shape == (max_blocks,)
    assert got[2].shape == (1,)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.int32
        assert torch.equal(g.cpu(), w.cpu())


@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "block_m"), [
    (5, 2, 8, 16),      # one chunk (the one-program path), empty experts
    (1, 1, 1, 16),
    (64, 2, 7, 16),     # 128 pairs: still one program
    (43, 3, 7, 16),     # 129 pairs: two chunks (histogram, scan, scatter)
    (700, 2, 5, 32),    # 11 chunks
    (200, 8, 256, 16),  # 256 experts over several chunks
    (3, 4, 256, 64),
])
def test_align_matches_reference(num_tokens: int, top_k: int, num_experts: int,
                                 block_m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _poisoned(monkeypatch)
    _, ids = _routing(num_tokens, top_k, num_experts, seed=num_tokens)
    _check_align(ids, num_experts, block_m)
    _check_align(ids.long(), num_experts, block_m)


def test_align_groups_padding_and_blocks() -> None:
    # Experts 0, 2, 5 of 6: groups in expert order, sentinel-padded; no block for the others.
    ids = torch.tensor([[5, 0], [2, 5], [5, 2], [0, 5]], dtype=torch.int32, device=DEVICE)
    sorted_ids, block_expert, num_post = moe_align(ids, 6, 4)
    sentinel = 8
    assert num_post.tolist() == [12]
    assert sorted_ids[:12].tolist() == [1, 6, sentinel, sentinel, 2, 5, sentinel, sentinel,
                                        0, 3, 4, 7]
    assert (sorted_ids[12:] == sentinel).all()
    assert block_expert.tolist()[:3] == [0, 2, 5] and (block_expert[3:] == -1).all()
    assert block_expert.numel() == moe_max_blocks(8, 6, 4) == 2 + 6


def test_align_all_pairs_to_one_expert_over_chunks() -> None:
    ids = torch.full((600, 2), 3, dtype=torch.int32, device=DEVICE)
    _check_align(ids, 4, 64)
    sorted_ids, block_expert, num_post = moe_align(ids, 4, 64)
    assert num_post.item() == 1216
    assert torch.equal(sorted_ids[:1200].cpu(), torch.arange(1200, dtype=torch.int32))
    assert (block_expert[:19] == 3).all() and (block_expert[19:] == -1).all()


@pytest.mark.parametrize(("num_tokens", "valid", "first_token"), [
    (7, 5, 0),     # one program: the last two tokens are padding
    (7, 0, 0),     # all padding: no block at all
    (70, 61, 0),   # 140 pairs over two chunks, the padding in the second
    (70, 100, 40),  # a later chunk of tokens (first_token) with its padding from row 60 on
])
def test_align_leaves_out_padding_tokens(num_tokens: int, valid: int, first_token: int,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``valid_tokens`` (a CUDA graph's real token count, on the device): the pairs of the
    rows from ``valid_tokens - first_token`` on are left out, as if those rows were absent
    (the sentinel stays ``T*K``)."""
    _poisoned(monkeypatch)
    top_k, num_experts, block_m = 2, 6, 16
    _, ids = _routing(num_tokens, top_k, num_experts, seed=num_tokens + valid)
    limit = torch.tensor([valid], dtype=torch.int32, device=DEVICE)
    got = moe_align(ids, num_experts, block_m, limit, first_token)
    want = moe_align_ref(ids, num_experts, block_m, limit, first_token)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w.cpu())
    real = max(0, min(num_tokens, valid - first_token))
    sorted_ids, _, num_post = got
    pairs = sorted_ids[: int(num_post)]
    kept = pairs[pairs < num_tokens * top_k]
    assert sorted(kept.tolist()) == list(range(real * top_k))  # every real pair, once
    alone = moe_align_ref(ids[:real], num_experts, block_m)  # the same groups and blocks
    assert int(num_post) == int(alone[2]) and torch.equal(got[1][: alone[1].numel()].cpu(),
                                                         alone[1].cpu())


@pytest.mark.parametrize("fused_combine", [False, True])
def test_padding_tokens_are_not_computed(fused_combine: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows from ``valid_tokens`` on route to no expert: the real rows equal the reference on
    them alone, over chunks too; the counts reset; the reference does the same."""
    w13, w2 = _experts(6, 32, 16, BF16, seed=13)
    x = _tokens(9, 32, BF16)
    weights, ids = _routing(9, 2, 6)
    limit = torch.tensor([6], dtype=torch.int32, device=DEVICE)
    want = fused_moe_ref(x[:6], w13, w2, weights[:6], ids[:6])
    ref = fused_moe_ref(x, w13, w2, weights, ids, valid_tokens=limit)
    assert torch.equal(ref[:6], want) and not ref[6:].any()
    _poisoned(monkeypatch)
    for chunk in (8192, 4):  # the second chunk starts at row 4
        got = fused_moe_triton(x, w13, w2, weights, ids, fused_combine=fused_combine,
                               valid_tokens=limit, chunk_tokens=chunk, **SMALL)
        _close(got[:6], want)
    for buffer in fm._COUNTERS.get(str(x.device), []):
        assert not buffer.any()


# ------------------------------------------------------------------------------------ fused


CASES = {
    # name: (T, K, E, H, I, allowed experts or None)
    "empty_experts": (6, 2, 8, 48, 40, [0, 2, 3, 6]),
    "one_token": (1, 3, 6, 32, 16, None),
    "k1": (5, 1, 4, 32, 24, None),
    "odd_sizes": (5, 2, 5, 37, 23, None),
    "many_experts": (3, 4, 256, 32, 16, None),
}


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference(case: str, dtype: torch.dtype,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    num_tokens, top_k, num_experts, hidden, inter, allowed = CASES[case]
    w13, w2 = _experts(num_experts, hidden, inter, dtype, seed=hidden)
    x = _tokens(num_tokens, hidden, dtype)
    weights, ids = _routing(num_tokens, top_k, num_experts, allowed=allowed)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    _poisoned(monkeypatch)
    _close(fused_moe_triton(x, w13, w2, weights, ids, **SMALL), want)


@pytest.mark.parametrize("fused_combine", [False, True])
def test_combine_paths_agree_and_reset_their_counts(fused_combine: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # A token may name one expert in two slots: both rows land in one block.
    w13, w2 = _experts(5, 32, 16, BF16, seed=11)
    x = _tokens(6, 32, BF16)
    weights, ids = _routing(6, 3, 5)
    ids[1, 2] = ids[1, 0]
    ids[4] = 2
    want = fused_moe_ref(x, w13, w2, weights, ids)
    _poisoned(monkeypatch)
    got = fused_moe_triton(x, w13, w2, weights, ids, fused_combine=fused_combine, **SMALL)
    _close(got, want)
    assert torch.equal(fused_moe_triton(x, w13, w2, weights, ids, **SMALL), got)
    for buffer in fm._COUNTERS.get(str(x.device), []):
        assert not buffer.any()


@pytest.mark.parametrize("top_k", [1, 2])
def test_all_tokens_to_one_expert(top_k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # 20 pairs of expert 2: two blocks of one expert; with K=2 the other slot is random.
    num_tokens = 20 if top_k == 1 else 10
    w13, w2 = _experts(4, 32, 16, BF16, seed=5)
    x = _tokens(num_tokens, 32, BF16)
    weights, ids = _routing(num_tokens, top_k, 4, allowed=[0, 1, 3])
    ids[:, 0] = 2
    want = fused_moe_ref(x, w13, w2, weights, ids)
    _poisoned(monkeypatch)
    _close(fused_moe_triton(x, w13, w2, weights, ids, **SMALL), want)


def test_fp16_default_tiles_int64_ids_strided_inputs() -> None:
    w13, w2 = _experts(5, 40, 24, F16, seed=7)
    wide = _tokens(4, 80, F16)
    x = wide[:, :40]  # rows 80 apart
    weights, ids = _routing(4, 2, 5)
    want = fused_moe_ref(x.contiguous(), w13, w2, weights, ids)
    wt = torch.stack([weights, torch.rand_like(weights)], dim=2).flatten(1)[:, ::2]
    assert torch.equal(wt, weights) and not wt.is_contiguous()
    _close(fused_moe_triton(x, w13, w2, wt, ids.long()), want)


def test_chunked_tokens_and_determinism() -> None:
    w13, w2 = _experts(4, 32, 16, BF16, seed=9)
    x = _tokens(7, 32, BF16)
    weights, ids = _routing(7, 2, 4)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    first = fused_moe_triton(x, w13, w2, weights, ids)
    _close(first, want)
    assert torch.equal(fused_moe_triton(x, w13, w2, weights, ids), first)
    _close(fused_moe_triton(x, w13, w2, weights, ids, chunk_tokens=3), want)


def test_no_tokens() -> None:
    w13, w2 = _experts(3, 32, 16, BF16)
    x = _tokens(0, 32, BF16)
    weights, ids = _routing(0, 2, 3)
    out = fused_moe_triton(x, w13, w2, weights, ids)
    assert out.shape == (0, 32) and out.dtype == BF16
    assert fused_moe(x, w13, w2, weights, ids).shape == (0, 32)


def _bad_calls() -> list[tuple[str, Callable[[], object]]]:
    w13, w2 = _experts(3, 32, 16, F32)
    x = _tokens(2, 32, F32)
    weights, ids = _routing(2, 2, 3)
    return [
        ("w13", lambda: fused_moe_triton(x, w13[:, :31], w2, weights, ids)),
        ("w2", lambda: fused_moe_triton(x, w13, w2[:, :, :8], weights, ids)),
        ("x", lambda: fused_moe_triton(x[0], w13, w2, weights, ids)),
        ("topk_ids", lambda: fused_moe_triton(x, w13, w2, weights, ids[:1])),
        ("topk_weights", lambda: fused_moe_triton(x, w13, w2, weights[:, :1], ids)),
        ("topk_ids", lambda: fused_moe_triton(x, w13, w2, weights, ids.float())),
        ("topk_weights", lambda: fused_moe_triton(x, w13, w2, ids, ids)),
        ("w2", lambda: fused_moe_triton(x, w13, w2.to(BF16), weights, ids)),
        ("w13", lambda: fused_moe_triton(x, w13.transpose(1, 2).contiguous().transpose(1, 2),
                                         w2, weights, ids)),
        ("block_m", lambda: fused_moe_triton(x, w13, w2, weights, ids, block_m=24)),
        ("block_m", lambda: moe_align(ids, 3, 12)),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_arguments_name_the_argument(index: int) -> None:
    name, call = _bad_calls()[index]
    with pytest.raises(ValueError, match=rf"^{name} "):
        call()


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU dispatch")
def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    w13, w2 = _experts(4, 32, 16, BF16)
    x = _tokens(3, 32, BF16)
    weights, ids = _routing(3, 2, 4)
    monkeypatch.delenv("MRV2_KERNELS", raising=False)
    assert torch.equal(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights,
                                                                          ids))
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    assert torch.equal(fused_moe(x, w13, w2, weights, ids),
                       fused_moe_triton(x, w13, w2, weights, ids))


def test_tile_plan() -> None:
    cpu = moe_tiles(8, 2, 4, 32, 16, torch.device("cpu"))
    assert cpu.block_m == 16
    if DEVICE == "cuda":
        dev = torch.device("cuda")
        decode = moe_tiles(1, 8, 128, 2048, 768, dev)
        prefill = moe_tiles(8192, 8, 128, 2048, 768, dev)
        assert decode.block_m == 16 and decode.group_m == 1 and decode.fused_combine
        assert prefill.block_m >= 64 and not prefill.fused_combine


# ---------------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("num_tokens", [1, 8, 64, 300, 2048])
def test_qwen3_moe_shapes(num_tokens: int) -> None:
    w13, w2 = _experts(128, 2048, 768, BF16)
    x = _tokens(num_tokens, 2048, BF16)
    weights, ids = _routing(num_tokens, 8, 128, seed=num_tokens)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    got = fused_moe_triton(x, w13, w2, weights, ids)
    _close(got, want)
    assert torch.equal(fused_moe_triton(x, w13, w2, weights, ids), got)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("dtype", [F32, F16])
def test_many_experts_gpu(dtype: torch.dtype) -> None:
    w13, w2 = _experts(256, 1024, 200, dtype)
    x = _tokens(333, 1024, dtype)
    weights, ids = _routing(333, 8, 256, allowed=list(range(0, 256, 3)))
    _close(fused_moe_triton(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids))


@pytest.mark.gpu
@GPU
def test_align_large_gpu() -> None:
    _, ids = _routing(8192, 8, 128)
    _check_align(ids, 128, 64)
    _check_align(ids, 128, 16)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("num_tokens", [1, 16, 96])
def test_cuda_graph_replay_with_new_routings(num_tokens: int) -> None:
    w13, w2 = _experts(64, 512, 256, BF16)
    x = _tokens(num_tokens, 512, BF16)
    weights, ids = _routing(num_tokens, 4, 64)
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    for seed in range(3):
        new_weights, new_ids = _routing(num_tokens, 4, 64, seed=100 + seed,
                                        allowed=list(range(seed, 64, 2 + seed)))
        x.copy_(_tokens(num_tokens, 512, BF16, seed=200 + seed))
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        eager = fused_moe(x, w13, w2, weights, ids)
        assert torch.equal(out, eager)
        _close(out, fused_moe_ref(x, w13, w2, weights, ids))


# ------------------------------------------------------------------- the benchmark's arithmetic


def test_bench_arithmetic() -> None:
    from mrv2_kernels import bench_moe as bench

    assert bench.layer_flops(2, 8, 2048, 768) == 2 * 2 * 8 * 3 * 2048 * 768
    per_expert = 3 * 2048 * 768 * 2
    assert bench.layer_bytes(4, 10) == 10 * per_expert + 2 * 4 * 2048 * 2
    assert bench.floor_us(4, 10, 1e12) == pytest.approx(bench.layer_bytes(4, 10) / 1e6)
    row = bench.Row(tokens=4, experts_hit=10, triton_us=50.0, ref_us=500.0, floor_us=25.0,
                    tiles="m16")
    assert row.floor_fraction == 0.5
    assert row.tflops == pytest.approx(bench.layer_flops(4) / 50e-6 / 1e12)
    table = bench.format_table([row], 4.0e12).splitlines()
    assert "4000 GB/s" in table[0] and table[1].split()[:3] == ["T", "experts", "triton"]
    assert table[2].split()[:7] == ["4", "10.0", "50.0", "500.0", "25.0", "0.50",
                                    f"{row.tflops:.1f}"]
    ids = torch.tensor([[3, 1], [1, 7]])
    assert bench.experts_hit(ids, 8) == 3


# ------------------------------------------------------------------ the FP8 keywords, unused


def test_unquantized_keywords_change_nothing() -> None:
    """Without scales the FP8 keywords are inert: the bf16 path and its tiles as before
    (FP8 weights: tests/kernels/test_fused_moe_fp8.py)."""
    w13, w2 = _experts(4, 32, 16, BF16, seed=3)
    x = _tokens(3, 32, BF16)
    weights, ids = _routing(3, 2, 4)
    plain = fused_moe_triton(x, w13, w2, weights, ids, **SMALL)
    assert torch.equal(fused_moe_triton(x, w13, w2, weights, ids, w13_scale=None,
                                        w2_scale=None, block=(128, 128), **SMALL), plain)
    assert torch.equal(fused_moe_ref(x, w13, w2, weights, ids, block=(1, 64)),
                       fused_moe_ref(x, w13, w2, weights, ids))
    plan = moe_tiles(3, 2, 4, 32, 16, torch.device(DEVICE))
    assert plan == moe_tiles(3, 2, 4, 32, 16, torch.device(DEVICE), None)
    assert not plan.fuse_x_quant and plan.act_quant == "kernel"  # the FP8-only fields


def test_bench_fp8_arithmetic() -> None:
    from mrv2_kernels import bench_moe as bench

    layer = bench.LAYERS["glm-4.5-air"]
    assert (layer.hidden, layer.inter, layer.experts, layer.top_k) == (4096, 1408, 128, 8)
    per_expert = 3 * 4096 * 1408 + 4 * (2816 * 32 + 4096 * 11)  # fp8 weights, fp32 scales
    assert bench.fp8_layer_bytes(4, 10, layer) == 10 * per_expert + 2 * 4 * 4096 * 2
    row = bench.Fp8Row(tokens=4, experts_hit=10, bf16_us=60.0, fp8_us=40.0, floor_us=20.0,
                       flops=8e6, tiles="m16")
    assert row.speedup == 1.5 and row.floor_fraction == 0.5
    assert row.tflops == pytest.approx(8e6 / 40e-6 / 1e12)
    table = bench.format_fp8_table([row], 4.0e12, "glm-4.5-air").splitlines()
    assert "glm-4.5-air" in table[0] and "4000 GB/s" in table[0]
    assert table[1].split()[:6] == ["T", "experts", "bf16", "µs", "fp8", "µs"]
    assert table[2].split()[:8] == ["4", "10.0", "60.0", "40.0", "1.50", "20.0", "0.50",
                                    f"{row.tflops:.1f}"]
    for tokens in (1, 64, 8192):  # every sweep choice passes the FP8 tile rules
        plan = moe_tiles(tokens, 8, 128, 4096, 1408, torch.device("cpu"), (1, 128))
        for tiles in bench._fp8_sweep_tiles(tokens, layer):
            fm._check_fp8_tiles(plan._replace(**tiles), 128, False)
    # the engine's layout of a checkpoint: 128x128 blocks per shard, scales per row
    w13, w2 = _experts(2, 48, 40, F32, seed=4)
    fp8 = bench.fp8_experts(w13.cpu(), w2.cpu())
    assert fp8["w13"].shape == (2, 80, 48) and fp8["w13_scale"].shape == (2, 80, 1)
    assert fp8["w2_scale"].shape == (2, 48, 1) and fp8["block"] == (1, 128)
    gate_scale = fp8["w13_scale"][:, :40]  # the gate shard's one block, on each of its rows
    assert (gate_scale == gate_scale[:, :1]).all()
    assert not torch.equal(fp8["w13_scale"][:, 40], fp8["w13_scale"][:, 39])
