"""The fused MoE with FP8 block-quantized expert weights: the Triton path against the FP8
reference (both against the unquantized experts), every place the activations can be
quantized, the engine's per-row scale layout, routing corner cases and argument checks."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    import mrv2_kernels  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from mrv2_kernels import fp8_gemm as fg
from mrv2_kernels import fused_moe as fm
from mrv2_kernels import moe_align as ma
from mrv2_kernels.fp8_gemm import FP8_DTYPE, per_token_group_quant_fp8_ref
from mrv2_kernels.fused_moe import fused_moe, fused_moe_ref, fused_moe_triton, moe_tiles
from mrv2_kernels.fused_moe_fp8 import (
    dequantize_experts,
    expand_scales_per_row,
    quant_dequant_groups,
    quantize_experts_fp8,
)

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("Triton kernels need TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
GPU = pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
ROW, CKPT = (1, 128), (128, 128)  # the engine's per-row scales; the checkpoints' blocks
#: Small tiles (the K steps divide 128), so the interpreter runs several blocks and slices.
SMALL = {"block_m": 16, "block_n1": 16, "block_k1": 32, "block_n2": 32, "block_k2": 16}
MID = {"block_m": 16, "block_n1": 32, "block_k1": 64, "block_n2": 64, "block_k2": 64}
KSTEP = 16  # the shortest K step the tests use
if DEVICE == "cuda":  # an fp8 tl.dot needs K steps of at least 32 there
    SMALL, KSTEP = {**SMALL, "block_k2": 32}, 32
ULP = {F32: 2.0**-23, BF16: 2.0**-7, F16: 2.0**-10}


class Experts:
    """FP8 experts as a layer holds them, and the fp32 weights they were quantized from."""

    def __init__(self, num_experts: int, hidden: int, inter: int, block: tuple[int, int],
                 seed: int = 0) -> None:
        g = torch.Generator(device=DEVICE).manual_seed(seed)

        def weight(n: int, k: int) -> torch.Tensor:  # rows of different sizes
            w = torch.randn(num_experts, n, k, generator=g, device=DEVICE) / k**0.5
            return w * torch.exp(0.25 * torch.randn(num_experts, n, 1, generator=g,
                                                    device=DEVICE))

        gate, up, down = weight(inter, hidden), weight(inter, hidden), weight(hidden, inter)
        self.block = block
        self.w13_real = torch.cat([gate, up], dim=1)
        self.w2_real = down
        if block == ROW:
            # As the engine loads a checkpoint: gate, up and down each quantized in 128x128
            # blocks, the scales expanded per row, gate and up joined (I need not be a
            # multiple of 128, so their blocks do not line up in w13).
            parts = [self._per_row(w) for w in (gate, up, down)]
            self.w13 = torch.cat([parts[0][0], parts[1][0]], dim=1)
            self.w13_scale = torch.cat([parts[0][1], parts[1][1]], dim=1)
            self.w2, self.w2_scale = parts[2]
        else:
            self.w13, self.w13_scale = quantize_experts_fp8(self.w13_real, block)
            self.w2, self.w2_scale = quantize_experts_fp8(down, block)

    @staticmethod
    def _per_row(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, s = quantize_experts_fp8(w, CKPT)
        return q, expand_scales_per_row(s, w.shape[1], CKPT[0])

    def kw(self) -> dict[str, object]:
        return {"w13_scale": self.w13_scale, "w2_scale": self.w2_scale, "block": self.block}


def _tokens(num_tokens: int, hidden: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """Hidden states with outlier features and rows of different sizes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    x = x * torch.exp(0.5 * torch.randn(1, hidden, generator=g))
    return (x * torch.exp(0.5 * torch.randn(num_tokens, 1, generator=g))).to(dtype).to(DEVICE)


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


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Triton against the FP8 reference. Both quantize the same values the same way, so on
    the interpreter they differ by fp32 summation order and the final rounding (which the
    interpreter truncates to bf16): within ~1 output ulp. An intermediate that the sum order
    moves across a rounding boundary re-rounds one fp8 value (a few % of one element's
    contribution; on the GPU the FP8 MMA's reduced-precision sums within a K step make that
    more frequent): so all within 2 ulps plus 1/64 of the output scale, 99% within 2 ulps
    plus 2^-12 of it (on the GPU 2^-9), and the whole within about an ulp."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got.float()).all()
    ulp = ULP[want.dtype]
    err = (got.float() - want.float()).abs()
    scale = want.float().abs().max().item()
    base = 2 * ulp * want.float().abs()
    assert (err <= base + scale / 64).all(), f"max error {err.max().item():.4g} at {scale:.4g}"
    tight = base + (2.0**-12 if DEVICE == "cpu" else 2.0**-9) * scale
    assert (err > tight).float().mean().item() <= 0.01
    assert _rel(got, want) <= max(ulp, 2.0**-20) * (1 if DEVICE == "cpu" else 2)


