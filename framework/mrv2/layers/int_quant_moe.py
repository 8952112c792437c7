"""Routed experts with integer weights (GPTQ, AWQ, compressed-tensors MoE checkpoints such as
Qwen3-30B-A3B-GPTQ-Int4): :class:`IntFusedMoE`.

The checkpoints quantize each expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` as a dense
layer of their format (:mod:`mrv2.layers.int_quant`), under
``...experts.{e}.{gate,up,down}_proj.<tensor>``; :func:`mrv2.layers.weights.
expert_weight_target` sends each to ``w13_<tensor>`` / ``w2_<tensor>`` shard ``(e, kind)``.
Each tensor is unpacked on the host to one row per output, cut to this rank's
intermediate slice as :class:`~mrv2.layers.moe.FusedMoE` cuts float experts (gate / up rows,
down's input columns: whole groups of them), and packed into the layout of
:mod:`mrv2_kernels.fused_moe_int` (``w13`` ``[E, 2I, H / pack]`` packed along K, per-row group
scales and zero points), where one fused MoE kernel family multiplies them.

Tensor parallelism whose intermediate slice is not whole groups (gpt-oss-120b's 2,880 / 4 =
720 at groups of 32; Qwen3-30B-A3B's 768 / 4 = 192 at 128): each rank's slice is laid out
where it sits in the checkpoint's groups, padded with rows of zero scale (and zero bias) before
and after to whole groups. A padded gate / up row outputs 0, so its activation is 0 (SiLU's and
swigluoai's alike) and the down projection's columns there (a neighbour's, or past the end)
add nothing: each rank multiplies up to two groups more, nothing is counted twice.

Not supported (a ValueError before any weight loads): one group per channel
(``group_size: -1``), an activation order (``desc_act`` / ``actorder``) in the experts.
On the CPU the experts are dequantized once after loading (a plain :class:`FusedMoE`).
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from torch import nn

from mrv2.layers.int_quant_config import IntQuantConfig, rows_of
from mrv2.layers.moe import FusedMoE
from mrv2.layers.weights import apply_moving_only, is_fresh
from mrv2_kernels.fused_moe import IntExperts, fused_moe
from mrv2_kernels.fused_moe_int import dequantize_int_experts
from mrv2_kernels.wna16_gemm import pack_along_k

_STACKS = ("w13", "w2")


class IntFusedMoE(FusedMoE):
    """A :class:`FusedMoE` turned integer-weight by :func:`experts_to_int` (module
    docstring). After loading: ``w13_qweight`` / ``w2_qweight`` (int32, packed along K),
    ``w13_scales`` / ``w2_scales`` and ``w13_qzeros`` / ``w2_qzeros`` (uint8; None when every
    zero point is the midpoint)."""

    quant: IntQuantConfig
    model_dtype: torch.dtype = torch.float32
    w13_qweight: nn.Parameter
    w2_qweight: nn.Parameter
    w13_scales: nn.Parameter
    w2_scales: nn.Parameter
    w13_qzeros: nn.Parameter | None
    w2_qzeros: nn.Parameter | None

    def int_init(self, quant: IntQuantConfig, dtype: torch.dtype) -> None:
        """Replace the float stacks by the integer layout's parameters (checkpoint names)."""
        if quant.group_size <= 0:
            raise ValueError("quantization_config.group_size = -1 (one group per channel) is "
                             "not supported for routed experts")
        if quant.desc_act:
            raise ValueError("an activation order (desc_act / actorder) is not supported for "
                             "routed experts")
        group, pack = quant.group_size, 32 // quant.bits
        for k in (self.hidden_size, self.full_intermediate_size):
            if k % group or group % pack:
                raise ValueError(f"the experts' inputs ({k}: hidden size, or the moe "
                                 f"intermediate size) must divide into groups of {group} "
                                 "(quantization_config.group_size)")
        start = self.tp_rank * self.rank_inter  # (rank_inter: FusedMoE's, unpadded)
        self.pad_before = start % group
        self.intermediate_size = -(-(self.pad_before + self.rank_inter) // group) * group
        e, inter = self.local_experts, self.intermediate_size
        self.quant, self.model_dtype = quant, dtype
        device = self.w13_weight.device
        del self.w13_weight, self.w2_weight
        if self.w13_bias is not None:  # laid out as the padded rows are
            self.w13_bias = nn.Parameter(torch.empty(e, 2 * inter, device=device))
            self.w13_bias.weight_loader = self.bias_loader  # type: ignore[attr-defined]
        self._loading_params(device)
        if device.type != "meta":
            self.fill_defaults()

    def _loading_params(self, device: torch.device, roles: tuple[str, ...] = (
            "qweight", "scales", "qzeros", "g_idx", "weight_shape")) -> None:
        """Both stacks' tensors of ``roles`` as empty parameters under the checkpoint's
        names."""
        quant, group, pack = self.quant, self.quant.group_size, 32 // self.quant.bits
        e, inter, hidden = self.local_experts, self.intermediate_size, self.hidden_size
        scale_dtype = {"compressed-tensors": self.model_dtype, "mxfp4": torch.uint8}.get(
            quant.method, torch.float16)
        shapes = {"w13": (2 * inter, hidden), "w2": (hidden, inter)}
        for stack, (rows, k) in shapes.items():
            made: dict[str, tuple[torch.Tensor, bool]] = {
                "qweight": (torch.zeros(e, rows, k // pack, dtype=torch.int32, device=device),
                            False),
                "scales": (torch.zeros(e, rows, k // group, dtype=scale_dtype, device=device),
                           False),
                "qzeros": (torch.zeros(e, rows, k // group, dtype=torch.uint8, device=device),
                           quant.sym)}
            if quant.method not in ("awq", "mxfp4"):  # checked: the natural order, not kept
                made["g_idx"] = (torch.empty(0, device=device), True)
            if quant.method == "compressed-tensors":
                made["weight_shape"] = (torch.empty(0, device=device), True)
            for role in roles:
                if role in made:
                    self._param(stack, role, *made[role])

    # ---------------------------------------------------------------- loading again

    #: While the weights load again (:func:`~mrv2.layers.int_reload.reopen_int_layers`):
    #: ``"alias"`` (the served packed stacks under the checkpoint's names, loaded in
    #: place) or ``"fresh"`` (a stack the CPU made plain, with new integer stacks); else None.
    _reload: str | None = None
    #: Whether the stacks have the layout's names (:meth:`finish_loading` ran).
    _laid_out: bool = False
    #: (``"alias"``) whether the served stacks had dropped their zero points.
    _reload_zeros: bool = False
    #: (``"fresh"``) the plain stacks' weights and what made them integer, kept aside.
    _reload_stash: tuple[Any, Any]

    def reopen_for_reload(self) -> None:
        """The served stacks under the checkpoint's names again, loaded in place; zero
        points dropped at load come back as the midpoint."""
        dropped_zeros = self._parameters.get("w13_qzeros") is None
        for stack in _STACKS:
            for role in ("qweight", "scales", "qzeros"):
                param = self._parameters.pop(f"{stack}_{role}", None)
                if param is not None:
                    self.register_parameter(self._name(stack, role), param)
            if dropped_zeros:
                self.__dict__.pop(f"{stack}_qzeros", None)
        device = cast(nn.Parameter, self.role("w13", "qweight")).device
        if dropped_zeros:
            self._loading_params(device, ("qzeros",))
            for stack in _STACKS:
                cast(nn.Parameter, self.role(stack, "qzeros")).data.fill_(
                    1 << (self.quant.bits - 1))
        self._loading_params(device, ("g_idx", "weight_shape"))
        self._reload, self._reload_zeros, self._laid_out = "alias", dropped_zeros, False

    def abandon_reload(self) -> None:
        """Back to the served stacks after a load that gave them nothing (or failed)."""
        self.__dict__.pop("_experts_loaded", None)
        if self._reload == "alias":
            for stack in _STACKS:
                self._served_names(stack)
            self._reload, self._laid_out = None, True
        elif self._reload == "fresh":
            stash, origin = self.__dict__.pop("_reload_stash")
            for name in [n for n in self._parameters
                         if n.startswith(_STACKS) and not n.endswith("_bias")]:
                self._parameters.pop(name)
            for attr in ("quant", "_reload"):
                self.__dict__.pop(attr, None)
            self.__class__ = FusedMoE  # type: ignore[assignment]
            self.w13_weight, self.w2_weight = stash
            self._int_origin = origin

    def _fresh_complete(self) -> bool | None:
        """For a ``"fresh"`` load: True where every local expert's gate, up and down got
        their packed weights, scales and (asymmetric) zero points, False where only some
        did, None where nothing came (the stack keeps its weights)."""
        got: dict[tuple[str, str], set[tuple[int, str]]] = getattr(self, "_experts_loaded", {})
        if not got:
            return None
        roles = ["qweight", "scales"] + ([] if self.quant.sym else ["qzeros"])
        want = {"w13": {(e, k) for e in range(self.local_experts) for k in ("gate", "up")},
                "w2": {(e, "down") for e in range(self.local_experts)}}
        return all(got.get((stack, role), set()) == want[stack]
                   for stack in _STACKS for role in roles)

    def _name(self, stack: str, role: str) -> str:
        return f"{stack}_{self.quant.name(role)}"

    def _param(self, stack: str, role: str, value: torch.Tensor, optional: bool = False
               ) -> None:
        param = nn.Parameter(value, requires_grad=False)
        param.weight_loader = functools.partial(self._load, role)  # type: ignore[attr-defined]
        param.optional = optional  # type: ignore[attr-defined]
        self.register_parameter(self._name(stack, role), param)

    def role(self, stack: str, role: str) -> nn.Parameter | None:
        """Stack ``stack``'s parameter of ``role``, under whichever name it has now."""
        param = self._parameters.get(self._name(stack, role))
        return param if param is not None else self._parameters.get(f"{stack}_{role}")

    def fill_defaults(self) -> None:
        """Midpoint zero points (a symmetric checkpoint has none), unit scales (MXFP4: the
        e8m0 code of 1)."""
        with torch.no_grad():
            for stack in _STACKS:
                cast(nn.Parameter, self.role(stack, "scales")).data.fill_(
                    127 if self.quant.fp4 else 1.0)
                zeros = self.role(stack, "qzeros")
                if zeros is not None:
                    zeros.data.fill_(1 << (self.quant.bits - 1))

    # ---------------------------------------------------------------- loading

    def _load(self, role: str, param: nn.Parameter, loaded: torch.Tensor,
              shard_id: tuple[int, str] | None = None) -> None:
        """One expert's ``role`` tensor of its gate / up / down projection."""
        if shard_id is None:
            raise ValueError("integer experts load one expert's gate, up or down at a time")
        expert_id, kind = shard_id
        expert = self.local_expert(expert_id)
        if expert is None:
            return None  # another rank's expert (expert parallelism)
        if self._reload == "fresh":  # (which experts came: the stacks dequantize once whole)
            stack = "w2" if kind == "down" else "w13"
            self.__dict__.setdefault("_experts_loaded", {}).setdefault(
                (stack, role), set()).add((expert, kind))
        if role == "weight_shape":
            return None  # (the shapes are checked when the tensors land)
        if role == "g_idx":
            k = loaded.shape[0]
            natural = torch.arange(k, device=loaded.device) // self.quant.group_size
            if not torch.equal(loaded.long(), natural):
                raise ValueError("an expert's g_idx is not in natural order (an activation "
                                 "order): not supported for routed experts")
            return None
        rows = rows_of(self.quant, role, loaded)
        part = self._rank_rows(rows, kind, role != "qweight")
        if role == "qweight":
            part = pack_along_k(part.T, self.quant.bits).T
        inter, first = self.intermediate_size, self.pad_before
        target = param.data[expert]
        if kind == "gate":
            target = target[first : first + self.rank_inter]
        elif kind == "up":
            target = target[inter + first : inter + first + self.rank_inter]
        if target.shape != part.shape:
            raise ValueError(f"expert {expert_id}'s {kind} {self.quant.name(role)} gives "
                             f"{tuple(part.shape)} after unpacking, the layer expects "
                             f"{tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(part)
        return None

    def _rank_rows(self, rows: torch.Tensor, kind: str, per_group: bool) -> torch.Tensor:
        """This rank's part of a whole ``[N, K]`` (``per_group``: ``[N, K/G]``) tensor: gate /
        up rows; down's input columns of the rank's padded layout (whole groups from the
        group its first row lies in; past the end, zeros)."""
        if self.tp_size == 1:
            return rows
        full, mine, group = self.full_intermediate_size, self.rank_inter, self.quant.group_size
        if kind != "down":
            return rows.narrow(0, self.tp_rank * mine, mine)
        first = self.tp_rank * mine - self.pad_before
        size = self.intermediate_size
        if per_group:
            first, size, full = first // group, size // group, full // group
        elif rows.shape[1] != full:
            raise ValueError(f"a down projection holds {rows.shape[1]} inputs, not {full}")
        part = rows[:, first : first + size]
        if part.shape[1] < size:  # the last rank's layout past the end of the checkpoint's
            part = torch.cat([part, part.new_zeros(part.shape[0], size - part.shape[1])], 1)
        return part

    # ---------------------------------------------------------------- after loading

    def _apply(self, fn: Any, recurse: bool = True) -> IntFusedMoE:
        names = [n for n in self._parameters
                 if n.endswith(("_scales", "_weight_scale")) or "qzeros" in n]
        apply_moving_only(self, names, lambda f: super(IntFusedMoE, self)._apply(f, recurse),
                          fn)
        return self

    def process_weights_after_loading(self) -> None:
        """:meth:`finish_loading`; on the CPU, dequantized experts (a plain
        :class:`FusedMoE`)."""
        self.finish_loading()
        if isinstance(self, IntFusedMoE) and self.w13_qweight.device.type == "cpu":
            with torch.no_grad():
                self._become_plain()

    def padding_rows(self) -> list[slice]:
        """The gate / up rows of this rank's layout that hold no intermediate row of its
        (module docstring): none without tensor parallelism or at whole groups."""
        inter, first, mine = self.intermediate_size, self.pad_before, self.rank_inter
        return [s for half in (0, inter)
                for s in (slice(half, half + first), slice(half + first + mine, half + inter))
                if s.stop > s.start]

    def finish_loading(self) -> None:
        """The layout's names; zero points dropped where all are the midpoint; the padding
        rows' scales and biases zeroed (whatever was loaded or drawn). After new weights
        (:meth:`reopen_for_reload`) the served layout is kept in place (zero points it
        dropped, new ones not all the midpoint, refused); a CPU stack that got none of its
        experts' tensors keeps its weights, one that got some but not all refuses."""
        if self._reload == "fresh":
            complete = self._fresh_complete()
            if not complete:
                self.abandon_reload()
                if complete is False:
                    raise ValueError(
                        f"new weights of quantized experts ({self.num_experts} experts) on the "
                        "CPU, where they are dequantized at load: give every expert's gate, "
                        "up and down packed weights, scales and zero points, not some")
                return
            self.__dict__.pop("_reload_stash", None)
            self.__dict__.pop("_experts_loaded", None)
        if self._reload == "alias":
            self._reload = None
            self.__dict__.pop("_experts_loaded", None)
            with torch.no_grad():
                for rows in self.padding_rows():
                    cast(nn.Parameter, self.role("w13", "scales")).data[:, rows] = 0
            self._close_in_place()
            return
        self._reload = None
        with torch.no_grad():
            for rows in self.padding_rows():
                cast(nn.Parameter, self.role("w13", "scales")).data[:, rows] = 0
                if self.w13_bias is not None:
                    self.w13_bias.data[:, rows] = 0
            for stack in _STACKS:
                for role in ("qweight", "scales", "qzeros"):
                    param = self._parameters.pop(self._name(stack, role))
                    self.register_parameter(f"{stack}_{role}", param)
                for role in ("g_idx", "weight_shape"):
                    self._parameters.pop(f"{stack}_{role}", None)
                    self._parameters.pop(self._name(stack, role), None)
            mid = 1 << (self.quant.bits - 1)
            zeros = [self._parameters[f"{s}_qzeros"] for s in _STACKS]
            if all(bool((z.data == mid).all()) for z in zeros if z is not None):
                for stack in _STACKS:
                    self._parameters.pop(f"{stack}_qzeros")
                    setattr(self, f"{stack}_qzeros", None)
        self._laid_out = True

    def _close_in_place(self) -> None:
        """The end of an in-place load (``"alias"``): the layout's names back; zero points
        the served stacks dropped (all the midpoint) must still be the midpoint (the kernels
        recorded without them would leave others out)."""
        mid = 1 << (self.quant.bits - 1)
        for stack in _STACKS:
            zeros = self._served_names(stack)
            if zeros is not None and is_fresh(zeros) and not bool((zeros.data == mid).all()):
                raise ValueError("new weights of symmetric quantized experts (zero points "
                                 "all the midpoint, dropped at load) with other zero "
                                 "points: not loaded in place; restart the engine on the "
                                 "new checkpoint")
        self._laid_out = True

    def _served_names(self, stack: str) -> nn.Parameter | None:
        """``stack``'s served tensors back under the layout's names, the reload's names of
        its order and shape dropped; where the served stack had dropped its zero points (all
        the midpoint), it has none again: those the reload loaded are returned (else None)."""
        for role in ("qweight", "scales", "qzeros"):
            param = self._parameters.pop(self._name(stack, role), None)
            if param is not None:
                self.register_parameter(f"{stack}_{role}", param)
        for role in ("g_idx", "weight_shape"):
            self._parameters.pop(self._name(stack, role), None)
        if not self._reload_zeros:
            return None
        zeros = self._parameters.pop(f"{stack}_qzeros", None)
        setattr(self, f"{stack}_qzeros", None)
        return zeros

    def _become_plain(self) -> None:
        w13, w2 = (nn.Parameter(self.dequantized(s, self.model_dtype), requires_grad=False)
                   for s in _STACKS)
        for name in [n for n in self._parameters
                     if n.startswith(_STACKS) and not n.endswith("_bias")]:
            self._parameters.pop(name)
        for stack in _STACKS:
            self.__dict__.pop(f"{stack}_qzeros", None)
        origin = (self.quant, self.model_dtype)
        self.__class__ = FusedMoE  # type: ignore[assignment]
        self.w13_weight, self.w2_weight = w13, w2
        for param in (w13, w2):
            param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self._int_origin = origin  # (what reopen_plain_experts makes it again)

    def dequantized(self, stack: str, dtype: torch.dtype) -> torch.Tensor:
        """Stack ``stack``'s (``"w13"`` / ``"w2"``) real weights ``[E, N, K]`` in ``dtype``."""
        zeros = getattr(self, f"{stack}_qzeros")
        return dequantize_int_experts(getattr(self, f"{stack}_qweight").data,
                                      getattr(self, f"{stack}_scales").data,
                                      None if zeros is None else zeros.data, self.quant.bits,
                                      self.quant.group_size, dtype, fp4=self.quant.fp4)

    def _experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 valid: torch.Tensor | None) -> torch.Tensor:
        z13, z2 = self.w13_qzeros, self.w2_qzeros
        ints = IntExperts(self.w13_scales, self.w2_scales, None if z13 is None else z13.data,
                          None if z2 is None else z2.data, self.quant.bits,
                          self.quant.group_size, fp4=self.quant.fp4)
        return fused_moe(x, self.w13_qweight, self.w2_qweight, topk_weights, topk_ids,
                         valid_tokens=valid, int_experts=ints, **self.epilogue())

    def expert_bytes(self) -> int:
        """Bytes of one expert's packed weights, scales and zero points."""
        return int(sum(p[0].numel() * p.element_size() for n, p in self._parameters.items()
                       if p is not None and n.startswith(_STACKS)))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, {self.quant.method} {self.quant.bits}-bit, "
                f"group={self.quant.group_size}")


def reopen_plain_experts(moe: nn.Module) -> None:
    """Experts the CPU dequantized (:meth:`IntFusedMoE._become_plain`) integer again, with
    empty checkpoint-named stacks to load (``"fresh"``), their weights kept aside."""
    quant, dtype = moe.__dict__.pop("_int_origin")
    stash = (moe._parameters.pop("w13_weight"), moe._parameters.pop("w2_weight"))
    moe.__class__ = IntFusedMoE
    int_moe = cast(IntFusedMoE, moe)
    int_moe.quant, int_moe.model_dtype = quant, dtype
    device = cast(nn.Parameter, stash[0]).device
    int_moe._loading_params(device)
    int_moe.fill_defaults()
    int_moe._reload_stash = (stash, (quant, dtype))
    int_moe._reload = "fresh"


def experts_to_int(moe: FusedMoE, quant: IntQuantConfig, dtype: torch.dtype) -> IntFusedMoE:
    """Turn ``moe`` into an :class:`IntFusedMoE` in place (before loading)."""
    moe.__class__ = IntFusedMoE
    int_moe = cast(IntFusedMoE, moe)
    int_moe.int_init(quant, dtype)
    return int_moe
