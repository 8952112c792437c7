"""The dense MLPs' activations (:mod:`mrv2.layers.activation`): squared ReLU and xIELU against
plain-torch references written from their definitions, and xIELU bit for bit against
transformers' ``XIELUActivation`` in fp32 and bf16 (its parameters loaded from a state dict,
as a checkpoint gives them)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.activations import ReLUSquaredActivation, XIELUActivation

from mrv2.layers import XIELU, DenseMLP, ReLUSquared


def _inputs(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random values of both signs, exact zeros, and values between ``eps`` and 0."""
    x = torch.randn(7, 40, generator=torch.Generator().manual_seed(0)) * 3
    x[0, :4] = torch.tensor([0.0, -0.0, -5e-7, 5e-7])
    return x.to(dtype)


def test_relu2_is_relu_squared() -> None:
    x = _inputs()
    want = torch.where(x > 0, x * x, torch.zeros_like(x))
    torch.testing.assert_close(ReLUSquared()(x), want, rtol=0, atol=0)
    torch.testing.assert_close(ReLUSquared()(x), ReLUSquaredActivation()(x), rtol=0, atol=0)


def _xielu_reference(x: torch.Tensor, raw_p: float, raw_n: float, beta: float,
                     eps: float) -> torch.Tensor:
    """xIELU (arXiv 2411.13010) in float64 from its definition: ``alpha_p = softplus(raw_p)``,
    ``alpha_n = beta + softplus(raw_n)``; ``alpha_p x^2 + beta x`` for ``x > 0``, else
    ``alpha_n (e^min(x, eps) - 1 - x) + beta x``."""
    alpha_p = math.log1p(math.exp(raw_p))
    alpha_n = beta + math.log1p(math.exp(raw_n))
    xd = x.double()
    positive = alpha_p * xd * xd + beta * xd
    negative = alpha_n * (torch.exp(torch.clamp(xd, max=eps)) - 1 - xd) + beta * xd
    return torch.where(xd > 0, positive, negative)


def _state(raw_p: float, raw_n: float, beta: float, eps: float) -> dict[str, torch.Tensor]:
    return {"alpha_p": torch.tensor([raw_p]), "alpha_n": torch.tensor([raw_n]),
            "beta": torch.tensor(beta), "eps": torch.tensor(eps)}


@pytest.mark.parametrize("raw_p,raw_n,beta,eps", [(1.2, -0.4, 0.3, -1e-6),
                                                  (-0.6, 0.9, 0.8, -1e-3)])
def test_xielu_matches_its_definition(raw_p: float, raw_n: float, beta: float,
                                      eps: float) -> None:
    act = XIELU()
    act.load_state_dict(_state(raw_p, raw_n, beta, eps))
    x = _inputs()
    want = _xielu_reference(x, raw_p, raw_n, beta, eps)
    torch.testing.assert_close(act(x).double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xielu_is_hf_bit_for_bit(dtype: torch.dtype) -> None:
    """The same torch ops on the same dtypes as HF's (parameters in the model dtype, as HF
    builds them in ``config.dtype``): equal bits in bf16 too."""
    state = _state(0.7, -1.1, 0.45, -1e-6)
    hf = XIELUActivation(dtype=dtype)
    hf.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    mine = XIELU().to(dtype)
    mine.load_state_dict(state)
    x = _inputs(dtype)
    got = mine(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got, hf(x), rtol=0, atol=0)


def test_xielu_defaults_are_hfs_init() -> None:
    """Before loading (a checkpoint without ``beta`` / ``eps`` keeps these): HF's initial
    values, alpha_p 0.8 and alpha_n 0.8 after their softplus."""
    mine, hf = XIELU(), XIELUActivation(dtype=torch.float32)
    torch.testing.assert_close(mine(_inputs()), hf(_inputs()))
    assert getattr(mine.beta, "optional", False) and getattr(mine.eps, "optional", False)
    assert not getattr(mine.alpha_p, "optional", False)


def test_dense_mlp_names_the_supported_activations() -> None:
    mlp = DenseMLP(16, 24, "xielu")
    assert sorted(n for n, _ in mlp.named_parameters()) == [
        "act_fn.alpha_n", "act_fn.alpha_p", "act_fn.beta", "act_fn.eps", "down_proj.weight",
        "up_proj.weight"]
    with pytest.raises(ValueError, match=r"hidden_act must be one of 'relu2', .*'gelu_10'"):
        DenseMLP(16, 24, "gelu_10")
    with pytest.raises(ValueError, match=r"activation_function must be one of"):
        DenseMLP(16, 24, "gelu_10", act_field="activation_function")


@pytest.mark.parametrize("name", ["gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast",
                                  "quick_gelu", "relu", "silu", "relu2"])
def test_elementwise_activations_are_hfs(name: str) -> None:
    """Each parameter-free dense activation against transformers' ACT2FN of the same name,
    fp32 and bf16 (the same ops in the input dtype: bit for bit)."""
    from transformers.activations import ACT2FN

    x = torch.randn(4, 33, generator=torch.Generator().manual_seed(5)) * 3
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        torch.testing.assert_close(DenseMLP(8, 8, name).act_fn(xd), ACT2FN[name](xd),
                                   rtol=0, atol=0)
