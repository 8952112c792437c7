"""The layer-level fusions: ``norm_linear`` (norm + projection [+ SwiGLU]) and the KV write
inside the attention layer's RoPE, against the unfused layers they replace."""

from __future__ import annotations

import os

import pytest
import torch

from mrv2.attention import AttentionMetadata
from mrv2.attention.torch_backend import TorchAttentionBackend
from mrv2.attention.triton_backend import TritonAttentionBackend
from mrv2.contract.forward_context import ForwardContext, set_forward_context
from mrv2.layers import (
    Attention,
    LinearBase,
    MergedColumnLinear,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    norm_linear,
)
from mrv2_kernels.norm import silu_and_mul

pytestmark = pytest.mark.filterwarnings(
    "ignore:Conversion of an array with ndim:DeprecationWarning"
)

HIDDEN, INTER = 64, 48
#: Tests that send CPU tensors through Triton (``MRV2_KERNELS=triton``) need its interpreter,
#: which the root conftest turns on unless ``MRV2_TEST_GPU`` is set; on the GPU machine the
#: same kernels run on CUDA tensors in tests/kernels (test_norm_gemv, test_paged_attention).
INTERPRETER = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="CPU tensors through Triton need TRITON_INTERPRET=1 (off under MRV2_TEST_GPU)")


def _modules(dtype: torch.dtype, seed: int = 0) -> tuple[RMSNorm, QKVLinear, MergedColumnLinear]:
    torch.manual_seed(seed)
    norm = RMSNorm(HIDDEN, eps=1e-5)
    qkv = QKVLinear(HIDDEN, 16, 2, 1)
    gate_up = MergedColumnLinear(HIDDEN, [INTER, INTER])
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(HIDDEN))
        qkv.weight.copy_(torch.randn_like(qkv.weight) / HIDDEN**0.5)
        gate_up.weight.copy_(torch.randn_like(gate_up.weight) / HIDDEN**0.5)
    return norm.to(dtype), qkv.to(dtype), gate_up.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_linear_is_the_unfused_chain_on_cpu(dtype: torch.dtype) -> None:
    norm, qkv, gate_up = _modules(dtype)
    x = torch.randn(3, HIDDEN).to(dtype)
    residual = torch.randn(3, HIDDEN).to(dtype)
    h, want_res = norm(x, residual.clone())
    y, new_res = norm_linear(norm, qkv, x, residual.clone())
    assert torch.equal(y, qkv(h)) and torch.equal(new_res, want_res)
    act, _ = norm_linear(norm, gate_up, x, residual.clone(), silu_and_mul=True)
    assert torch.equal(act, silu_and_mul(gate_up(h)))
    first, first_res = norm_linear(norm, qkv, x, None)  # the first layer: no residual yet
    assert torch.equal(first, qkv(norm(x))) and first_res is x


def test_norm_linear_respects_overridden_layers() -> None:
    """A linear layer with its own forward (say, quantized) is called, never bypassed."""

    class Doubled(LinearBase):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    norm, _, _ = _modules(torch.float32)
    layer = Doubled(HIDDEN, 8)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(8, HIDDEN))
    x = torch.randn(1, HIDDEN)
    y, _ = norm_linear(norm, layer, x, None)
    assert torch.equal(y, 2 * LinearBase.forward(layer, norm(x)))


@INTERPRETER
def test_norm_linear_forced_triton_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    """One decode row through the fused kernel (interpreter) vs the reference chain (fp16:
    the interpreter rounds it to nearest, like the GPU)."""
    norm, qkv, gate_up = _modules(torch.float16, seed=1)
    x = torch.randn(1, HIDDEN).half()
    residual = torch.randn(1, HIDDEN).half()
    want, want_res = norm_linear(norm, gate_up, x, residual.clone(), silu_and_mul=True)
    monkeypatch.setenv("MRV2_KERNELS", "triton")
    got, got_res = norm_linear(norm, gate_up, x, residual.clone(), silu_and_mul=True)
    assert torch.equal(got_res, want_res)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=4e-3)


def _decode_context(backend: object, dtype: torch.dtype) -> tuple[ForwardContext, torch.Tensor]:
    """Two decode requests (contexts 5 and 3, block size 4) plus one padding token."""
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(2, 8, 4, 1, 16, generator=gen).to(dtype)
    table = torch.tensor([[2, 5, 0], [7, 1, 0]], dtype=torch.int32)
    metadata = AttentionMetadata(
        num_reqs=2, num_tokens=3, max_query_len=1, max_seq_len=6,
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([6, 4], dtype=torch.int32), block_table=table,
        slot_mapping=torch.tensor([5 * 4 + 1, 1 * 4 + 3, -1], dtype=torch.int64),
        block_size=4, uniform_decode=True,
    )
    return ForwardContext(metadata=metadata, kv_caches=[cache],
                          backends=[backend]), torch.tensor([5, 3, 0])


@pytest.mark.parametrize(("backend_cls", "in_attention"), [
    (TorchAttentionBackend, False), (TritonAttentionBackend, False),
    (TritonAttentionBackend, True)])
def test_attention_with_rotary_equals_rotary_then_attention(
    backend_cls: type, in_attention: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RoPE given to the attention layer gives the same output and the same cache as RoPE
    before the layer: with the Triton backend either through its ``forward_rope`` (the layer
    launches no RoPE itself; which kernel rotates is test_paged_attention's business) or in
    the RoPE kernel, which then writes the KV cache."""
    import mrv2.layers.rotary as rotary_module

    if backend_cls is TritonAttentionBackend:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("CPU tensors through Triton need TRITON_INTERPRET=1 (off under "
                        "MRV2_TEST_GPU)")
        monkeypatch.setenv("MRV2_KERNELS", "triton")  # the Triton RoPE kernel on CPU tensors
        monkeypatch.setenv("MRV2_ROPE_IN_ATTENTION", "1" if in_attention else "0")
    calls: list[bool] = []
    plain_rope = rotary_module.rotary_embedding

    def counted(*args: object, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(True)
        return plain_rope(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(rotary_module, "rotary_embedding", counted)
    dtype = torch.float16
    attn = Attention(2, 1, 16, 16**-0.5, layer_idx=0)
    rope = RotaryEmbedding(16, max_position=32)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(3, 32, generator=gen).to(dtype)
    k = torch.randn(3, 16, generator=gen).to(dtype)
    v = torch.randn(3, 16, generator=gen).to(dtype)
    norms = (torch.rand(16, generator=gen).half() + 0.5, torch.rand(16, generator=gen).half()
             + 0.5, 1e-6)
    outs, caches = [], []
    for fused in (False, True):
        ctx, positions = _decode_context(backend_cls(), dtype)
        with set_forward_context(ctx):
            if fused:
                calls.clear()
                out = attn(q.clone(), k.clone(), v, positions=positions, rotary=rope,
                           qk_norm=norms)
                assert calls == ([] if in_attention else [True])
            else:
                rq, rk = rope(positions, q.clone(), k.clone(), norms)
                out = attn(rq, rk, v)
        outs.append(out)
        caches.append(ctx.kv_caches[0])
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0], caches[1])
    assert torch.isfinite(outs[1][:2].float()).all()
    with pytest.raises(ValueError, match="rotary needs positions"):
        ctx, _ = _decode_context(backend_cls(), dtype)
        with set_forward_context(ctx):
            attn(q, k, v, rotary=rope)
