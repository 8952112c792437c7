"""Block-quantized FP8 weights for the linear layers (DeepSeek-V3 / GLM-4.x-FP8 checkpoints,
or any bf16 checkpoint with ``quantization="fp8"``).

A checkpoint says ``quantization_config = {"quant_method": "fp8", "activation_scheme":
"dynamic", "weight_block_size": [128, 128]}`` and stores each quantized linear weight ``W [N,
K]`` as ``float8_e4m3fn`` with ``weight_scale_inv [ceil(N/128), ceil(K/128)]`` (fp32): the real
weight is the fp8 value times the scale of its 128 x 128 block. Activations are quantized per
token and group of 128 on the fly (:func:`mrv2_kernels.fp8_gemm.block_fp8_linear`).

**Scales per row.** The layers keep ``weight_scale_inv`` expanded to one row per output row,
``[N, ceil(K/128)]`` (a block of ``(1, 128)`` for the kernel): a fused layer (``qkv_proj``,
``gate_up_proj``) is assembled from separately quantized shards whose row offsets need not be
multiples of 128, and per-row scales place each shard's scales exactly, whatever its offset. The
cost is ``4 / 128`` bytes per weight (3% of the fp8 bytes); the GEMM reads one scale per
output column and K step either way.

The routed experts (:class:`~mrv2.layers.moe.FusedMoE`) work the same way: ``w13_weight``
``[E, 2I, H]`` and ``w2_weight`` ``[E, H, I]`` in fp8 with per-row scales
``w13_weight_scale_inv [E, 2I, ceil(H/128)]`` and ``w2_weight_scale_inv [E, H, ceil(I/128)]``
(each expert's gate, up and down ``weight_scale_inv`` placed by its shard), run by the fused
MoE's FP8 path (:mod:`mrv2_kernels.fused_moe_fp8`).

Which layers: those whose ``weight_scale_inv`` the checkpoint holds; with random weights
(``load_format="dummy"``) or ``quantization="fp8"`` every :class:`~mrv2.layers.linear.LinearBase`
(attention and MLP projections; embeddings, the LM head and routers are not linear layers and
stay in the model dtype, as in the published checkpoints). A bf16 checkpoint with
``quantization="fp8"`` loads in the model dtype and is quantized per 128 x 128 block right
after loading. On the CPU the weights are dequantized once after loading (the CPU path is the
reference: ``weight = fp8 * scale`` in the model dtype).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from mrv2.layers.int_quant_config import CHECKPOINT_METHODS, INT_METHODS
from mrv2.layers.linear import FusedColumnLinear, LinearBase, QKVLinear
from mrv2.layers.moe import FusedMoE
from mrv2.layers.weights import apply_moving_only
from mrv2_kernels.fp8_gemm import (
    block_fp8_linear,
    dequantize_weight_block_fp8,
    quantize_weight_block_fp8,
)
from mrv2_kernels.fused_moe import fused_moe
from mrv2_kernels.fused_moe_fp8 import (
    dequantize_experts,
    expand_scales_per_row,
    quantize_experts_fp8,
)

FP8 = torch.float8_e4m3fn
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fp8Config:
    """How a model's linear layers are quantized."""

    block: tuple[int, int]
    """The checkpoint's (or the requested) weight block ``(rows, cols)``."""
    from_checkpoint: bool
    """Whether the checkpoint stores fp8 weights (else the model dtype, quantized at load)."""


