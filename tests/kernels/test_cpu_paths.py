"""The kernels' CPU paths against their plain-torch references: the same bits for RMSNorm, RoPE
and sampling (fewer ops, same math), fp32 accumulation order for the oneDNN products."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

try:
    import mrv2_kernels  # noqa: F401
except ImportError:  # not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from mrv2_kernels.cpu_linear import ONEDNN_MAX_ROWS, linear_cpu
from mrv2_kernels.gumbel import gumbel_sample, gumbel_sample_cpu, gumbel_sample_ref
from mrv2_kernels.kv_cache import write_kv_ref
from mrv2_kernels.norm import rms_norm, rms_norm_cpu, rms_norm_ref
from mrv2_kernels.rotary import (
    _side_by_side,
    rotary_embedding,
    rotary_embedding_cpu,
    rotary_embedding_ref,
)

F32, BF16 = torch.float32, torch.bfloat16


def randn(*shape: int, dtype: torch.dtype = F32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def cos_sin_table(max_pos: int, rotary_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("rows", [1, 5])
def test_rms_norm_cpu_is_the_reference(dtype: torch.dtype, rows: int) -> None:
    x, res = randn(rows, 96, dtype=dtype), randn(rows, 96, dtype=dtype, seed=1)
    w = randn(96, dtype=dtype, seed=2)
    x_before, res_before = x.clone(), res.clone()
    assert torch.equal(rms_norm_cpu(x, w, 1e-5), rms_norm_ref(x, w, 1e-5))
    got, want = rms_norm_cpu(x, w, 1e-5, res), rms_norm_ref(x, w, 1e-5, res)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(x, x_before) and torch.equal(res, res_before)  # inputs untouched
    assert torch.equal(rms_norm(x, w, 1e-5, res)[0], want[0])  # the CPU dispatch


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("layout", ["fused_qkv", "separate", "heads"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_cpu_is_the_reference(dtype: torch.dtype, layout: str, qk_norm: bool) -> None:
    tokens, heads, kv_heads, head_dim = 6, 4, 2, 16
    positions = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(3))
    table = cos_sin_table(64, head_dim)
    if layout == "fused_qkv":  # q and k side by side in one buffer: one rotation for both
        qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
        q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        assert _side_by_side(q, k) is not None
    elif layout == "separate":
        q = randn(tokens, heads * head_dim, dtype=dtype)
        k = randn(tokens, kv_heads * head_dim, dtype=dtype, seed=1)
        assert _side_by_side(q, k) is None
    else:
        q = randn(tokens, heads, head_dim, dtype=dtype)
        k = randn(tokens, kv_heads, head_dim, dtype=dtype, seed=1)
    norm = (randn(head_dim, dtype=dtype, seed=4), randn(head_dim, dtype=dtype, seed=5), 1e-6)
    qk = norm if qk_norm else None
    q_before, k_before = q.clone(), k.clone()
    got = rotary_embedding_cpu(positions.int(), q, k, table, head_dim, head_dim, qk)
    want = rotary_embedding_ref(positions, q, k, table, head_dim, head_dim, qk)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and torch.equal(g, w)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)
    assert torch.equal(rotary_embedding(positions, q, k, table, head_dim, head_dim, qk)[0], want[0])


def test_rotary_cpu_partial_rotation_and_kv_write() -> None:
    tokens, head_dim = 5, 16
    positions = torch.arange(3, 3 + tokens)
    q, k = randn(tokens, 2 * head_dim), randn(tokens, head_dim, seed=1)
    v = randn(tokens, head_dim, seed=2)
    partial = cos_sin_table(16, 8)
    got = rotary_embedding_cpu(positions, q, k, partial, head_dim, 8)
    want = rotary_embedding_ref(positions, q, k, partial, head_dim, 8)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    caches = [torch.zeros(2, 4, 4, 1, head_dim) for _ in range(2)]
    slots = torch.tensor([0, -1, 5, 6, 15])
    table = cos_sin_table(16, head_dim)
    _, key = rotary_embedding_cpu(positions, q, k, table, head_dim, head_dim,
                                  kv_write=(v, caches[0], slots))
    write_kv_ref(key.view(tokens, 1, head_dim), v.view(tokens, 1, head_dim), caches[1], slots)
    assert torch.equal(caches[0], caches[1]) and caches[0].abs().sum() > 0


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("with_temperature", [False, True])
def test_gumbel_sample_cpu_gives_the_reference_tokens(
    dtype: torch.dtype, with_temperature: bool
) -> None:
    rows, vocab = 6, 300
    logits = randn(rows, vocab, dtype=dtype) * 3
    seeds = torch.tensor([0, 7, -1, 2**40, 5, 9])
    positions = torch.tensor([3, 1, 4, 1, 5, 9])
    temperature = torch.tensor([0.7, 1.3, 0.9, 2.0, 0.5, 1.0]) if with_temperature else None
    for greedy in ([1, 0, 1, 0, 0, 1], [1] * rows, [0] * rows):
        flags = torch.tensor(greedy, dtype=torch.bool)
        got, want = torch.full((rows,), -1), torch.full((rows,), -2)
        gumbel_sample_cpu(logits, seeds, positions, flags, got, temperature)
        gumbel_sample_ref(logits, seeds, positions, flags, want, temperature)
        assert torch.equal(got, want)
        dispatched = torch.full((rows,), -3)
        gumbel_sample(logits, seeds, positions, flags, dispatched, temperature)
        assert torch.equal(dispatched, want)


@pytest.mark.parametrize("rows", [1, 3, ONEDNN_MAX_ROWS, ONEDNN_MAX_ROWS + 1])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cpu_matches_f_linear(rows: int, bias: bool) -> None:
    weight = randn(48, 40, seed=1)
    b = randn(48, seed=2) if bias else None
    x = randn(rows, 80, seed=3)[:, ::2]  # strided rows
    want = F.linear(x, weight, b)
    for w in (weight, weight.t().contiguous().t()):  # row- and column-major
        got = linear_cpu(x, w, b)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert linear_cpu(randn(40), weight).shape == (48,)  # 1-D: F.linear
    x64, w64 = x.double(), weight.double()
    assert torch.equal(linear_cpu(x64, w64), F.linear(x64, w64))  # not fp32: F.linear


def test_linear_cpu_respects_the_mkldnn_switch() -> None:
    x, weight = randn(2, 40), randn(48, 40, seed=1)
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        assert torch.equal(linear_cpu(x, weight), F.linear(x, weight))
    finally:
        torch.backends.mkldnn.enabled = before


def test_programmatic_dependent_launch_is_off_on_the_cpu() -> None:
    """CPU tensors (the interpreter) never get PDL launch options; on sm90 GPUs they are on
    unless ``MRV2_PDL=0`` (GPU test: ``test_programmatic_dependent_launch_changes_no_token``)."""
    from mrv2_kernels._backend import pdl, pdl_enabled

    x = torch.zeros(1)
    assert pdl(x) == {"PDL": False} and not pdl_enabled(x)


def test_no_pdl_kernel_writes_step_metadata() -> None:
    """``pdl_early_meta`` reads positions, slots, ``query_start_loc`` and ``seq_lens`` before
    the wait for the previous kernel, which is safe only while no PDL-launched kernel writes
    them. The kernels launched with PDL are these (none writes step metadata); a new one must
    be checked against that rule, then added here."""
    import re

    root = Path(__file__).resolve().parents[2]
    launching = set()
    for folder in ("kernels", "framework", "plugins", "contrib_models"):
        for path in (root / folder).rglob("*.py"):
            if "build" in path.parts or path.name == "_backend.py":
                continue
            if re.search(r"\*\*pdl\(|launch_pdl", path.read_text()):
                launching.add(path.relative_to(root).as_posix())
    assert launching == {
        "kernels/mrv2_kernels/causal_conv1d.py",  # conv outputs, conv state rows
        "kernels/mrv2_kernels/layer_norm.py",  # the normed activations (and the residual)
        "kernels/mrv2_kernels/chunk_delta_rule.py",  # WY scratch, delta-rule outputs, state rows
        "kernels/mrv2_kernels/linear_attention.py",  # delta-rule outputs, state rows
        "kernels/mrv2_kernels/lora.py",  # the shrink's scratch, the layer's output (adds)
        "kernels/mrv2_kernels/moe_router.py",  # the routing weights and expert ids
        "kernels/mrv2_kernels/norm.py",  # writes the normed activations (and the residual)
        "kernels/mrv2_kernels/norm_gemv.py",  # activations
        "kernels/mrv2_kernels/paged_attention.py",  # attention output, split partials
        "kernels/mrv2_kernels/prefill_attention.py",  # attention output
        "kernels/mrv2_kernels/rotary.py",  # q/k in place, the KV cache
        "kernels/mrv2_kernels/skinny_gemm.py",  # activations, split-K partials
    }


def test_host_grid_helpers_match_triton() -> None:
    """The wrappers size grids with ``_backend.cdiv`` / ``next_power_of_2`` (plain Python;
    Triton 3.6's are constexpr functions, ~5 µs a call from the host): same values."""
    import triton

    from mrv2_kernels._backend import cdiv, next_power_of_2

    for n in [*range(0, 3000), 2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    for a in range(-40, 400, 3):
        for b in range(1, 70):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
