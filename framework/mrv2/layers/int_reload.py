"""Loading an integer model's weights again (an update of the weights, a reload, the load
after ``sleep(level=2)``): :func:`reopen_int_layers` gives every laid-out integer layer
(:class:`~mrv2.layers.int_quant.IntLinearMixin`), expert stack
(:class:`~mrv2.layers.int_quant_moe.IntFusedMoE`) and quantized LM head the checkpoint's
tensors under their names again, as before the first load: a layer kept packed (a GPU's)
points those names at its served tensors, which load in place (the CUDA graphs read them
there); a layer the CPU dequantized gets new integer tensors, dequantized into a new weight
once all of its came. Each layer's own ``process_weights_after_loading`` (and a model's that
reorders rows, which reorders only the tensors loaded since:
:func:`~mrv2.layers.weights.is_fresh`) lays out what was loaded as the first load did;
:func:`abandon_reloads` puts back those that got nothing. ``mrv2.model_loader.build.
reloading`` runs both around ``Runner.load_weights``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from torch import nn

from mrv2.layers.int_lm_head import IntLMHead
from mrv2.layers.int_quant import IntLinearMixin
from mrv2.layers.int_quant_moe import IntFusedMoE, reopen_plain_experts
from mrv2.layers.linear import LinearBase


def _reopen_plain_linear(layer: LinearBase) -> None:
    """A layer the CPU made plain (:meth:`IntLinearMixin._become_plain`) integer again, with
    empty checkpoint-named parameters to load (``"fresh"``), its weight kept aside."""
    origin = layer.__dict__.pop("_int_origin")
    cls, quant, group, dtype = origin
    stash = layer._parameters.pop("weight")
    assert stash is not None
    layer.__class__ = cls
    int_layer = cast(IntLinearMixin, layer)
    int_layer.quant, int_layer.group, int_layer.model_dtype = quant, group, dtype
    int_layer.register_buffer("input_order", None, persistent=False)
    int_layer._loading_params(stash.device)
    int_layer.fill_defaults()
    int_layer._reload_stash = (stash, origin)
    int_layer._reload = "fresh"


def reopen_int_layers(model: nn.Module) -> list[nn.Module]:
    """Before weights load again into a model whose integer layers are laid out (an update
    of the weights, a reload: ``Runner.load_weights``): every such layer, expert stack and
    quantized LM head takes the checkpoint's tensors under their names again, as at start-up
    (the packed layers in place, the layers the CPU dequantized into new integer tensors).
    Their hooks (``process_weights_after_loading``) lay out what was loaded, exactly as the
    first load did; :func:`abandon_reloads` puts back those that got nothing. Returns the
    modules reopened."""
    reopened: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, IntLinearMixin | IntFusedMoE):
            if module._laid_out:
                module.reopen_for_reload()
                reopened.append(module)
        elif isinstance(module, IntLMHead):
            if module.reopen_for_reload():
                reopened.append(module)
        elif "_int_origin" in module.__dict__:
            if isinstance(module, LinearBase):
                _reopen_plain_linear(module)
            else:
                reopen_plain_experts(module)
            reopened.append(module)
    return reopened


def abandon_reloads(modules: Iterable[nn.Module]) -> None:
    """Every module of ``modules`` (:func:`reopen_int_layers`) whose hook did not run (no
    tensor of it loaded, or the load failed) back to its served state."""
    for module in modules:
        abandon = getattr(module, "abandon_reload", None)
        if getattr(module, "_reload", None) is not None and abandon is not None:
            abandon()