def fp8_config_of(hf_config: Any, requested: str | None) -> Fp8Config | None:
    """The FP8 setting of a model: its ``quantization_config`` (only block-quantized ``fp8``
    with dynamic activations is supported; anything else is a ``ValueError`` naming the field;
    GPTQ and AWQ are :mod:`mrv2.layers.int_quant`'s, None here), else ``requested``
    (``"fp8"``: quantize at load with 128 x 128 blocks; None or an integer method: None)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None:
        get = qc.get if isinstance(qc, dict) else (lambda k, d=None: getattr(qc, k, d))
        method = get("quant_method")
        if str(method).lower() in CHECKPOINT_METHODS:
            return None  # integer / MXFP4 weights: mrv2.layers.int_quant
        if method != "fp8":
            raise ValueError(f"config.json quantization_config.quant_method = {method!r}: "
                             "allowed values are 'fp8' (block-quantized e4m3), 'gptq', "
                             "'awq', 'compressed-tensors' and 'mxfp4'")
        block = get("weight_block_size")
        if not block or len(block) != 2:
            raise ValueError(f"config.json quantization_config.weight_block_size = {block!r}: "
                             "per-tensor fp8 is not supported; need [rows, cols], e.g. [128, 128]")
        scheme = get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"config.json quantization_config.activation_scheme = {scheme!r}: "
                             "only 'dynamic' is supported")
        if get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"config.json quantization_config.fmt = {get('fmt')!r}: only "
                             "'e4m3' is supported")
        if requested not in (None, "fp8"):
            raise ValueError(f"quantization={requested!r}: the checkpoint is fp8")
        return Fp8Config((int(block[0]), int(block[1])), True)
    if requested is None or requested in INT_METHODS:
        return None
    if requested != "fp8":
        raise ValueError(f"quantization={requested!r}: allowed values are None, 'fp8', "
                         f"{', '.join(map(repr, INT_METHODS))}")
    return Fp8Config((128, 128), False)


class Fp8LinearMixin(LinearBase):
    """Mixed into a linear layer's class by :func:`to_fp8`: an fp8 ``weight`` ``[N, K]`` and
    per-row ``weight_scale_inv`` ``[N, ceil(K/bk)]`` (fp32), the block-FP8 GEMM as forward."""

    fp8_block: tuple[int, int]
    base_class: type[LinearBase]
    weight_scale_inv: nn.Parameter
    #: The model's dtype (what the CPU dequantizes to).
    model_dtype: torch.dtype = torch.float32

    def fp8_init(self, block: tuple[int, int], fp8_weights: bool) -> None:
        """Add the scale; with ``fp8_weights`` the weight becomes fp8 now (a checkpoint's fp8
        tensors or drawn ones load into it), else it is quantized after loading."""
        self.fp8_block = block
        n, k = self.weight.shape
        device = self.weight.device
        if fp8_weights:
            loader = self.weight.weight_loader  # type: ignore[attr-defined]
            self.weight = nn.Parameter(torch.empty(n, k, dtype=FP8, device=device),
                                       requires_grad=False)
            self.weight.weight_loader = loader  # type: ignore[attr-defined]
            # the checkpoint's scales load here (a model-dtype weight gets its scales when it
            # is quantized, after loading)
            self.weight_scale_inv = nn.Parameter(
                torch.ones(n, -(-k // block[1]), dtype=torch.float32, device=device),
                requires_grad=False)
            self.weight_scale_inv.weight_loader = self.scale_loader  # type: ignore[attr-defined]

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                     shard_id: object = None) -> None:
        """A checkpoint ``weight_scale_inv`` (one row per ``fp8_block[0]`` weight rows) into the
        per-row scales of shard ``shard_id``'s rows (this rank's rows and column blocks)."""
        start, size = self.shard_rows(shard_id)
        if shard_id is None:
            full = getattr(self, "full_output_size", size)
        elif isinstance(self, QKVLinear) and shard_id != "q":  # (replicated on some ranks)
            full = self.total_kv_heads * self.head_dim
        else:  # the whole shard's rows: this rank's, times the ranks
            full = size * self.tp_size
        rows = loaded.float().repeat_interleave(self.fp8_block[0], dim=0)[:full]
        if self.tp_size > 1:
            rows = self._rank_scales(rows, shard_id)
        if rows.shape != (size, param.shape[1]):
            raise ValueError(f"weight_scale_inv of shape {tuple(loaded.shape)} does not cover "
                             f"{size} rows x {param.shape[1]} column blocks of {self.fp8_block}")
        with torch.no_grad():
            param.data.narrow(0, start, size).copy_(rows)

    def _rank_scales(self, rows: torch.Tensor, shard_id: object) -> torch.Tensor:
        """This rank's part of per-row scales for the whole weight (of shard ``shard_id``)."""
        if shard_id is not None and isinstance(self, FusedColumnLinear):
            return self.shard_part(rows, shard_id)
        full_in = getattr(self, "full_input_size", None)
        if full_in is None:  # column-parallel: this rank's rows
            return self.rank_part(rows, False)
        block = self.fp8_block[1]  # row-parallel: this rank's column blocks
        if self.input_size % block:
            raise ValueError(f"a row-parallel fp8 layer's input slice ({self.input_size} = "
                             f"{full_in} / tensor_parallel_size) must be a multiple of the "
                             f"checkpoint's block ({block})")
        per = self.input_size // block
        return rows.narrow(1, self.tp_rank * per, per)

    def _apply(self, fn: Any, recurse: bool = True) -> Fp8LinearMixin:
        # ``model.to(dtype)`` must move the fp8 weight and fp32 scales, never cast them (a
        # model-dtype weight, quantized after loading, converts as usual)
        names = ["weight_scale_inv", *(["weight"] if self.weight.dtype == FP8 else [])]
        apply_moving_only(self, names, lambda f: super(Fp8LinearMixin, self)._apply(f, recurse),
                          fn)
        return self

    def process_weights_after_loading(self) -> None:
        """Quantize a model-dtype weight (per ``fp8_block``, scales expanded per row); on the
        CPU dequantize instead and become the plain layer again."""
        with torch.no_grad():
            if self.weight.dtype != FP8:
                w_fp8, scale = quantize_weight_block_fp8(self.weight.data, self.fp8_block)
                self.weight.data = w_fp8
                rows = expand_scales_per_row(scale, w_fp8.shape[0], self.fp8_block[0])
                self.weight_scale_inv = nn.Parameter(rows, requires_grad=False)
                self.fp8_block = (1, self.fp8_block[1])
            elif self.fp8_block[0] != 1:
                self.fp8_block = (1, self.fp8_block[1])
            if self.weight.device.type == "cpu":
                self.weight.data = self.dequantized(self.model_dtype)
                del self.weight_scale_inv
                self.__class__ = self.base_class  # type: ignore[assignment]
                LinearBase.process_weights_after_loading(self)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as ``fp8 * scale`` in ``dtype`` (once loaded: per-row scales)."""
        # loaded scales are per row whatever the checkpoint's block rows
        return dequantize_weight_block_fp8(self.weight, self.weight_scale_inv,
                                           (1, self.fp8_block[1]), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(block_fp8_linear(x, self.weight, self.weight_scale_inv,
                                            self.bias if self.adds_bias else None,
                                            self.fp8_block, out_dtype=x.dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8 block={self.fp8_block}"


_FP8_CLASSES: dict[type[LinearBase], type[Fp8LinearMixin]] = {}


def _fp8_class(cls: type[LinearBase]) -> type[Fp8LinearMixin]:
    if cls not in _FP8_CLASSES:
        _FP8_CLASSES[cls] = cast(type[Fp8LinearMixin], type(
            f"Fp8{cls.__name__}", (Fp8LinearMixin, cls), {"base_class": cls}))
    return _FP8_CLASSES[cls]


def to_fp8(layer: LinearBase, block: tuple[int, int], fp8_weights: bool) -> Fp8LinearMixin:
    """Turn ``layer`` into its FP8 variant in place (see :class:`Fp8LinearMixin`)."""
    layer.__class__ = _fp8_class(type(layer))
    fp8 = cast(Fp8LinearMixin, layer)
    fp8.fp8_init(block, fp8_weights)
    return fp8


_EXPERT_PARAMS = ("w13_weight", "w2_weight")


class Fp8FusedMoE(FusedMoE):
    """A :class:`FusedMoE` turned FP8 by :func:`experts_to_fp8`: fp8 ``w13_weight`` /
    ``w2_weight`` with per-row fp32 ``w13_weight_scale_inv`` / ``w2_weight_scale_inv``."""

    fp8_block: tuple[int, int]
    w13_weight_scale_inv: nn.Parameter
    w2_weight_scale_inv: nn.Parameter
    model_dtype: torch.dtype = torch.float32

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                     shard_id: tuple[int, str] | None = None) -> None:
        """One expert's gate / up / down ``weight_scale_inv`` (a row per ``fp8_block[0]``
        weight rows) into its rows of the per-row scales."""
        if shard_id is None:
            raise ValueError("fp8 expert scales load one expert's gate, up or down at a time")
        expert_id, kind = shard_id
        expert = self.local_expert(expert_id)
        if expert is None:
            return  # another rank's expert (expert parallelism)
        inter = self.intermediate_size
        if kind == "down":
            target = param.data[expert]
        else:
            target = param.data[expert, :inter] if kind == "gate" else param.data[expert, inter:]
        full_rows = target.shape[0] * (self.tp_size if kind != "down" else 1)
        rows = loaded.float().repeat_interleave(self.fp8_block[0], dim=0)[:full_rows]
        if self.tp_size > 1:
            if kind != "down":  # this rank's rows of the gate / up projection
                rows = rows.narrow(0, self.tp_rank * inter, inter)
            else:  # this rank's column blocks of the down projection
                block = self.fp8_block[1]
                if inter % block:
                    raise ValueError(
                        f"fp8 experts' intermediate slice ({inter} = moe intermediate size / "
                        f"tensor_parallel_size) must be a multiple of the block ({block})")
                rows = rows.narrow(1, self.tp_rank * (inter // block), inter // block)
        if rows.shape != target.shape:
            raise ValueError(f"weight_scale_inv of shape {tuple(loaded.shape)} does not cover "
                             f"{tuple(target.shape)} (rows x column blocks of {self.fp8_block})")
        with torch.no_grad():
            target.copy_(rows)

    def _apply(self, fn: Any, recurse: bool = True) -> Fp8FusedMoE:
        names = [n for n in (*_EXPERT_PARAMS, *(f"{p}_scale_inv" for p in _EXPERT_PARAMS))
                 if n.endswith("_scale_inv") or getattr(self, n).dtype == FP8]
        apply_moving_only(self, names, lambda f: super(Fp8FusedMoE, self)._apply(f, recurse),
                          fn)
        return self

    def process_weights_after_loading(self) -> None:
        """Quantize model-dtype experts (per ``fp8_block``, scales per row); on the CPU
        dequantize instead and become a plain :class:`FusedMoE` again."""
        with torch.no_grad():
            for name in _EXPERT_PARAMS:
                weight = getattr(self, name)
                if weight.dtype != FP8:
                    w_fp8, scale = quantize_experts_fp8(weight.data, self.fp8_block)
                    weight.data = w_fp8
                    rows = expand_scales_per_row(scale, w_fp8.shape[1], self.fp8_block[0])
                    setattr(self, f"{name}_scale_inv", nn.Parameter(rows, requires_grad=False))
            self.fp8_block = (1, self.fp8_block[1])
            if self.w13_weight.device.type == "cpu":
                for name in _EXPERT_PARAMS:
                    getattr(self, name).data = self.dequantized(name, self.model_dtype)
                    delattr(self, f"{name}_scale_inv")
                self.__class__ = FusedMoE  # type: ignore[assignment]

    def dequantized(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Expert weights ``name`` as ``fp8 * scale`` in ``dtype`` (after loading)."""
        return dequantize_experts(getattr(self, name), getattr(self, f"{name}_scale_inv"),
                                  (1, self.fp8_block[1]), dtype)

    def _experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 valid: torch.Tensor | None) -> torch.Tensor:
        return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                         w13_scale=self.w13_weight_scale_inv, w2_scale=self.w2_weight_scale_inv,
                         block=self.fp8_block, valid_tokens=valid, **self.epilogue())


