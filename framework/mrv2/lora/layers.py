"""LoRA slots on a model's linear layers.

:func:`add_lora_slots` gives every adaptable linear layer of a model (the attention and MLP
projections of the text model, :data:`TARGET_NAMES`, and those the model's class names in
``lora_targets``) ``max_loras`` adapter slots and a forward
that adds each token's adapter update (:func:`mrv2_kernels.lora.lora_apply`). The layer's
class is swapped for a subclass, so every attribute the model reads stays as it was; the fused
norm + product kernel of decode steps steps aside for these layers while adapters run
(:func:`mrv2.layers.linear.norm_linear` fuses layers that :meth:`~LinearBase.runs_plain`).

A fused layer (``qkv_proj``, ``gate_up_proj``) holds one rank-``R`` block per shard: slot
``s``'s ``lora_a[s]`` is ``[shards * R, in]`` (shard ``i``'s ``A`` in rows ``i*R``...) and
``lora_b[s]`` ``[out, shards * R]`` is block-diagonal (shard ``i``'s ``B`` in its output rows
and columns ``i*R``...), so one shrink and one expand serve all the shards. With tensor
parallelism a layer keeps this rank's part, as its weight: a column-parallel layer this rank's
rows of ``B``, a row-parallel one its columns of ``A`` (the partial updates are summed with
the outputs).

The update applies only inside a forward pass whose context carries ``lora_slots`` (the
runner's, with the engine serving adapters): the same layers run plain elsewhere.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from mrv2.contract.forward_context import current_forward_context
from mrv2.distributed.parallel_state import all_reduce
from mrv2.layers.linear import (
    FusedColumnLinear,
    LinearBase,
    MergedColumnLinear,
    QKVLinear,
    RowLinear,
)
from mrv2_kernels.lora import lora_apply
from mrv2_kernels.norm_gemv import decode_linear

#: The linear layers that take adapters, by their last name: the usual attention and MLP
#: projections (HF's names, and mrv2's fused ones); a model class adds its own names as
#: ``lora_targets`` (:func:`target_names`).
TARGET_NAMES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj",
                          "up_proj", "down_proj", "gate_up_proj"})


def shard_ids(layer: LinearBase) -> list[Any]:
    """The checkpoint shards a layer is fused from, in order (``[None]``: not fused)."""
    if isinstance(layer, QKVLinear):
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnLinear):
        return list(range(len(layer.output_sizes)))
    return [None]


class LoRALinearMixin(LinearBase):
    """Mixed into a linear layer's class by :func:`add_lora_slots`: ``lora_a`` ``[L, S*R,
    in]`` and ``lora_b`` ``[L, out, S*R]`` (``L`` slots, ``S`` shards, rank ``R``)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    lora_rank: int
    #: The base class's forward is :class:`LinearBase`'s (the update joins before the reduce).
    lora_plain: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = current_forward_context()
        slots = ctx.lora_slots if ctx is not None else None
        if slots is None:
            return super().forward(x)
        if self.lora_plain:
            y = decode_linear(x, self.weight, self.bias if self.adds_bias else None)
            lora_apply(x, y, self.lora_a, self.lora_b, slots)
            return self.reduce(y)
        y = super().forward(x)  # (a quantized layer's own product, reduced)
        if isinstance(self, RowLinear) and self.tp_size > 1 and self.reduce_output:
            delta = lora_apply(x, torch.zeros_like(y), self.lora_a, self.lora_b, slots)
            return y + all_reduce(delta)
        return lora_apply(x, y, self.lora_a, self.lora_b, slots)

    def runs_plain(self) -> bool:
        """The plain product while no adapter runs (the forward context carries no
        ``lora_slots``): a decode step's norm fuses into it then."""
        ctx = current_forward_context()
        return self.lora_plain and (ctx is None or ctx.lora_slots is None)

    def shard_slice(self, shard: Any) -> tuple[int, int]:
        """``(column of lora_a/lora_b's rank block, first output row)`` of ``shard``."""
        index = shard_ids(self).index(shard)
        start = self.shard_rows(shard)[0] if isinstance(self, FusedColumnLinear) else 0
        return index * self.lora_rank, start

    def whole_shard_rows(self) -> list[int]:
        """Each shard's rows in the whole (every rank's) fused checkpoint tensor, in
        :func:`shard_ids`' order: an adapter trained on the fused module (Phi-3's
        ``qkv_proj``) holds one ``B`` over all of them."""
        if isinstance(self, QKVLinear):
            kv = self.total_kv_heads * self.head_dim
            return [self.num_heads * self.tp_size * self.head_dim, kv, kv]
        assert isinstance(self, MergedColumnLinear)
        return [rows * self.tp_size for rows in self.output_sizes]

    def rank_a(self, a: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole ``A`` ``[r, in]``: a row-parallel layer's columns."""
        if isinstance(self, RowLinear) and self.tp_size > 1:
            return self.rank_part(a, False)
        return a

    def rank_b(self, b: torch.Tensor, shard: Any) -> torch.Tensor:
        """This rank's rows of a whole ``B`` ``[out, r]`` of ``shard``."""
        if isinstance(self, FusedColumnLinear):
            return self.shard_part(b, shard)
        if self.tp_size > 1 and not isinstance(self, RowLinear):
            return self.rank_part(b, False)
        return b


_LORA_CLASSES: dict[type[LinearBase], type[LoRALinearMixin]] = {}


def _lora_class(cls: type[LinearBase]) -> type[LoRALinearMixin]:
    if cls not in _LORA_CLASSES:
        _LORA_CLASSES[cls] = cast(type[LoRALinearMixin],
                                  type(f"LoRA{cls.__name__}", (LoRALinearMixin, cls), {}))
    return _LORA_CLASSES[cls]


def is_tower_module(name: str) -> bool:
    """Whether module ``name`` belongs to a multimodal model's vision tower (``visual.*``,
    ``model.visual.*``, ``vision_tower.*``...), which takes no adapters."""
    return any(p.startswith(("visual", "vision")) for p in name.split("."))


def target_names(model: torch.nn.Module) -> frozenset[str]:
    """The last names of ``model``'s adaptable layers: :data:`TARGET_NAMES` and those its class
    adds as ``lora_targets`` (a family's own projections, e.g. Qwen3-Next's
    ``in_proj_qkvz``)."""
    return TARGET_NAMES | frozenset(getattr(model, "lora_targets", ()))


def _adaptable(name: str, module: torch.nn.Module, names: frozenset[str]) -> bool:
    return (isinstance(module, LinearBase) and name.rsplit(".", 1)[-1] in names
            and not is_tower_module(name))


def add_lora_slots(model: torch.nn.Module, max_loras: int, max_rank: int,
                   dtype: torch.dtype) -> dict[str, LoRALinearMixin]:
    """Give each adaptable linear layer of ``model`` ``max_loras`` zeroed slots of rank
    ``max_rank`` (on its weight's device, in ``dtype``: the model's); returns them by name."""
    layers: dict[str, LoRALinearMixin] = {}
    names = target_names(model)
    for name, module in list(model.named_modules()):
        if not _adaptable(name, module, names):
            continue
        assert isinstance(module, LinearBase)
        shards = len(shard_ids(module))
        device = next(module.parameters()).device  # (a quantized layer has no .weight)
        plain = type(module).forward is LinearBase.forward
        module.__class__ = _lora_class(type(module))
        layer: Any = module
        layer.lora_rank = max_rank
        layer.lora_plain = plain
        layer.register_buffer("lora_a", torch.zeros(
            max_loras, shards * max_rank, module.input_size, dtype=dtype, device=device),
            persistent=False)
        layer.register_buffer("lora_b", torch.zeros(
            max_loras, module.output_size, shards * max_rank, dtype=dtype, device=device),
            persistent=False)
        layers[name] = layer
    return layers
