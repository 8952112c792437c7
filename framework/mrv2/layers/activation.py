"""Activations: those of gated MLPs (``[gate | up]`` in, ``act(gate) * up`` out) and those of
dense (non-gated) MLPs, ``act(x)`` elementwise."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mrv2_kernels.norm import silu_and_mul


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for an input laid out ``[..., 2 * d]`` as ``[gate | up]``.

    One fused kernel (:func:`mrv2_kernels.norm.silu_and_mul`) on the Triton path.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """``gelu(gate, approximate="tanh") * up`` for ``[..., 2 * d]`` laid out ``[gate | up]``
    (HF's ``gelu_pytorch_tanh``: Gemma's GeGLU), in torch and in the input dtype, as HF
    computes it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


#: Gated activations by HF ``hidden_act`` name.
ACTIVATIONS: dict[str, type[nn.Module]] = {"silu": SiluAndMul,
                                           "gelu_pytorch_tanh": GeluTanhAndMul}


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU, ``relu(x) ** 2`` in the input dtype (HF's ``ACT2FN["relu2"]``)."""
    return torch.square(F.relu(x))


class ReLUSquared(nn.Module):
    """:func:`relu2` as a module (Arcee's and Nemotron-H's dense MLPs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return relu2(x)


def _softplus_inverse(y: float) -> float:
    return math.log(math.expm1(y))


class XIELU(nn.Module):
    """xIELU (arXiv 2411.13010; Apertus' MLPs), as HF's ``XIELUActivation`` computes it in
    torch: with ``a_p = softplus(alpha_p)`` and ``a_n = beta + softplus(alpha_n)``,
    ``a_p * x * x + beta * x`` where ``x > 0``, else ``(expm1(min(x, eps)) - x) * a_n +
    beta * x``.

    ``alpha_p`` / ``alpha_n`` ``[1]`` are the checkpoint's learned values *before* the
    softplus (``mlp.act_fn.alpha_p`` / ``alpha_n``, one pair a layer); ``beta`` and ``eps``
    (0-d; HF's buffers, saved in its checkpoints) load too where the checkpoint has them and
    keep HF's defaults, 0.5 and -1e-6, where it does not. All four are parameters of the model
    dtype, as HF builds them in ``config.dtype``, and every step is the same torch op on the
    same dtypes as HF's (so bf16 rounds as HF's does). Replicated under tensor parallelism
    (elementwise, scalar parameters)."""

    def __init__(self, alpha_p_init: float = 0.8, alpha_n_init: float = 0.8,
                 beta: float = 0.5, eps: float = -1e-6) -> None:
        super().__init__()
        self.alpha_p = nn.Parameter(torch.tensor([_softplus_inverse(alpha_p_init)]))
        self.alpha_n = nn.Parameter(torch.tensor([_softplus_inverse(alpha_n_init - beta)]))
        self.beta = nn.Parameter(torch.tensor(beta))
        self.eps = nn.Parameter(torch.tensor(eps))
        for constant in (self.beta, self.eps):  # (HF's defaults where a checkpoint lacks them)
            constant.optional = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(
            x > 0,
            alpha_p * x * x + self.beta * x,
            (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x,
        )


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


#: Elementwise activations as HF's ``ACT2FN`` computes them in torch, in the input dtype
#: (``gelu``: erf; ``gelu_new`` / ``gelu_fast``: its tanh formulas; ``gelu_pytorch_tanh``:
#: torch's tanh approximation; ``quick_gelu``: ``x * sigmoid(1.702 x)``).
_ELEMENTWISE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "gelu_fast": _gelu_fast,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "silu": F.silu,
}


class Elementwise(nn.Module):
    """One of HF's parameter-free activations by name (:data:`DENSE_ACTIVATIONS`)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.fn = _ELEMENTWISE[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def extra_repr(self) -> str:
        return self.name


#: Dense (non-gated) MLP activations by HF ``hidden_act`` name: a module factory each (xIELU
#: takes its initial values as keywords).
DENSE_ACTIVATIONS: dict[str, Callable[..., nn.Module]] = {
    "relu2": ReLUSquared, "xielu": XIELU,
    **{name: functools.partial(Elementwise, name) for name in _ELEMENTWISE},
}


def dense_activation(name: str, field: str = "hidden_act", **kwargs: Any) -> nn.Module:
    """The :data:`DENSE_ACTIVATIONS` module of HF's activation ``name`` (``config.<field>``);
    ValueError naming the field and the supported ones for any other."""
    if name not in DENSE_ACTIVATIONS:
        raise ValueError(f"{field} must be one of {', '.join(map(repr, DENSE_ACTIVATIONS))} "
                         f"for a dense (non-gated) MLP, got {name!r}")
    return DENSE_ACTIVATIONS[name](**kwargs)
