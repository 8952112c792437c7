"""Block-quantized FP8 linear layers: weight (de)quantization, per-token-group activation
quantization and the FP8 GEMM, Triton against the torch reference (and the reference against
the unquantized product)."""

from __future__ import annotations

import os
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

from mrv2_kernels import fp8_gemm as fg
from mrv2_kernels.fp8_gemm import (
    FP8_DTYPE,
    FP8_MAX,
    block_fp8_linear,
    block_fp8_linear_dequant,
    block_fp8_linear_ref,
    block_fp8_linear_triton,
    dequantize_weight_block_fp8,
    fp8_gemm_tiles,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_ref,
    per_token_group_quant_fp8_triton,
    quantize_weight_block_fp8,
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
GPU = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
SHAPES = [(1, 96, 80), (5, 256, 384), (33, 300, 200)]  # (M, N, K): none all multiples of 128


@pytest.fixture
def poisoned(poison: Callable[[ModuleType], None]) -> None:
    poison(fg)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _acts(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Activations with outlier features and rows of different sizes (as hidden states)."""
    g = _gen(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(0.5 * torch.randn(1, k, generator=g))
    return (x * torch.exp(torch.randn(m, 1, generator=g))).to(dtype).to(DEVICE)


def _weight(n: int, k: int, seed: int = 1) -> torch.Tensor:
    return (torch.randn(n, k, generator=_gen(seed)) / k**0.5).to(DEVICE)


def _close(got: torch.Tensor, want: torch.Tensor, cuda_mma: bool = False) -> None:
    """Within 2 output ulps plus a small share of the largest output: fp32 summation order on
    the interpreter; on the GPU the fp8 MMA accumulates each 128-long step in reduced
    precision (``cuda_mma``)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got.float()).all()
    ulp = {F32: 2.0**-23, BF16: 2.0**-7, F16: 2.0**-10}[want.dtype]
    err = (got.float() - want.float()).abs()
    scale = want.float().abs().max().item()
    share = 2.0**-10 if cuda_mma and DEVICE == "cuda" else 2.0**-17
    bound = 2 * ulp * want.float().abs() + share * scale
    assert (err <= bound).all(), f"max error {err.max().item():.4g} at scale {scale:.4g}"


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


# ------------------------------------------------------------------------------- weights


@pytest.mark.parametrize(("n", "k", "block"), [(96, 80, (128, 128)), (300, 200, (128, 128)),
                                               (256, 384, (128, 128)), (100, 70, (32, 64))])
def test_weight_round_trip(n: int, k: int, block: tuple[int, int]) -> None:
    w = _weight(n, k) * torch.exp(torch.randn(n, 1, generator=_gen(2))).to(DEVICE)
    q, s = quantize_weight_block_fp8(w, block)
    assert q.dtype == FP8_DTYPE and q.shape == (n, k) and q.is_contiguous()
    assert s.dtype == F32 and s.shape == (-(-n // block[0]), -(-k // block[1]))
    # each block's largest entry maps to +-448
    blocks = fg._padded_blocks(q.float().abs(), *block)
    assert (blocks.amax(dim=(1, 3)) == FP8_MAX).all()
    dq = dequantize_weight_block_fp8(q, s, block, F32)
    per_elem = fg._padded_blocks(torch.ones_like(w), *block) * s[:, None, :, None]
    s_full = per_elem.view(per_elem.shape[0] * block[0], -1)[:n, :k]
    # half an e4m3 spacing: 2^-4 relative for normals, 2^-10 of the scale for subnormals
    bound = 2.0**-4 * w.abs() + 2.0**-10 * s_full + 1e-12
    assert ((dq - w).abs() <= bound).all()
    assert _rel(dq, w) < 0.03
    bf = dequantize_weight_block_fp8(q, s, block, BF16)
    assert bf.dtype == BF16 and torch.equal(bf, dq.to(BF16))


def test_zero_block_gets_unit_scale() -> None:
    w = _weight(256, 256)
    w[128:, :128] = 0
    q, s = quantize_weight_block_fp8(w)
    assert s[1, 0].item() == 1.0 and (q[128:, :128].float() == 0).all()
    assert torch.isfinite(dequantize_weight_block_fp8(q, s, dtype=F32)).all()


# --------------------------------------------------------------------- activation groups


@pytest.mark.parametrize("dtype", [BF16, F32, F16])
@pytest.mark.parametrize(("m", "k", "group"), [(1, 80, 128), (5, 384, 128), (33, 200, 128),
                                               (7, 100, 32)])
def test_group_quant_matches_reference(m: int, k: int, group: int, dtype: torch.dtype,
                                       poisoned: None) -> None:
    x = _acts(m, k, dtype, seed=m + k)
    q, s = per_token_group_quant_fp8_triton(x, group)
    q_ref, s_ref = per_token_group_quant_fp8_ref(x, group)
    assert q.dtype == FP8_DTYPE and q.shape == (m, k)
    assert s.shape == (m, -(-k // group)) and s.dtype == F32
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())  # every rounding, subnormals included


def test_group_quant_rounds_like_torch() -> None:
    """Groups whose amax is 448 (scale 1): every finite e4m3 value, the midpoints between
    neighbours (ties to even), values just off the midpoints and below the subnormals."""
    grid = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    grid = grid[grid.isfinite() & (grid >= 0)].sort().values
    mid = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mid, mid * (1 + 2.0**-12), mid * (1 - 2.0**-12),
                      torch.tensor([2.0**-11, 2.0**-10, 3 * 2.0**-11, 1e-30])])
    vals = torch.cat([vals, -vals])
    rows = -(-vals.numel() // 127)
    body = torch.full((rows * 127,), 0.5)
    body[: vals.numel()] = vals
    x = torch.cat([torch.full((rows, 1), FP8_MAX), body.view(rows, 127)], dim=1).to(DEVICE)
    q, s = per_token_group_quant_fp8_triton(x)
    assert (s == 1.0).all()
    assert torch.equal(q.float(), x.to(FP8_DTYPE).float())


def test_zero_group_and_leading_dims(poisoned: None) -> None:
    x = _acts(6, 256, BF16).view(2, 3, 256)
    x[1, 2, 128:] = 0
    q, s = per_token_group_quant_fp8_triton(x)
    assert q.shape == (2, 3, 256) and s.shape == (2, 3, 2)
    assert s[1, 2, 1].item() == pytest.approx(1e-10 / 448) and (q[1, 2, 128:].float() == 0).all()
    q_ref, s_ref = per_token_group_quant_fp8_ref(x)
    assert torch.equal(s, s_ref) and torch.equal(q.float(), q_ref.float())


# ---------------------------------------------------------------------------- the linear


def _layer(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0,
           block: tuple[int, int] = (128, 128)
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    w = _weight(n, k, seed + 1)
    q, s = quantize_weight_block_fp8(w, block)
    b = torch.randn(n, generator=_gen(seed + 2)).to(dtype).to(DEVICE) if bias else None
    return _acts(m, k, dtype, seed), q, s, b, w


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_linear_matches_reference(m: int, n: int, k: int, dtype: torch.dtype, bias: bool,
                                  poisoned: None) -> None:
    x, q, s, b, _ = _layer(m, n, k, dtype, bias, seed=m * 3 + n)
    _close(block_fp8_linear_triton(x, q, s, b), block_fp8_linear_ref(x, q, s, b), cuda_mma=True)


@pytest.mark.parametrize(("fuse", "split", "block_k", "block_n", "block_m"), [
    (False, 1, None, None, None), (True, 1, None, None, None), (True, 3, None, 32, None),
    (False, 2, 64, 32, 16), (False, 3, 32, 16, 16), (True, 2, None, 64, 32),
])
def test_linear_paths(fuse: bool, split: int, block_k: int | None, block_n: int | None,
                      block_m: int | None, poisoned: None) -> None:
    """Fused / separate activation quantization, split-K (sum kernel), steps shorter than the
    scale group, tiles narrower and wider than the weight block."""
    x, q, s, b, _ = _layer(5, 200, 384, BF16, True, seed=11)
    got = block_fp8_linear_triton(x, q, s, b, fuse_quant=fuse, split_k=split, block_k=block_k,
                                  block_n=block_n, block_m=block_m)
    _close(got, block_fp8_linear_ref(x, q, s, b), cuda_mma=True)


@pytest.mark.parametrize("fuse", [False, True])
def test_small_weight_blocks_and_out_dtype(fuse: bool, poisoned: None) -> None:
    block = (32, 64)
    x, q, s, b, _ = _layer(3, 100, 160, F16, True, seed=5, block=block)
    got = block_fp8_linear_triton(x, q, s, b, block, out_dtype=F32, fuse_quant=fuse)
    _close(got, block_fp8_linear_ref(x, q, s, b, block, out_dtype=F32), cuda_mma=True)


def test_leading_dims_strided_rows(poisoned: None) -> None:
    x, q, s, _, _ = _layer(6, 96, 80, BF16, False, seed=3)
    wide = torch.randn(6, 160).to(BF16).to(DEVICE)
    wide[:, :80] = x
    strided = wide[:, :80]
    assert not strided.is_contiguous()
    want = block_fp8_linear_ref(x, q, s)
    _close(block_fp8_linear_triton(strided, q, s), want, cuda_mma=True)
    got = block_fp8_linear_triton(x.view(2, 3, 80), q, s)
    assert got.shape == (2, 3, 96)
    _close(got.view(6, 96), want, cuda_mma=True)
    assert block_fp8_linear_triton(x[:0], q, s).shape == (0, 96)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_close_to_unquantized_product(m: int, n: int, k: int) -> None:
    """FP8 weights and activations: a few % relative error against the fp32 product."""
    x, q, s, b, w = _layer(m, n, k, BF16, True, seed=m + 2 * k)
    exact = x.float() @ w.T + b.float()
    assert _rel(block_fp8_linear_ref(x, q, s, b), exact) < 0.06
    assert _rel(block_fp8_linear_triton(x, q, s, b), exact) < 0.06
    assert _rel(block_fp8_linear_dequant(x, q, s, b), exact) < 0.04  # weights only


def test_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    x, q, s, b, _ = _layer(2, 96, 80, BF16, True, seed=9)
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    assert torch.equal(block_fp8_linear(x, q, s, b), block_fp8_linear_triton(x, q, s, b))
    got_q, got_s = per_token_group_quant_fp8(x)
    want_q, want_s = per_token_group_quant_fp8_triton(x)
    assert torch.equal(got_q.float(), want_q.float()) and torch.equal(got_s, want_s)
    if DEVICE == "cpu":
        monkeypatch.delenv("MRV2_KERNELS")
        assert torch.equal(block_fp8_linear(x, q, s, b), block_fp8_linear_dequant(x, q, s, b))
        assert block_fp8_linear(x, q, s, b).dtype == BF16


def _bad_calls() -> list[tuple[str, Callable[[], object]]]:
    x, q, s, _, _ = _layer(2, 96, 80, BF16, False)
    return [
        ("w_scale_inv", lambda: block_fp8_linear_triton(x, q, s[:, :0])),
        ("w_fp8", lambda: block_fp8_linear_triton(x, q.float(), s)),
        ("x", lambda: block_fp8_linear_triton(x[:, :64], q, s)),
        ("bias", lambda: block_fp8_linear_triton(x, q, s, torch.zeros(3, device=DEVICE))),
        ("block_k", lambda: block_fp8_linear_triton(x, q, s, block_k=256)),
        ("fuse_quant", lambda: block_fp8_linear_triton(x, q, s, block_k=64, fuse_quant=True)),
        ("block", lambda: block_fp8_linear_ref(x, q, s, block=(0, 128))),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_arguments_name_the_argument(index: int) -> None:
    name, call = _bad_calls()[index]
    with pytest.raises(ValueError, match=rf"^{name} "):
        call()


def test_tile_plan() -> None:
    cpu = fp8_gemm_tiles(4, 256, 384, (128, 128), torch.device("cpu"))
    assert cpu.block_k == 128 and cpu.fuse_quant and cpu.split_k == 1
    assert fp8_gemm_tiles(4, 256, 384, (128, 96), torch.device("cpu")).block_k == 32
    if DEVICE == "cuda":
        dev = torch.device("cuda")
        decode = fp8_gemm_tiles(1, 4096, 12288, (128, 128), dev)  # 64 slices of 96 steps
        wide = fp8_gemm_tiles(1, 14336, 4096, (128, 128), dev)  # 224 slices
        prefill = fp8_gemm_tiles(4096, 4096, 4096, (128, 128), dev)
        assert (decode.block_m, decode.block_n, decode.fuse_quant) == (16, 64, False)
        assert decode.split_k >= 2 and wide.split_k == 1
        assert (prefill.block_m, prefill.block_n, prefill.num_warps) == (64, 128, 4)
        assert not prefill.fuse_quant and prefill.split_k == 1


# ---------------------------------------------------------------------------------- GPU only


@GPU
@pytest.mark.parametrize("m", [1, 16, 256])
def test_gpu_large_layer(m: int) -> None:
    x, q, s, b, w = _layer(m, 4096, 4096, BF16, True, seed=m)
    want = block_fp8_linear_ref(x, q, s, b)
    got = block_fp8_linear_triton(x, q, s, b)
    _close(got, want, cuda_mma=True)
    assert _rel(got, x.float() @ w.T + b.float()) < 0.06
    unfused = block_fp8_linear_triton(x, q, s, b, fuse_quant=False, split_k=1)
    _close(unfused, want, cuda_mma=True)


@GPU
def test_gpu_prefill_tiles_and_graph_capture() -> None:
    x, q, s, _, _ = _layer(1000, 1536, 2048, BF16, False, seed=4)
    _close(block_fp8_linear_triton(x, q, s), block_fp8_linear_ref(x, q, s), cuda_mma=True)
    small = x[:3].clone()
    want = block_fp8_linear_triton(small, q, s)  # compiles (and warms) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = block_fp8_linear_triton(small, q, s)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_dequantized_weight_is_contiguous_when_blocks_overhang() -> None:
    """A weight whose K is no multiple of the block (SmolLM2's 576) dequantizes to a
    contiguous tensor, not a view of the padded blocks: the CPU's layers (dequantized once)
    only take their fast layout on contiguous weights (a strided view ran the whole CPU
    decode step 40x slower)."""
    w = torch.randn(96, 200, generator=_gen(3))
    w8, scale = quantize_weight_block_fp8(w, (128, 128))
    out = dequantize_weight_block_fp8(w8, scale, (128, 128), torch.float32)
    assert out.shape == (96, 200) and out.is_contiguous()


@pytest.mark.parametrize("fuse", [False, True])
def test_strided_scales_and_bias_read_by_their_strides(fuse: bool, poisoned: None) -> None:
    """Per-row scales ``[N, K/128]`` and the bias given as strided views (a column-major
    buffer, every other entry) give the contiguous tensors' product."""
    x, q, s, b, _ = _layer(3, 96, 256, F32, True, seed=8, block=(1, 128))
    assert b is not None
    s_view = s.T.contiguous().T
    b_view = torch.stack([b, torch.zeros_like(b)], 1).reshape(-1)[::2]
    assert not s_view.is_contiguous() and not b_view.is_contiguous()
    got = block_fp8_linear_triton(x, q, s_view, b_view, (1, 128), fuse_quant=fuse)
    _close(got, block_fp8_linear_ref(x, q, s, b, (1, 128)), cuda_mma=True)
