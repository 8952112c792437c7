"""gpt-oss's experts in the fused MoE: biases on both projections, the clamped ``swigluoai``
activation, and MXFP4 weights (e2m1 codes, e8m0 scales).

The reference itself is checked against HF transformers' ``GptOssExperts`` (interleaved
gate/up columns, its own loop) and HF's MXFP4 dequantization; the Triton paths (bf16 / fp32,
the fused and the separate combine, FP8 and MXFP4 weights, padding rows) against the
reference."""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from mrv2_kernels import fused_moe as fm
from mrv2_kernels.fused_moe import Epilogue, IntExperts, fused_moe, fused_moe_ref, fused_moe_triton
from mrv2_kernels.fused_moe_int import dequantize_int_experts, mxfp4_codes, pack_experts
from mrv2_kernels.mxfp4_dense import (
    DENSE_ENV_VAR,
    DENSE_MIN_TOKENS,
    dequantize_mxfp4,
    use_dense,
)

DEVICE = "cuda" if os.environ.get("MRV2_TEST_GPU") and torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)
E, H, INTER, K = 4, 64, 32, 2


@pytest.fixture
def poisoned(poison: Callable[[ModuleType], None]) -> None:
    poison(fm)


def _routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    weights, ids = torch.randn(tokens, E, generator=g).softmax(-1).topk(K, dim=-1)
    return x, weights, ids.int()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: 1e-4; bf16: a rounding of the activation flipped by one unit, times the down
    weights (2% of the outputs' scale)."""
    assert not got.isnan().any()
    tol = 1e-4 if got.dtype == torch.float32 else 2e-2 * float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def _float_experts(seed: int) -> dict[str, torch.Tensor]:
    """Weights big enough that the gate / up outputs pass the clamp (|.| > 7) often."""
    g = torch.Generator().manual_seed(seed)
    return {"w13": torch.randn(E, 2 * INTER, H, generator=g) * 0.9,
            "w2": torch.randn(E, H, INTER, generator=g) * 0.2,
            "w13_bias": torch.randn(E, 2 * INTER, generator=g),
            "w2_bias": torch.randn(E, H, generator=g)}


def test_reference_is_hf_gpt_oss_experts() -> None:
    """fused_moe_ref with the biases and swigluoai against HF's GptOssExperts (whose gate /
    up columns interleave, stored transposed), in fp32."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(hidden_size=H, intermediate_size=INTER,
                                       num_local_experts=E, num_experts_per_tok=K)
    hf = GptOssExperts(config)
    w = _float_experts(seed=1)
    def interleave(t: torch.Tensor) -> torch.Tensor:  # [E, 2I, ...]: gate row, up row, ...
        return torch.stack([t[:, :INTER], t[:, INTER:]], dim=2).flatten(1, 2)

    gate_up, gate_up_bias = interleave(w["w13"]), interleave(w["w13_bias"])
    with torch.no_grad():
        hf.gate_up_proj.copy_(gate_up.transpose(1, 2))
        hf.gate_up_proj_bias.copy_(gate_up_bias)
        hf.down_proj.copy_(w["w2"].transpose(1, 2))
        hf.down_proj_bias.copy_(w["w2_bias"])
    x, weights, ids = _routing(7, seed=2)
    with torch.no_grad():
        want = hf(x, ids.long(), weights)
        gate = (x @ w["w13"][:, :INTER].transpose(1, 2) + w["w13_bias"][:, None, :INTER]).abs()
    assert (gate > 7).float().mean() > 0.05  # the clamp is exercised
    got = fused_moe_ref(x, w["w13"], w["w2"], weights, ids,
                        epilogue=Epilogue("swigluoai", 7.0, w["w13_bias"], w["w2_bias"]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize(("tokens", "dtype", "activation", "bias", "combine", "valid"), [
    (3, torch.float32, "swigluoai", True, True, None),
    (9, torch.float32, "swigluoai", True, False, 6),
    (5, torch.bfloat16, "swigluoai", True, None, None),
    (4, torch.float32, "silu", True, None, None),
    (4, torch.float32, "swigluoai", False, None, None),
    (6, torch.float32, "gelu_tanh", False, True, None),
    (5, torch.bfloat16, "gelu_tanh", True, None, None),
    (6, torch.float32, "silu_clamp", False, True, None),
    (5, torch.bfloat16, "silu_clamp", False, None, 4),
])
def test_triton_matches_reference(tokens: int, dtype: torch.dtype, activation: str,
                                  bias: bool, combine: bool | None, valid: int | None) -> None:
    w = {k: v.to(dtype) for k, v in _float_experts(seed=3).items()}
    x, weights, ids = _routing(tokens, seed=4)
    x = x.to(dtype)
    epi = Epilogue(activation, 5.0, w["w13_bias"] if bias else None,
                   w["w2_bias"] if bias else None)
    valid_t = None if valid is None else torch.tensor([valid], dtype=torch.int32)
    want = fused_moe_ref(x, w["w13"], w["w2"], weights, ids, epilogue=epi,
                         valid_tokens=valid_t)
    dev = [t.to(DEVICE) for t in (x, w["w13"], w["w2"], weights, ids)]
    epi_dev = epi._replace(**{k: getattr(epi, k).to(DEVICE) for k in ("w13_bias", "w2_bias")
                              if getattr(epi, k) is not None})
    got = fused_moe_triton(*dev, epilogue=epi_dev, fused_combine=combine,
                           valid_tokens=None if valid_t is None else valid_t.to(DEVICE)).cpu()
    rows = tokens if valid is None else valid
    _close(got[:rows], want[:rows])


@pytest.mark.usefixtures("poisoned")
def test_fp8_weights_with_biases_and_swigluoai() -> None:
    """The FP8 path's epilogue: the same biases and activation as the bf16 kernels'."""
    from mrv2_kernels.fp8_gemm import FP8_DTYPE

    w = _float_experts(seed=5)
    block = (32, 32)  # (fp8 dots need K >= 32 on the GPU)
    scales = {}
    q = {}
    for name in ("w13", "w2"):
        t = w[name]
        blocks = t.unflatten(1, (-1, block[0])).unflatten(3, (-1, block[1]))
        s = blocks.abs().amax(dim=(2, 4)) / 448.0
        q[name] = (blocks / s[:, :, None, :, None]).flatten(3, 4).flatten(1, 2).to(FP8_DTYPE)
        scales[name] = s
    x, weights, ids = _routing(6, seed=6)
    x = x.to(torch.bfloat16)
    epi = Epilogue("swigluoai", 7.0, w["w13_bias"].bfloat16(), w["w2_bias"].bfloat16())
    args = (x, q["w13"], q["w2"], weights, ids)
    kw = {"w13_scale": scales["w13"], "w2_scale": scales["w2"], "block": block}
    want = fused_moe_ref(*args, epilogue=epi, **kw)  # type: ignore[arg-type]
    got = fused_moe_triton(*[t.to(DEVICE) for t in args], block=block, epilogue=epi._replace(
        w13_bias=epi.w13_bias.to(DEVICE), w2_bias=epi.w2_bias.to(DEVICE)),  # type: ignore[union-attr]
        w13_scale=scales["w13"].to(DEVICE), w2_scale=scales["w2"].to(DEVICE)).cpu()
    _close(got, want)


def _mxfp4(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 experts as gpt-oss's checkpoints store them: ``blocks`` uint8
    ``[E, n, k / 32, 16]`` (two codes a byte, low nibble first), ``scales`` uint8 e8m0
    ``[E, n, k / 32]``."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (E, n, k // 32, 16), generator=g).to(torch.uint8)
    scales = torch.randint(120, 128, (E, n, k // 32), generator=g).to(torch.uint8)
    return blocks, scales


def _past_k_255(scales: torch.Tensor) -> torch.Tensor:
    """``scales`` (contiguous) followed in memory by bytes 255 (2 ** 128 read as an fp32):
    what a K step past the last column's last group would read."""
    memory = torch.full((scales.numel() + 64,), 255, dtype=torch.uint8)
    out = memory[:scales.numel()].view(scales.shape)
    out.copy_(scales)
    return out


def test_mxfp4_dequantization_is_hfs() -> None:
    """Codes unpacked from the checkpoint's bytes, packed along K, dequantized: HF's own
    MXFP4 conversion (which returns the transposed ``[E, K, N]``)."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = _mxfp4(6, 64, seed=7)
    codes = mxfp4_codes(blocks)
    assert codes.shape == (E, 6, 64) and int(codes.max()) < 16
    words = pack_experts(codes, 4)
    assert torch.equal(words, blocks.reshape(E, 6, 32).view(torch.int32))  # the same bytes
    got = dequantize_int_experts(words, scales, None, 4, 32, fp4=True)
    want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dense_dequantization(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton pass of :func:`~mrv2_kernels.mxfp4_dense.dequantize_mxfp4` (a K that is
    not a multiple of its tile; a group whose scale reads as 0) gives the reference's values
    exactly; the default rule takes it for large steps only, and the variable overrides it."""
    blocks, scales = _mxfp4(6, 96, seed=12)
    scales[1, 2, 1] = 0
    words = pack_experts(mxfp4_codes(blocks), 4).to(DEVICE)
    want = dequantize_int_experts(words.cpu(), scales, None, 4, 32, dtype, fp4=True)
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    out = dequantize_mxfp4(words, scales.to(DEVICE), dtype, block_r=4, block_w=8)
    assert out.dtype == dtype and torch.equal(out.cpu(), want)
    assert not bool(want[1, 2, 32:64].any())
    big = torch.empty(32, 5760, 360, dtype=torch.int32, device="meta")
    assert use_dense(DENSE_MIN_TOKENS, big, big[:, :2880], 8, torch.bfloat16)
    assert not use_dense(DENSE_MIN_TOKENS - 1, big, big[:, :2880], 8, torch.bfloat16)
    monkeypatch.setenv(DENSE_ENV_VAR, "0")
    assert not use_dense(8192, big, big[:, :2880], 8, torch.bfloat16)
    with pytest.raises(ValueError, match=r"int32 \[E, N, K / 8\] with uint8 scales"):
        dequantize_mxfp4(words, scales[..., :1], dtype)


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize(("tokens", "dtype", "valid", "block_k", "magic"), [
    (3, torch.float32, None, None, False), (9, torch.float32, 5, None, False),
    (5, torch.bfloat16, None, None, False),
    # the codes made floats from their bits (mrv2_kernels.int_bits)
    (3, torch.float32, None, None, True), (5, torch.bfloat16, None, None, True),
    # the pair-a-program CUDA-core kernels (mrv2_kernels.fused_moe_gemv), padding rows too
    (2, torch.bfloat16, None, None, "gemv"), (5, torch.float32, 3, None, "gemv"),
    # K steps over several groups, the scales folded into the weights: whole steps, then
    # steps past the end of K (128 > H, INTER)
    (5, torch.float32, None, 64, False), (4, torch.bfloat16, None, 128, False),
    (5, torch.float32, None, 64, True), (4, torch.bfloat16, None, 128, True),
    # dequantized to x's dtype first, then the unquantized GEMMs (mrv2_kernels.mxfp4_dense)
    (5, torch.float32, None, None, "dense"), (9, torch.bfloat16, 5, None, "dense")])
def test_mxfp4_triton_matches_reference(tokens: int, dtype: torch.dtype, valid: int | None,
                                        block_k: int | None, magic: bool | str) -> None:
    b13, s13 = _mxfp4(2 * INTER, H, seed=8)
    b2, s2 = _mxfp4(H, INTER, seed=9)
    s13[0, 1, 0] = 0  # a group whose scale reads as 0
    s13[1, 2, 1] = 1  # and one whose values fall below fp32's normal range
    w13, w2 = (pack_experts(mxfp4_codes(b), 4) for b in (b13, b2))
    bias = _float_experts(seed=10)
    x, weights, ids = _routing(tokens, seed=11)
    x = (x * 0.05).to(dtype)
    epi = Epilogue("swigluoai", 7.0, bias["w13_bias"].to(dtype), bias["w2_bias"].to(dtype))
    ints = IntExperts(s13, s2, None, None, 4, 32, fp4=True)
    valid_t = None if valid is None else torch.tensor([valid], dtype=torch.int32)
    want = fused_moe_ref(x, w13, w2, weights, ids, int_experts=ints, epilogue=epi,
                         valid_tokens=valid_t)
    on = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    # (the scales end on bytes 255: a step past K reading its groups' scales NaNs)
    got = fused_moe_triton(
        *on, int_experts=IntExperts(_past_k_255(s13).to(DEVICE), _past_k_255(s2).to(DEVICE),
                                    None, None, 4, 32, fp4=True),
        epilogue=Epilogue("swigluoai", 7.0, epi.w13_bias.to(DEVICE),  # type: ignore[union-attr]
                          epi.w2_bias.to(DEVICE)),  # type: ignore[union-attr]
        block_k1=block_k, block_k2=block_k, int_magic=magic is True, int_gemv=magic == "gemv",
        int_dense=magic == "dense",
        valid_tokens=None if valid_t is None else valid_t.to(DEVICE)).cpu()
    rows = tokens if valid is None else valid
    _close(got[:rows], want[:rows])


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"activation": "gelu"},
     r"activation must be one of silu, swigluoai, gelu_tanh, silu_clamp; got 'gelu'"),
    ({"activation": "swigluoai", "swiglu_limit": 0.0}, r"swiglu_limit must be positive"),
    ({"w13_bias": torch.zeros(E, INTER)}, r"w13_bias must be \(4, 64\)"),
    ({"w2_bias": torch.zeros(E, H + 1)}, r"w2_bias must be \(4, 64\)"),
])
def test_bad_epilogue_is_named(kwargs: dict[str, object], match: str) -> None:
    w = _float_experts(seed=12)
    x, weights, ids = _routing(2, seed=13)
    with pytest.raises(ValueError, match=match):
        fused_moe(x, w["w13"], w["w2"], weights, ids, **kwargs)  # type: ignore[arg-type]
