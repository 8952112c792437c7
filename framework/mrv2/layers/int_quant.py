"""Weight-only integer linear layers from GPTQ, AWQ and compressed-tensors checkpoints: 4- or
8-bit weights, activations in the model dtype (W4A16 / W8A16).

Formats (``config.json`` ``quantization_config``), per quantized linear layer ``W [N, K]``
(``N`` outputs, ``K`` inputs, groups of ``G`` inputs):

- **GPTQ** (``quant_method: "gptq"``; AutoGPTQ, GPTQModel, optimum): ``qweight`` int32
  ``[K/pack, N]`` packed along K (``pack = 32 / bits``, lowest bits first); ``qzeros`` int32
  ``[K/G, N/pack]`` packed along N, each stored one less than the zero point
  (``checkpoint_format: "gptq"``, the v1 format; ``"gptq_v2"`` stores them as they are);
  ``scales`` fp16 ``[K/G, N]``; ``g_idx`` int32 ``[K]``, the group of each input (``k // G``,
  unless ``desc_act`` quantized the inputs in an order of their own). ``bits`` 4 or 8,
  ``group_size`` G or -1 (one group per output), ``sym`` (zero points ``2**(bits-1)``) or not.
- **AWQ** (``quant_method: "awq"``, ``version: "gemm"``; AutoAWQ): ``qweight`` int32
  ``[K, N/8]`` packed along N in AWQ's interleaved order (nibble ``i`` of word ``j`` holds
  output ``8j + [0, 2, 4, 6, 1, 3, 5, 7][i]``), ``qzeros`` int32 ``[K/G, N/8]`` the same way,
  ``scales`` fp16 ``[K/G, N]``; 4 bits with zero points; ``modules_to_not_convert`` stay in
  the model dtype.
- **compressed-tensors** ``pack-quantized`` (``quant_method: "compressed-tensors"``;
  llm-compressor's W4A16 / W8A16): ``weight_packed`` int32 ``[N, K/pack]`` packed along K,
  each integer stored as its signed value plus ``2**(bits-1)``; ``weight_scale`` ``[N, K/G]``
  (``[N, 1]``: strategy ``channel``) in the model dtype; ``weight_zero_point`` int32
  ``[N/pack, K/G]`` packed along N (the same offset; asymmetric only); ``weight_g_idx``
  ``[K]`` (``actorder: "group"``); ``weight_shape`` ``[N, K]``. Configuration
  (:mod:`mrv2.layers.int_quant_config`): one config group of ``int`` weights, no activation
  quantization.

The real weight is ``(q - zero) * scale`` of its group (compressed-tensors' offsets cancel).
Every format loads into the one layout of :mod:`mrv2_kernels.wna16_gemm` (``qweight [K/pack,
N]`` packed along K, ``scales [K/G, N]`` in the checkpoint's dtype, ``qzeros`` uint8 ``[K/G,
N]``); the parameters keep the checkpoint's names until loading is done. Each checkpoint tensor is
unpacked on the host, cut to this rank's rows (or inputs) and its shard's place by the layer's
own tensor-parallel rules (those its float weight follows: fused q/k/v and gate/up,
column- and row-parallel layers), then packed into place. After loading, zero points that
are all the midpoint are dropped (a symmetric checkpoint's product skips them), and a
``desc_act`` layer's inputs are reordered so that its groups are contiguous: the layer then
gathers its input's features in that order (one index_select). The shards of a fused layer
must share their ``g_idx`` (GPTQ quantizes one input in one order), and a row-parallel layer
under tensor parallelism refuses ``desc_act`` (its slice of the inputs would hold parts of
many groups).

On the CPU the weight is dequantized once after loading and the layer is a plain one again,
as FP8's (:mod:`mrv2.layers.fp8`). With random weights (``load_format="dummy"``) and
``quantization="gptq"`` / ``"awq"`` every linear layer gets random 4-bit weights in groups of
128 (benchmarks). Which of a model's layers become integer, their random weights and their
memory: :mod:`mrv2.layers.int_model`. Routed experts in these formats:
:mod:`mrv2.layers.int_quant_moe`. An untied LM head the checkpoint quantizes (GPTQModel's
``quantization_config.lm_head: true``) is dequantized into the model dtype after loading
(:mod:`mrv2.layers.int_lm_head`). Loading the weights again: :mod:`mrv2.layers.int_reload`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from mrv2.layers.int_quant_config import IntQuantConfig, rows_of
from mrv2.layers.linear import FusedColumnLinear, LinearBase, RowLinear
from mrv2.layers.weights import apply_moving_only, is_fresh
from mrv2_kernels.wna16_gemm import (
    dequantize_wna16,
    pack_along_k,
    unpack_along_k,
    wna16_linear,
)


class IntLinearMixin(LinearBase):
    """Mixed into a linear layer's class by :func:`to_int`: packed integer weights, group
    scales and zero points (module docstring); :func:`~mrv2_kernels.wna16_gemm.wna16_linear`
    as forward."""

    base_class: type[LinearBase]
    quant: IntQuantConfig
    group: int
    qweight: nn.Parameter
    scales: nn.Parameter
    qzeros: nn.Parameter | None
    g_idx: nn.Parameter
    input_order: torch.Tensor | None
    model_dtype: torch.dtype = torch.float32

    def int_init(self, quant: IntQuantConfig, dtype: torch.dtype) -> None:
        """Replace the float weight by the integer layout's parameters (on its device), under
        the checkpoint's names until :meth:`order_inputs` (after loading) gives them the
        layout's (``qweight``, ``scales``, ``qzeros``)."""
        k = self.input_size
        device = self.weight.device
        group = quant.group_size
        if group <= 0 or (not quant.from_checkpoint and k % group):
            group = k  # one group of this rank's inputs (random weights: where 128 won't fit)
        if k % group or k % (32 // quant.bits):
            raise ValueError(f"a quantized layer's inputs ({k}) must divide into groups of "
                             f"{group} (quantization_config.group_size)")
        if quant.desc_act and isinstance(self, RowLinear) and self.tp_size > 1:
            raise ValueError("quantization_config.desc_act = true (an activation order) is "
                             "not supported for row-parallel layers under tensor parallelism "
                             "(tensor_parallel_size > 1); use tensor_parallel_size=1")
        self.quant, self.group, self.model_dtype = quant, group, dtype
        self.register_buffer("input_order", None, persistent=False)
        del self.weight
        self._loading_params(device)
        if device.type != "meta":
            self.fill_defaults()

    def _loading_params(self, device: torch.device, roles: tuple[str, ...] = (
            "qweight", "scales", "qzeros", "g_idx", "weight_shape")) -> None:
        """The checkpoint's tensors of ``roles`` as empty parameters under its names."""
        quant, n, k, group = self.quant, self.output_size, self.input_size, self.group
        # GPTQ and AWQ store fp16 scales, compressed-tensors the model's dtype: kept as stored
        scale_dtype = self.model_dtype if quant.method == "compressed-tensors" else torch.float16
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype, bool]] = {
            "qweight": ((k * quant.bits // 32, n), torch.int32, False),
            "scales": ((k // group, n), scale_dtype, False),
            "qzeros": ((k // group, n), torch.uint8, quant.sym)}
        if quant.method != "awq":
            shapes["g_idx"] = ((k,), torch.int32, True)
        if quant.method == "compressed-tensors":  # [N, K] of the whole tensor: checked
            shapes["weight_shape"] = ((2,), torch.int64, True)
        for role in roles:
            if role in shapes:
                shape, dtype, optional = shapes[role]
                self._int_param(role, torch.zeros(shape, dtype=dtype, device=device), optional)

    def role(self, role: str) -> nn.Parameter | None:
        """The parameter of ``role`` (``qweight``, ``scales``, ``qzeros``, ``g_idx``), under
        whichever name it has now; None where there is none."""
        param = self._parameters.get(self.quant.name(role))
        return param if param is not None else self._parameters.get(role)

    def fill_defaults(self) -> None:
        """What a checkpoint may leave out: midpoint zero points (symmetric), ``g_idx``
        ``k // G``; unit scales. (Again once a model built on the meta device is allocated.)"""
        with torch.no_grad():
            cast(nn.Parameter, self.role("scales")).data.fill_(1.0)
            zeros, g_idx = self.role("qzeros"), self.role("g_idx")
            if zeros is not None:
                zeros.data.fill_(1 << (self.quant.bits - 1))
            if g_idx is not None:
                g_idx.data.copy_(torch.arange(self.input_size, dtype=torch.int32) // self.group)

    def _int_param(self, role: str, value: torch.Tensor, optional: bool = False) -> None:
        param = nn.Parameter(value, requires_grad=False)
        param.weight_loader = functools.partial(self._load, role)  # type: ignore[attr-defined]
        param.optional = optional  # type: ignore[attr-defined]
        self.register_parameter(self.quant.name(role), param)

    # ---------------------------------------------------------------- loading again

    #: While the weights load again (:mod:`mrv2.layers.int_reload`): ``"alias"`` where the
    #: checkpoint's names point at the served packed tensors (loaded in place), ``"fresh"``
    #: where a layer the CPU made plain got new integer tensors (dequantized into a new
    #: weight once complete); None otherwise.
    _reload: str | None = None
    #: Whether the tensors have the layout's names (:meth:`order_inputs` ran).
    _laid_out: bool = False
    #: (``"alias"``) whether the served layer had dropped its zero points.
    _reload_zeros: bool = False
    #: (``"fresh"``) the plain layer's weight and what made it integer, kept aside.
    _reload_stash: tuple[nn.Parameter, Any]

    def reopen_for_reload(self) -> None:
        """The served packed tensors under the checkpoint's names again, loaded in place:
        zero points dropped at load (all the midpoint) and ``g_idx`` come back as small
        temporary parameters. :meth:`order_inputs` puts the layout back."""
        quant = self.quant
        dropped_zeros = self._parameters.get("qzeros") is None
        for role in ("qweight", "scales", "qzeros"):
            param = self._parameters.pop(role, None)
            if param is not None:
                self.register_parameter(quant.name(role), param)
        device = cast(nn.Parameter, self.role("qweight")).device
        if dropped_zeros:
            self.__dict__.pop("qzeros", None)
            self._loading_params(device, ("qzeros",))
            cast(nn.Parameter, self.role("qzeros")).data.fill_(1 << (quant.bits - 1))
        self._loading_params(device, ("g_idx", "weight_shape"))
        g_idx = self.role("g_idx")
        if g_idx is not None:
            g_idx.data.copy_(torch.arange(self.input_size, dtype=torch.int32) // self.group)
        self._reload, self._reload_zeros, self._laid_out = "alias", dropped_zeros, False

    def abandon_reload(self) -> None:
        """Back to the served layer after a load that gave it nothing (or failed): the
        layout's names (``"alias"``), or the plain layer with its weight (``"fresh"``)."""
        for attr in ("_g_idx_shards", "_rows_loaded"):
            self.__dict__.pop(attr, None)
        if self._reload == "alias":
            for role in ("qweight", "scales", "qzeros"):
                param = self._parameters.pop(self.quant.name(role), None)
                if param is not None:
                    self.register_parameter(role, param)
            for role in ("g_idx", "weight_shape"):
                self._parameters.pop(self.quant.name(role), None)
            if self._reload_zeros:
                self._parameters.pop("qzeros", None)
                self.qzeros = None
            self._reload, self._laid_out = None, True
        elif self._reload == "fresh":
            stash, origin = self.__dict__.pop("_reload_stash")
            for role in ("qweight", "scales", "qzeros", "g_idx", "weight_shape"):
                self._parameters.pop(self.quant.name(role), None)
            self._buffers.pop("input_order", None)
            for attr in ("quant", "group", "_reload"):
                self.__dict__.pop(attr, None)
            self.__class__ = self.base_class  # type: ignore[assignment]
            self.weight = stash
            self._int_origin = origin

    def _reload_in_place(self, g_idx: torch.Tensor | None) -> None:
        """The end of an in-place load (``"alias"``): freshly loaded packed rows put in the
        served input order; an input order or zero points the served layer does not have
        (its forward, and the CUDA graphs recorded from it, would leave them out) refused."""
        order = None
        if g_idx is not None and is_fresh(g_idx):
            order = self._group_order(g_idx.data)
            if (order is None) != (self.input_order is None):
                raise ValueError("new weights of a quantized layer with another input order "
                                 "(desc_act / g_idx) than the served one's: not loaded in "
                                 "place; restart the engine on the new checkpoint")
            if order is not None and self.input_order is not None:
                self.input_order.copy_(order)
        if self.input_order is not None and is_fresh(self.qweight):
            ints = unpack_along_k(self.qweight.data, self.quant.bits)
            self.qweight.data.copy_(pack_along_k(ints[self.input_order], self.quant.bits))
        if self._reload_zeros:
            zeros = self._parameters.pop("qzeros")
            self.qzeros = None
            if zeros is not None and is_fresh(zeros) and not bool(
                    (zeros.data == 1 << (self.quant.bits - 1)).all()):
                raise ValueError("new weights of a symmetric quantized layer (its zero points "
                                 "all the midpoint, dropped at load) with other zero points: "
                                 "not loaded in place; restart the engine on the new "
                                 "checkpoint")

    def _group_order(self, g_idx: torch.Tensor) -> torch.Tensor | None:
        """The input order that makes ``g_idx``'s groups contiguous; None: already so."""
        natural = torch.arange(self.input_size, device=g_idx.device,
                               dtype=torch.int32) // self.group
        if torch.equal(g_idx, natural):
            return None
        order = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx[order], natural):
            raise ValueError(f"g_idx does not put {self.group} inputs in each group")
        return order

    def _fresh_complete(self) -> bool | None:
        """For a ``"fresh"`` load: True where every output row of the packed weight, the
        scales and (asymmetric) the zero points was loaded, False where only some were,
        None where nothing was (the layer keeps its weight)."""
        rows: dict[str, set[tuple[int, int]]] = getattr(self, "_rows_loaded", {})
        if not any(is_fresh(p) for p in self._parameters.values()):
            return None
        need = ["qweight", "scales"] + ([] if self.quant.sym else ["qzeros"])
        return all(sum(size for _, size in rows.get(role, ())) == self.output_size
                   for role in need)

    # ---------------------------------------------------------------- loading

    def _place(self, param: nn.Parameter, rows_first: torch.Tensor, shard_id: object,
               per_group: bool, packed: bool) -> None:
        """Copy ``rows_first`` (``[N, K]`` or ``[N, K/G]`` of the whole checkpoint tensor,
        one row per output) into ``param`` (``[., N]``; ``packed``: along K) at this rank's
        part of shard ``shard_id``."""
        start, size = self.shard_rows(shard_id)
        if self._reload == "fresh":  # (which rows came: the layer is dequantized once whole)
            role = next(r for r in ("qweight", "scales", "qzeros") if self.role(r) is param)
            self.__dict__.setdefault("_rows_loaded", {}).setdefault(role, set()).add(
                (start, size))
        if isinstance(self, FusedColumnLinear) and shard_id is not None:
            part = self.shard_part(rows_first, shard_id)
        elif isinstance(self, RowLinear) and self.tp_size > 1 and per_group:
            groups = rows_first.shape[1]
            if groups == 1:  # one group for all inputs: every rank's
                part = rows_first
            else:
                per = self.input_size // self.group
                if groups != per * self.tp_size:
                    raise ValueError(f"{groups} groups do not cover {self.tp_size} ranks' "
                                     f"{per} groups")
                part = rows_first.narrow(1, self.tp_rank * per, per)
        else:
            part = self.rank_part(rows_first, False)
        target = param.data.narrow(1, start, size)
        value = part.T
        if packed:
            if value.shape[0] != self.input_size:
                raise ValueError(f"the packed weight holds {value.shape[0]} inputs, the layer "
                                 f"{self.input_size} (this rank's)")
            value = pack_along_k(value, self.quant.bits)
        if value.shape != target.shape:
            raise ValueError(f"expects {tuple(target.shape)} after unpacking, the checkpoint "
                             f"tensor gives {tuple(value.shape)}")
        with torch.no_grad():
            target.copy_(value)

    def _load(self, role: str, param: nn.Parameter, loaded: torch.Tensor,
              shard_id: object = None) -> None:
        """Load a checkpoint tensor of ``role`` (module docstring's formats), whole, into this
        rank's part of shard ``shard_id``."""
        if role == "g_idx":
            return self._load_g_idx(param, loaded, shard_id)
        if role == "weight_shape":
            return self._check_shape(loaded, shard_id)
        return self._place(param, rows_of(self.quant, role, loaded), shard_id,
                           per_group=role != "qweight", packed=role == "qweight")

    def _check_shape(self, loaded: torch.Tensor, shard_id: object) -> None:
        """compressed-tensors' ``weight_shape`` (the whole tensor's ``[N, K]``): its ``K``
        must be the layer's."""
        full_in = getattr(self, "full_input_size", self.input_size)
        if loaded.numel() != 2 or int(loaded[1]) != full_in:
            raise ValueError(f"weight_shape {loaded.tolist()} of shard {shard_id!r} does not "
                             f"have this layer's {full_in} inputs")

    def _load_g_idx(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object) -> None:
        """A checkpoint ``g_idx`` ``[K]``: this rank's inputs'; the shards of a fused layer must
        agree."""
        full = getattr(self, "full_input_size", self.input_size)
        if loaded.shape != (full,):
            raise ValueError(f"g_idx must have shape ({full},), got {tuple(loaded.shape)}")
        mine = loaded.to(torch.int32)
        if isinstance(self, RowLinear) and self.tp_size > 1:
            mine = mine.narrow(0, self.tp_rank * self.input_size, self.input_size)
            if self.quant.group_size > 0:  # (else one group, 0, on every rank)
                mine = mine - self.tp_rank * (self.input_size // self.group)
        seen: set[object] = getattr(self, "_g_idx_shards", set())
        if seen and not param.is_meta and not torch.equal(param.data.cpu(), mine.cpu()):
            raise ValueError(f"shard {shard_id!r}'s g_idx differs from that of shard(s) "
                             f"{sorted(seen, key=str)}: the shards of a fused layer must "
                             "share their input order")
        seen.add(shard_id)
        self._g_idx_shards = seen
        with torch.no_grad():
            param.data.copy_(mine)

    # ---------------------------------------------------------------- after loading

    def _apply(self, fn: Any, recurse: bool = True) -> IntLinearMixin:
        # ``model.to(dtype)`` must move the fp16 scales, never cast them
        apply_moving_only(self, list({self.quant.name("scales"), "scales"}),
                          lambda f: super(IntLinearMixin, self)._apply(f, recurse), fn)
        return self

    def process_weights_after_loading(self) -> None:
        """:meth:`order_inputs`; on the CPU dequantize and become the plain layer again."""
        self.order_inputs()
        if isinstance(self, IntLinearMixin) and self.qweight.device.type == "cpu":
            with torch.no_grad():
                self._become_plain()

    def order_inputs(self) -> None:
        """Give the tensors the layout's names, order a ``desc_act`` layer's inputs by group
        (its packed rows, and the gather of its input), drop zero points that are all the
        midpoint. Done once: a second call (a model's own hook that needed it first, then the
        layer's) changes nothing. After a load of new weights (:meth:`reopen_for_reload`)
        the served layout is kept in place; a CPU layer that got none of its tensors is its
        plain self again, one that got some of them but not all refuses (its weight is
        dequantized whole)."""
        if self._reload == "fresh":
            complete = self._fresh_complete()
            if not complete:
                self.abandon_reload()
                if complete is False:
                    raise ValueError(
                        f"new weights of a quantized {type(self).__name__} "
                        f"({self.input_size} -> {self.output_size}) on the CPU, where it is "
                        "dequantized at load: give all of its packed weight, scales and zero "
                        "points (every shard), not some")
                return
        with torch.no_grad():
            for role in ("qweight", "scales", "qzeros"):
                param = self._parameters.pop(self.quant.name(role), None)
                if param is not None:
                    self.register_parameter(role, param)
            g_idx = self._parameters.pop(self.quant.name("g_idx"), None)
            self._parameters.pop("weight_shape", None)
            for attr in ("_g_idx_shards", "_rows_loaded"):
                self.__dict__.pop(attr, None)
            self._laid_out = True
            if self._reload == "alias":
                self._reload = None
                self._reload_in_place(g_idx)
                return
            self._reload = None
            self.__dict__.pop("_reload_stash", None)
            if g_idx is not None:
                order = self._group_order(g_idx.data)
                if order is not None:
                    ints = unpack_along_k(self.qweight.data, self.quant.bits)
                    self.qweight.data = pack_along_k(ints[order], self.quant.bits)
                    self.input_order = order
            zeros = self.qzeros
            if zeros is not None and bool((zeros.data == 1 << (self.quant.bits - 1)).all()):
                self._parameters.pop("qzeros")
                self.qzeros = None

    def reorder_rows(self, reorder: Callable[[torch.Tensor], object],
                     fresh_only: bool = False) -> None:
        """Run ``reorder`` (in place on a contiguous tensor whose rows are the layer's
        outputs: a model's permutation of its rows) on the packed weight, the scales and the
        zero points (whose columns are the outputs) and the bias (after
        :meth:`order_inputs`); ``fresh_only``: on those loaded since the weights were last
        processed (:func:`~mrv2.layers.weights.is_fresh`: the others are reordered
        already)."""
        with torch.no_grad():
            for param in (self.qweight, self.scales, self.qzeros):
                if param is not None and (is_fresh(param) or not fresh_only):
                    rows = param.data.T.contiguous()
                    reorder(rows)
                    param.data.copy_(rows.T)
            if self.bias is not None and (is_fresh(self.bias) or not fresh_only):
                reorder(self.bias.data[:, None])

    def _become_plain(self) -> None:
        """The CPU's layer: the dequantized weight in the model dtype, the base class."""
        weight = nn.Parameter(self.dequantized(self.model_dtype), requires_grad=False)
        weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        for name in ("qweight", "scales", "qzeros"):
            self._parameters.pop(name, None)
        self._buffers.pop("input_order", None)
        origin = (type(self), self.quant, self.group, self.model_dtype)
        for attr in ("quant", "group", "qzeros"):
            self.__dict__.pop(attr, None)
        self.__class__ = self.base_class  # type: ignore[assignment]
        self.weight = weight
        self._int_origin = origin  # (what mrv2.layers.int_reload makes integer again)
        LinearBase.process_weights_after_loading(self)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[N, K]`` in ``dtype``, inputs in the checkpoint's order."""
        w = dequantize_wna16(self.qweight.data, self.scales.data,
                             None if self.qzeros is None else self.qzeros.data,
                             self.quant.bits, self.group, dtype)
        if self.input_order is not None:
            w = torch.empty_like(w).index_copy_(1, self.input_order, w)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        zeros = None if self.qzeros is None else self.qzeros.data
        return self.reduce(wna16_linear(x, self.qweight, self.scales, zeros, self.quant.bits,
                                        self.group, self.bias if self.adds_bias else None))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, {self.quant.method} {self.quant.bits}-bit, "
                f"group={self.group}")


_INT_CLASSES: dict[type[LinearBase], type[IntLinearMixin]] = {}


def to_int(layer: LinearBase, quant: IntQuantConfig,
           dtype: torch.dtype = torch.float32) -> IntLinearMixin:
    """Turn ``layer`` into its integer-weight variant in place (before loading); ``dtype``:
    the model's (what the CPU dequantizes to)."""
    cls = type(layer)
    if cls not in _INT_CLASSES:
        _INT_CLASSES[cls] = cast(type[IntLinearMixin], type(
            f"Int{cls.__name__}", (IntLinearMixin, cls), {"base_class": cls}))
    layer.__class__ = _INT_CLASSES[cls]
    int_layer = cast(IntLinearMixin, layer)
    int_layer.int_init(quant, dtype)
    return int_layer