def _close_to_exact(got: torch.Tensor, x: torch.Tensor, ex: Experts, weights: torch.Tensor,
                    ids: torch.Tensor) -> None:
    """FP8 weights and activations against the fp32 experts they came from. An e4m3 value
    is within 2^-4 of what it rounds (~2.6% rms over a binade); through the gate/up product,
    SiLU*up and the down product the output is ~5% off: at most 10%."""
    exact = fused_moe_ref(x.float(), ex.w13_real, ex.w2_real, weights, ids)
    assert _rel(got, exact) < 0.1


def _poisoned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer the Triton path allocates starts as NaN (floats, fp8 too) or 1 (ints)."""
    def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
              ) -> torch.Tensor:
        fill = float("nan") if dtype.is_floating_point else 1
        return torch.full(shape, fill, dtype=dtype, device=device)

    for module in (fm, ma, fg):  # the GEMMs', the align step's, the group quantization's
        monkeypatch.setattr(module, "_empty", empty)


# --------------------------------------------------------------------- against the reference


@pytest.mark.parametrize("block", [ROW, CKPT])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_matches_reference(num_tokens: int, block: tuple[int, int],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    # H and I not multiples of 128 (one partial group each), E=8, K=2.
    ex = Experts(8, 80, 48, block, seed=num_tokens)
    x = _tokens(num_tokens, 80, BF16, seed=num_tokens)
    weights, ids = _routing(num_tokens, 2, 8, seed=num_tokens)
    want = fused_moe_ref(x, ex.w13, ex.w2, weights, ids, **ex.kw())
    _poisoned(monkeypatch)
    got = fused_moe_triton(x, ex.w13, ex.w2, weights, ids, **ex.kw(), **SMALL)
    _close(got, want)
    _close_to_exact(want, x, ex, weights, ids)
    _close_to_exact(got, x, ex, weights, ids)


@pytest.mark.parametrize(("fuse_x", "act_quant", "tiles"), [
    (False, "kernel", MID),  # x and the activation by the group-quantization kernel
    (True, "down", {**MID, "block_k1": 128, "block_k2": 128}),  # both inside the GEMMs
    (False, "epilogue", {**MID, "block_n1": 128}),  # the gate/up epilogue stores fp8
    (True, "epilogue", {**MID, "block_n1": 128, "block_k1": 128}),
])
def test_every_quantization_point(fuse_x: bool, act_quant: str, tiles: dict[str, int],
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # H = 200, I = 144: two K groups of 128, the second partial, in both GEMMs.
    ex = Experts(6, 200, 144, ROW, seed=3)
    x = _tokens(7, 200, BF16, seed=4)
    weights, ids = _routing(7, 2, 6, seed=5)
    want = fused_moe_ref(x, ex.w13, ex.w2, weights, ids, **ex.kw())
    _poisoned(monkeypatch)
    got = fused_moe_triton(x, ex.w13, ex.w2, weights, ids, **ex.kw(), **tiles,
                           fuse_x_quant=fuse_x, act_quant=act_quant)
    _close(got, want)


@pytest.mark.parametrize(("dtype", "block"), [(F32, ROW), (F16, CKPT), (BF16, (1, 32)),
                                              (BF16, (32, 64))])
def test_dtypes_and_other_blocks(dtype: torch.dtype, block: tuple[int, int],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32/fp16 activations, and groups shorter than 128 (several per row of 80 / 48)."""
    ex = Experts(5, 80, 48, block, seed=7)
    x = _tokens(6, 80, dtype, seed=8)
    weights, ids = _routing(6, 2, 5, seed=9)
    want = fused_moe_ref(x, ex.w13, ex.w2, weights, ids, **ex.kw())
    _poisoned(monkeypatch)
    got = fused_moe_triton(x, ex.w13, ex.w2, weights, ids, **ex.kw(), block_m=16, block_n1=16,
                           block_k1=KSTEP, block_n2=32, block_k2=KSTEP)
    _close(got, want)
    _close_to_exact(got, x, ex, weights, ids)