def experts_to_fp8(moe: FusedMoE, block: tuple[int, int], fp8_weights: bool) -> Fp8FusedMoE:
    """Turn ``moe`` into an :class:`Fp8FusedMoE` in place (fp8 weights now, or after loading)."""
    moe.__class__ = Fp8FusedMoE
    fp8 = cast(Fp8FusedMoE, moe)
    fp8.fp8_block = block
    if fp8_weights:
        for name in _EXPERT_PARAMS:
            weight = getattr(fp8, name)
            e, n, k = weight.shape
            new = nn.Parameter(torch.empty(e, n, k, dtype=FP8, device=weight.device),
                               requires_grad=False)
            new.weight_loader = fp8.weight_loader  # type: ignore[attr-defined]
            setattr(fp8, name, new)
            scale = nn.Parameter(torch.ones(e, n, -(-k // block[1]), dtype=torch.float32,
                                            device=weight.device), requires_grad=False)
            scale.weight_loader = fp8.scale_loader  # type: ignore[attr-defined]
            setattr(fp8, f"{name}_scale_inv", scale)
    return fp8


def apply_fp8(model: nn.Module, config: Fp8Config, dummy: bool,
              checkpoint_names: Iterable[str] = (), dtype: torch.dtype = torch.float32) -> int:
    """Make the model's linear layers FP8 before loading: for an fp8 checkpoint those whose
    scales ``checkpoint_names`` holds (the model's parameter names the checkpoint's
    ``*.weight_scale_inv`` load into: ``<layer>.weight_scale_inv``,
    ``<experts>.w13_weight_scale_inv``); otherwise every linear layer and routed
    expert stack. ``dtype``: the model's (what the CPU dequantizes to). Returns how many were
    converted."""
    chosen: set[str] | None = None
    if config.from_checkpoint and not dummy:
        # the weights the scales belong to: "<layer>.weight", "<experts>.w13_weight", ...
        chosen = {n[: -len("_scale_inv")] for n in checkpoint_names if n.endswith("_scale_inv")}
    fp8_weights = config.from_checkpoint or dummy
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and not isinstance(module, Fp8LinearMixin) and (
                chosen is None or f"{name}.weight" in chosen):
            to_fp8(module, config.block, fp8_weights).model_dtype = dtype
            count += 1
        elif type(module) is FusedMoE and (chosen is None or f"{name}.w13_weight" in chosen):
            experts_to_fp8(module, config.block, fp8_weights).model_dtype = dtype
            count += 1
    return count


def _fp8_pairs(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(fp8 weight, its scales)`` of an FP8 layer or expert stack; none for other modules."""
    if isinstance(module, Fp8LinearMixin) and module.weight.dtype == FP8:
        return [(module.weight, module.weight_scale_inv)]
    if isinstance(module, Fp8FusedMoE) and module.w13_weight.dtype == FP8:
        return [(module.w13_weight, module.w13_weight_scale_inv),
                (module.w2_weight, module.w2_weight_scale_inv)]
    return []


def draw_fp8_weights(model: nn.Module, seed: int, std: float) -> None:
    """Random fp8 weights for ``load_format="dummy"``: standard normal fp8 values with every
    scale ``std`` (the weights then have the model's usual spread, and fp8 resolves them)."""
    gen: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for module in model.modules():
            for w, scale in _fp8_pairs(module):
                g = gen.setdefault(w.device, torch.Generator(w.device).manual_seed(seed))
                for rows in w.data.view(-1, w.shape[-1]).split(4096):
                    rows.copy_(torch.randn(rows.shape, generator=g, device=w.device).clamp(-8, 8))
                scale.data.fill_(std)


def log_fp8_memory(model: nn.Module, dtype: torch.dtype) -> None:
    """Log the fp8 layers' bytes and what they save against ``dtype``."""
    fp8_bytes = saved = 0
    width = torch.empty((), dtype=dtype).element_size()
    for module in model.modules():
        for w, scale in _fp8_pairs(module):
            own = w.numel() + scale.numel() * 4
            fp8_bytes += own
            saved += w.numel() * width - own
    if fp8_bytes:
        logger.info("fp8 linear weights: %.2f GB (%.2f GB saved against %s)", fp8_bytes / 1e9,
                    saved / 1e9, dtype)
