"""A model's integer-weight layers as a whole (GPTQ, AWQ, compressed-tensors, MXFP4 experts):
which layers become integer before loading (:func:`apply_int_quant`, by the checkpoint's names
of their packed weights: :func:`int_layer_names`), what a checkpoint may leave out once the
model leaves the meta device (:func:`fill_int_defaults`), random weights for
``load_format="dummy"`` (:func:`draw_int_weights`) and the memory they take
(:func:`log_int_memory`). The layers: :mod:`mrv2.layers.int_quant` (linear),
:mod:`mrv2.layers.int_quant_moe` (routed experts), :mod:`mrv2.layers.int_lm_head`."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mrv2.layers.embedding import LMHead
from mrv2.layers.int_lm_head import IntLMHead, int_lm_head
from mrv2.layers.int_quant import IntLinearMixin, to_int
from mrv2.layers.int_quant_config import IntQuantConfig
from mrv2.layers.int_quant_moe import IntFusedMoE, experts_to_int
from mrv2.layers.linear import LinearBase
from mrv2.layers.moe import FusedMoE
from mrv2.layers.weights import checkpoint_target

logger = logging.getLogger(__name__)


def apply_int_quant(model: nn.Module, quant: IntQuantConfig,
                    checkpoint_layers: Iterable[str] | None = None,
                    dtype: torch.dtype = torch.float32) -> int:
    """Make the model's linear layers and routed experts integer-weight before loading: those
    ``checkpoint_layers`` names (the modules the checkpoint's packed weights load into), or
    with None every linear layer not in ``quant.skip`` and every expert stack. Returns how
    many."""
    chosen = None if checkpoint_layers is None else set(checkpoint_layers)
    count = 0
    for name, module in model.named_modules():
        if chosen is not None and name not in chosen:
            continue
        if isinstance(module, LinearBase) and not isinstance(module, IntLinearMixin):
            if quant.experts_only or chosen is None and any(s in name for s in quant.skip):
                continue
            to_int(module, quant, dtype)
            count += 1
        elif type(module) is FusedMoE:
            experts_to_int(module, quant, dtype)
            count += 1
        elif chosen is not None and type(module) is LMHead:  # (random weights: float head)
            int_lm_head(module, quant)
            count += 1
    if chosen is not None and count < len(chosen):
        done = {n for n, m in model.named_modules()
                if isinstance(m, (IntLinearMixin, IntFusedMoE, IntLMHead))}
        raise ValueError(f"the checkpoint quantizes {sorted(chosen - done)[0]}, which is not "
                         f"a linear layer or an expert stack of {type(model).__name__}")
    return count


def _int_modules(model: nn.Module) -> list[Any]:
    return [m for m in model.modules() if isinstance(m, (IntLinearMixin, IntFusedMoE))]


def fill_int_defaults(model: nn.Module) -> None:
    """Every integer layer's ``fill_defaults`` (after ``to_empty``)."""
    for module in _int_modules(model):
        module.fill_defaults()


def int_layer_names(model: nn.Module, names: Iterable[str]) -> list[str]:
    """The model's module names the checkpoint's packed weights (``*.qweight``,
    ``*.weight_packed``) load into (through the model's ``rename`` and stacking): linear
    layers, and the expert stacks their experts' tensors go to (``<experts>.w13_qweight``)."""
    rename = getattr(model, "rename", lambda name: name)
    stacked = getattr(model, "stacked_params", ())
    out = []
    for name in names:
        if not name.endswith((".qweight", ".weight_packed")):
            continue
        target = checkpoint_target(name, stacked, rename)
        if target is None:
            continue
        module, _, param = target[0].rpartition(".")
        out.append(module if param.startswith(("w13_", "w2_")) else
                   target[0][: -len("." + name.rsplit(".", 1)[1])])
    return out


def draw_int_weights(model: nn.Module, seed: int, std: float) -> None:
    """Random integer weights for ``load_format="dummy"``: uniform integers, scales that give
    the weights a spread of about ``std``, random zero points near the midpoint."""
    gen: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for module in _int_modules(model):
            if isinstance(module, IntFusedMoE):
                roles = [(module.role(s, "qweight"), module.role(s, "scales"),
                          module.role(s, "qzeros")) for s in ("w13", "w2")]
            else:
                roles = [(module.role("qweight"), module.role("scales"), module.role("qzeros"))]
            levels = 1 << module.quant.bits
            for qweight, scales, zeros in roles:
                assert qweight is not None and scales is not None
                dev = qweight.device
                g = gen.setdefault(dev, torch.Generator(dev).manual_seed(seed))
                top = 1 << 31
                for rows in qweight.data.view(-1, qweight.shape[-1]).split(1 << 16):
                    rows.copy_(torch.randint(-top, top, rows.shape, generator=g, device=dev,
                                             dtype=torch.int64).to(torch.int32))
                if module.quant.fp4:  # uniform codes: an rms of 2.93 units
                    scales.data.fill_(127 + round(math.log2(std / 2.93)))
                else:
                    scales.data.fill_(std * (12 ** 0.5) / levels)
                if zeros is not None and not module.quant.sym:
                    mid = levels // 2
                    zeros.data.copy_(torch.randint(mid - 1, mid + 2, zeros.shape, generator=g,
                                                   device=dev))


def log_int_memory(model: nn.Module, dtype: torch.dtype) -> None:
    """Log the integer layers' bytes and what they save against ``dtype``."""
    own = saved = 0
    width = torch.empty((), dtype=dtype).element_size()
    for module in _int_modules(model):
        b = sum(p.numel() * p.element_size() for p in module.parameters()
                if p is not getattr(module, "bias", None))
        own += b
        if isinstance(module, IntLinearMixin):
            saved += module.input_size * module.output_size * width - b
        else:  # an expert stack: 3 * E * H * I weights
            saved += 3 * module.num_experts * module.hidden_size * module.intermediate_size \
                * width - b
    if own:
        logger.info("integer linear weights: %.2f GB (%.2f GB saved against %s)", own / 1e9,
                    saved / 1e9, dtype)