def test_all_tokens_to_one_expert_and_empty_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    # 20 tokens: slot 0 all expert 2 (two blocks of one expert), slot 1 over experts 0, 5, 7
    # (four of the eight get no token).
    ex = Experts(8, 80, 48, ROW, seed=11)
    x = _tokens(20, 80, BF16, seed=12)
    weights, ids = _routing(20, 2, 8, seed=13, allowed=[0, 5, 7])
    ids[:, 0] = 2
    want = fused_moe_ref(x, ex.w13, ex.w2, weights, ids, **ex.kw())
    _poisoned(monkeypatch)
    _close(fused_moe_triton(x, ex.w13, ex.w2, weights, ids, **ex.kw(), **SMALL), want)
    # everything to one expert
    ids[:, 1] = 2
    want = fused_moe_ref(x, ex.w13, ex.w2, weights, ids, **ex.kw())
    _close(fused_moe_triton(x, ex.w13, ex.w2, weights, ids, **ex.kw(), **SMALL), want)


@pytest.mark.parametrize("fused_combine", [False, True])
def test_combine_paths_chunks_and_determinism(fused_combine: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    ex = Experts(4, 80, 48, CKPT, seed=15)
    x = _tokens(7, 80, BF16, seed=16)
    weights, ids = _routing(7, 3, 4, seed=17)
    ids[1, 2] = ids[1, 0]  # one expert in two slots of a token
    want = fused_moe_ref(x, ex.w13, ex.w2, weights, ids, **ex.kw())
    _poisoned(monkeypatch)
    kw = {**ex.kw(), **SMALL, "fused_combine": fused_combine}
    got = fused_moe_triton(x, ex.w13, ex.w2, weights, ids, **kw)
    _close(got, want)
    assert torch.equal(fused_moe_triton(x, ex.w13, ex.w2, weights, ids, **kw), got)
    if not fused_combine:
        _close(fused_moe_triton(x, ex.w13, ex.w2, weights, ids, chunk_tokens=3, **kw), want)
    for buffer in fm._COUNTERS.get(str(x.device), []):
        assert not buffer.any()


def test_per_row_scales_are_the_blocks_expanded() -> None:
    """With ``I`` a multiple of 128 the checkpoint's blocks and their per-row expansion are
    the same weights: the same results, bit for bit in the reference."""
    ex = Experts(3, 80, 128, CKPT, seed=19)
    x = _tokens(4, 80, BF16, seed=20)
    weights, ids = _routing(4, 2, 3, seed=21)
    rows = {"w13_scale": expand_scales_per_row(ex.w13_scale, 256, 128),
            "w2_scale": expand_scales_per_row(ex.w2_scale, 80, 128), "block": ROW}
    assert rows["w13_scale"].shape == (3, 256, 1) and rows["w2_scale"].shape == (3, 80, 1)
    want = fused_moe_ref(x, ex.w13, ex.w2, weights, ids, **ex.kw())
    assert torch.equal(fused_moe_ref(x, ex.w13, ex.w2, weights, ids, **rows), want)
    assert torch.equal(dequantize_experts(ex.w13, rows["w13_scale"], ROW),
                       dequantize_experts(ex.w13, ex.w13_scale, CKPT))
    _close(fused_moe_triton(x, ex.w13, ex.w2, weights, ids, **rows, **SMALL), want)


def test_reference_quantization_steps() -> None:
    """``quant_dequant_groups`` is the group quantization, dequantized: every value is an e4m3
    value times its group's scale, and the group's largest magnitude maps to 448."""
    x = _tokens(3, 200, BF16, seed=23)
    got = quant_dequant_groups(x, 128)
    q, s = per_token_group_quant_fp8_ref(x, 128)
    assert got.shape == (3, 200) and got.dtype == F32
    assert torch.equal(got[:, :128], q[:, :128].float() * s[:, :1])
    assert torch.equal(got[:, 128:], q[:, 128:].float() * s[:, 1:])
    assert (q.float().abs().amax(dim=1) == 448).all()
    assert _rel(got, x) < 0.04


def test_no_tokens_and_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    ex = Experts(3, 80, 48, ROW)
    empty = _tokens(0, 80, BF16)
    w0, i0 = _routing(0, 2, 3)
    assert fused_moe_triton(empty, ex.w13, ex.w2, w0, i0, **ex.kw()).shape == (0, 80)
    x = _tokens(3, 80, BF16)
    weights, ids = _routing(3, 2, 3)
    if DEVICE == "cpu":
        monkeypatch.delenv("MRV2_KERNELS", raising=False)
        assert torch.equal(fused_moe(x, ex.w13, ex.w2, weights, ids, **ex.kw()),
                           fused_moe_ref(x, ex.w13, ex.w2, weights, ids, **ex.kw()))
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    assert torch.equal(fused_moe(x, ex.w13, ex.w2, weights, ids, **ex.kw()),
                       fused_moe_triton(x, ex.w13, ex.w2, weights, ids, **ex.kw()))
    odd = {**ex.kw(), "block": (1, 96)}  # groups the kernels do not take: the reference
    assert torch.equal(fused_moe(x, ex.w13, ex.w2, weights, ids, **odd),
                       fused_moe_ref(x, ex.w13, ex.w2, weights, ids, **odd))


def _bad_calls() -> list[tuple[str, Callable[[], object]]]:
    ex = Experts(3, 80, 48, ROW)
    x = _tokens(2, 80, BF16)
    weights, ids = _routing(2, 2, 3)
    w13, w2, s13, s2 = ex.w13, ex.w2, ex.w13_scale, ex.w2_scale

    def run(**kw: object) -> Callable[[], object]:
        args: dict[str, Any] = {"w13_scale": s13, "w2_scale": s2, "block": ROW, **kw}
        return lambda: fused_moe_triton(x, w13, w2, weights, ids, **args)

    return [
        ("w13", lambda: fused_moe_triton(x, w13, w2, weights, ids)),  # fp8 without scales
        ("w2_scale", run(w2_scale=None)),
        ("w13_scale", run(w13_scale=s13[:, :95])),
        ("w13_scale", run(block=CKPT)),  # per-row scales read as 128x128 blocks
        ("w2_scale", run(w2_scale=s2.to(FP8_DTYPE))),
        ("w13", lambda: fused_moe_ref(x, w13.to(BF16), w2, weights, ids, w13_scale=s13,
                                      w2_scale=s2)),
        ("block", run(block=(0, 128))),
        ("block", run(block=(1, 96))),  # the Triton path's group K is a power of two
        ("block_k1", run(block_k1=256)),
        ("block_k2", run(block=(1, 32), w13_scale=s13.repeat(1, 1, 3),
                         w2_scale=s2.repeat(1, 1, 2), block_k2=64)),
        ("fuse_x_quant", run(fuse_x_quant=True, block_k1=32)),
        ("act_quant", run(act_quant="nowhere")),
        ("act_quant", run(act_quant="epilogue", block_n1=32)),
        ("act_quant", run(act_quant="down", block_k2=32)),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_bad_arguments_name_the_argument(index: int) -> None:
    name, call = _bad_calls()[index]
    with pytest.raises(ValueError, match=rf"^{name} "):
        call()


def test_tile_plan() -> None:
    cpu = moe_tiles(8, 2, 4, 80, 48, torch.device("cpu"), (1, 128))
    assert (cpu.block_k1, cpu.block_k2, cpu.act_quant, cpu.fuse_x_quant) == (32, 32, "kernel",
                                                                             False)
    assert moe_tiles(8, 2, 4, 80, 48, torch.device("cpu"), (1, 16)).block_k1 == 16
    # tiles overridden under a default quantization place it cannot use: the place gives way
    decode = fm.MoeTiles(16, 64, 64, 128, 128, 1, 4, 4, True, True, "down")
    assert not fm._check_fp8_tiles(decode, 128, True, True).fuse_x_quant
    narrow = decode._replace(block_k1=128, block_n1=32, act_quant="epilogue")
    assert fm._check_fp8_tiles(narrow, 128, True, True).act_quant == "kernel"
    if DEVICE == "cuda":
        dev = torch.device("cuda")
        decode = moe_tiles(1, 8, 128, 4096, 1408, dev, ROW)
        prefill = moe_tiles(4096, 8, 128, 4096, 1408, dev, ROW)
        # the separate quantization launches (the in-GEMM places were never faster)
        assert not decode.fuse_x_quant and decode.act_quant == "kernel" and decode.block_m == 16
        assert not prefill.fuse_x_quant and prefill.act_quant == "kernel"
        assert (prefill.block_m, prefill.block_n1, prefill.num_warps) == (64, 64, 4)
        # a block K the default steps do not fit: shorter steps, the separate kernel
        odd = moe_tiles(4096, 8, 128, 4096, 1408, dev, (1, 64))
        assert odd.block_k1 == 64 and odd.act_quant == "kernel"


# ---------------------------------------------------------------------------------- GPU only

GLM = (128, 8, 4096, 1408)  # GLM-4.5-Air's routed experts: E, K, H, I


@pytest.fixture(scope="module")
def glm_experts() -> Experts:
    return Experts(GLM[0], GLM[2], GLM[3], ROW, seed=0)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("num_tokens", [1, 16, 64, 300, 2048])
def test_glm_air_shapes(num_tokens: int, glm_experts: Experts) -> None:
    ex = glm_experts
    num_experts, top_k, hidden, _ = GLM
    x = _tokens(num_tokens, hidden, BF16, seed=num_tokens)
    weights, ids = _routing(num_tokens, top_k, num_experts, seed=num_tokens)
    want = fused_moe_ref(x, ex.w13, ex.w2, weights, ids, **ex.kw())
    got = fused_moe_triton(x, ex.w13, ex.w2, weights, ids, **ex.kw())
    _close(got, want)
    _close_to_exact(got, x, ex, weights, ids)
    assert torch.equal(fused_moe_triton(x, ex.w13, ex.w2, weights, ids, **ex.kw()), got)


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("num_tokens", [4, 300])
def test_gpu_quantization_points_agree(num_tokens: int, glm_experts: Experts) -> None:
    """The GEMMs' own quantization (a reciprocal and an fma correction instead of a division
    per element) rounds as the group-quantization kernel: with the same tiles, the same
    bits whichever place quantizes."""
    ex = glm_experts
    x = _tokens(num_tokens, GLM[2], BF16, seed=5)
    weights, ids = _routing(num_tokens, GLM[1], GLM[0], seed=6)
    tiles = {"block_m": 16, "block_n1": 128, "block_k1": 128, "block_n2": 128,
             "block_k2": 128, "fused_combine": False}
    outs = [fused_moe_triton(x, ex.w13, ex.w2, weights, ids, **ex.kw(), **tiles,
                             fuse_x_quant=fuse, act_quant=mode)
            for fuse, mode in ((False, "kernel"), (True, "down"), (False, "epilogue"))]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("num_tokens", [1, 8, 64])
def test_cuda_graph_capture(num_tokens: int, glm_experts: Experts) -> None:
    ex = glm_experts
    num_experts, top_k, hidden, _ = GLM
    x = _tokens(num_tokens, hidden, BF16)
    weights, ids = _routing(num_tokens, top_k, num_experts)
    fused_moe(x, ex.w13, ex.w2, weights, ids, **ex.kw())  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = fused_moe(x, ex.w13, ex.w2, weights, ids, **ex.kw())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in range(3):
        new_weights, new_ids = _routing(num_tokens, top_k, num_experts, seed=100 + seed,
                                        allowed=list(range(seed, num_experts, 2 + seed)))
        x.copy_(_tokens(num_tokens, hidden, BF16, seed=200 + seed))
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        eager = fused_moe(x, ex.w13, ex.w2, weights, ids, **ex.kw())
        assert torch.equal(out, eager)
        _close(out, fused_moe_ref(x, ex.w13, ex.w2, weights, ids, **ex.kw()))
