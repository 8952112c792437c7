"""The gated (SwiGLU) MLP of most decoders (and of MoE families' shared experts), and the dense
(non-gated) MLP of a few (Arcee's squared ReLU, Apertus' xIELU)."""

from __future__ import annotations

import torch
from torch import nn

from mrv2.layers.activation import ACTIVATIONS, dense_activation
from mrv2.layers.linear import (
    ColumnLinear,
    MergedColumnLinear,
    RowLinear,
    resolve_tp,
    split_evenly,
)


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))`` with gate and up fused into one
    ``gate_up_proj`` (checkpoint tensors ``gate_proj`` / ``up_proj`` load as its shards 0 / 1);
    ``act``: SiLU (SwiGLU, ``hidden_act="silu"``) or the tanh-approximated GELU (GeGLU,
    ``"gelu_pytorch_tanh"``: Gemma).

    A decoder layer may fuse the norm before a SwiGLU with ``gate_up_proj``
    (:func:`mrv2.layers.norm_linear` with ``silu_and_mul=True``) and call ``down_proj`` itself.
    """

    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu",
        bias: bool = False,
    ) -> None:
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {', '.join(map(repr, ACTIVATIONS))}, "
                             f"got {hidden_act!r}")
        self.hidden_act = hidden_act
        # (named here: the layers below would call it an "output size")
        split_evenly(intermediate_size, resolve_tp(None)[1],
                     "the MLP's intermediate_size")
        self.gate_up_proj = MergedColumnLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias
        )
        self.act_fn = ACTIVATIONS[hidden_act]()
        self.down_proj = RowLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DenseMLP(nn.Module):
    """``down_proj(act(up_proj(x)))``, no gate (HF's ``NemotronMLP``: Arcee, Apertus; GPT-NeoX's
    and StarCoder's MLPs); ``act`` by HF's ``hidden_act`` name
    (:data:`~mrv2.layers.activation.DENSE_ACTIVATIONS`: ``relu2``, ``xielu``, whose learned
    parameters load as ``mlp.act_fn.*``, the GELU variants, ``relu``, ``silu``; ``act_field``:
    the config field an error names).

    Its ``up_proj`` is a checkpoint tensor of its own: a family using it leaves ``up_proj``
    out of its ``stacked_params`` (:data:`~mrv2.layers.decoder.QKV_PARAMS`). A decoder layer
    runs the norm before it fused with ``up_proj`` (:func:`~mrv2.layers.decoder.norm_mlp`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str,
                 bias: bool = False, act_field: str = "hidden_act") -> None:
        super().__init__()
        self.act_fn = dense_activation(hidden_act, act_field)
        self.hidden_act = hidden_act
        split_evenly(intermediate_size, resolve_tp(None)[1], "the MLP's intermediate_size")
        self.up_proj = ColumnLinear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = RowLinear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))
