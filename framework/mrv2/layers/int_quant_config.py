"""What a checkpoint's ``quantization_config`` says about integer weights (GPTQ, AWQ,
compressed-tensors' pack-quantized W4A16 / W8A16) and MXFP4 experts (gpt-oss: 4-bit e2m1 codes
in groups of 32 with e8m0 scales, the routed experts only), checked field by field before
anything loads, and the one unpacking the formats share (:func:`unpack_along_n`). The layers and the
formats' tensors: :mod:`mrv2.layers.int_quant` and :mod:`mrv2.layers.int_quant_moe`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mrv2_kernels.fused_moe_int import mxfp4_codes
from mrv2_kernels.wna16_gemm import unpack_along_k

#: ``quantization=`` values that name these formats (vLLM's kernel-specific names included:
#: the checkpoint decides the kernel here).
INT_METHODS = {"gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq", "awq_marlin": "awq",
               "compressed-tensors": "compressed-tensors", "mxfp4": "mxfp4"}
#: The checkpoints' ``quant_method`` values these formats have.
CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors", "mxfp4")
#: MXFP4's tensors: ``<name>_blocks`` (codes) and ``<name>_scales`` (e8m0).
MXFP4_NAMES = {"qweight": "blocks", "scales": "scales"}
#: Group size of random weights (``load_format="dummy"``).
DUMMY_GROUP = 128
#: What compressed-tensors calls each of the layer's tensors (GPTQ and AWQ: the roles' names).
CT_NAMES = {"qweight": "weight_packed", "scales": "weight_scale",
            "qzeros": "weight_zero_point", "g_idx": "weight_g_idx"}
_FIELD = "config.json quantization_config"


@dataclass(frozen=True)
class IntQuantConfig:
    """A checkpoint's integer-weight quantization (:mod:`mrv2.layers.int_quant`)."""

    method: str
    """``"gptq"``, ``"awq"``, ``"compressed-tensors"`` or ``"mxfp4"``."""
    bits: int
    group_size: int
    """Inputs per group; -1: one group of all inputs (per output channel)."""
    sym: bool
    """Zero points all ``2**(bits-1)`` (no zero-point tensor needed)."""
    desc_act: bool
    """Inputs quantized in an order of their own (a ``g_idx`` that is not ``k // G``)."""
    zeros_minus_one: bool = False
    """GPTQ v1: stored zero points are one less than the real ones."""
    skip: tuple[str, ...] = ()
    """Module name fragments random weights leave in the model dtype (AWQ's
    ``modules_to_not_convert``, compressed-tensors' ``ignore``)."""
    from_checkpoint: bool = True
    names: dict[str, str] = field(default_factory=dict)
    """Each role's (``qweight``, ``scales``, ``qzeros``, ``g_idx``) checkpoint tensor name,
    where the format's differs."""
    experts_only: bool = False
    """Only the routed experts are quantized (MXFP4): linear layers stay in the model dtype."""

    @property
    def fp4(self) -> bool:
        """e2m1 codes with e8m0 scales (MXFP4) rather than integers."""
        return self.method == "mxfp4"

    def name(self, role: str) -> str:
        """The checkpoint's name of tensor ``role``."""
        return self.names.get(role, role)


def _getter(qc: Any) -> Any:
    return qc.get if isinstance(qc, dict) else (lambda k, d=None: getattr(qc, k, d))


def quant_method_of(hf_config: Any) -> str | None:
    """The checkpoint's ``quantization_config.quant_method`` (lower case), or None."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    method = _getter(qc)("quant_method")
    return str(method).lower() if method is not None else None


def _check_bits(bits: Any, allowed: tuple[int, ...], name: str) -> int:
    if bits not in allowed:
        raise ValueError(f"{_FIELD}.{name} = {bits!r}: allowed values are "
                         f"{', '.join(map(str, allowed))}")
    return int(bits)


def _check_group(group: Any, name: str) -> int:
    if not isinstance(group, int) or not (group == -1 or group >= 16):
        raise ValueError(f"{_FIELD}.{name} = {group!r}: allowed values are -1 and sizes "
                         ">= 16")
    return group


def int_quant_config_of(hf_config: Any, requested: str | None) -> IntQuantConfig | None:
    """The integer-weight setting of a model: its ``quantization_config`` when that is GPTQ,
    AWQ or compressed-tensors (what mrv2 runs of them, else a ValueError naming the field), a
    random-weight setting for a ``requested`` integer method (usable with
    ``load_format="dummy"`` only, checked at build), else None (so for a compressed-tensors
    checkpoint whose only scheme is ``kv_cache_scheme``: model-dtype weights)."""
    method = quant_method_of(hf_config)
    if method not in CHECKPOINT_METHODS:
        if requested in INT_METHODS and method is not None:
            raise ValueError(f"quantization={requested!r}: the checkpoint is {method!r}")
        if requested == "mxfp4":
            return _mxfp4(_getter({}), from_checkpoint=False)
        if requested in INT_METHODS:
            kind = INT_METHODS[requested]
            return IntQuantConfig(kind, 4, DUMMY_GROUP, kind != "awq", False,
                                  from_checkpoint=False,
                                  names=CT_NAMES if kind == "compressed-tensors" else {})
        return None
    if requested is not None and INT_METHODS.get(requested) != method:
        raise ValueError(f"quantization={requested!r}: the checkpoint is {method!r} "
                         f"(leave quantization unset)")
    get = _getter(hf_config.quantization_config)
    if method == "compressed-tensors" and not get("config_groups") and get("kv_cache_scheme"):
        return None  # KV-cache scales only: model-dtype weights (check_kv_cache_scales)
    if method == "compressed-tensors":
        return _compressed_tensors(get)
    if method == "mxfp4":
        return _mxfp4(get)
    bits = _check_bits(get("bits", get("w_bit")), (4, 8) if method == "gptq" else (4,), "bits")
    group = _check_group(get("group_size", get("q_group_size")), "group_size")
    if method == "awq":
        version = str(get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"{_FIELD}.version = {version!r}: only 'gemm' is supported")
        if not get("zero_point", True):
            raise ValueError(f"{_FIELD}.zero_point = false: only AWQ with zero points is "
                             "supported")
        return IntQuantConfig("awq", 4, group, False, False,
                              skip=tuple(get("modules_to_not_convert") or ()))
    fmt = str(get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{_FIELD}.checkpoint_format = {fmt!r}: allowed values are 'gptq' "
                         "and 'gptq_v2'")
    if get("dynamic"):
        raise ValueError(f"{_FIELD}.dynamic: per-module GPTQ overrides are not supported")
    return IntQuantConfig("gptq", bits, group, bool(get("sym", True)),
                          bool(get("desc_act", False)), zeros_minus_one=fmt == "gptq")


def _mxfp4(get: Any, from_checkpoint: bool = True) -> IntQuantConfig:
    """MXFP4 routed experts (gpt-oss): groups of 32, e8m0 scales, every other layer in the
    model dtype."""
    return IntQuantConfig("mxfp4", 4, 32, True, False, from_checkpoint=from_checkpoint,
                          skip=tuple(get("modules_to_not_convert") or ()), names=MXFP4_NAMES,
                          experts_only=True)


def _compressed_tensors(get: Any) -> IntQuantConfig:
    """compressed-tensors' ``pack-quantized`` weight-only scheme: one config group of
    ``int`` weights (``group`` or ``channel`` strategy), no activation quantization."""
    groups = get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{_FIELD}.config_groups has {len(groups)} groups: only one "
                         "(every quantized layer alike) is supported")
    (gname, group_cfg), = groups.items()
    g = _getter(group_cfg)
    where = f"{_FIELD}.config_groups.{gname}"
    fmt = g("format") or get("format")
    if fmt != "pack-quantized":
        raise ValueError(f"{_FIELD}.format = {fmt!r}: only 'pack-quantized' (integer "
                         "weights, activations unquantized) is supported")
    if g("input_activations") is not None:
        raise ValueError(f"{where}.input_activations: activation quantization (W8A8, W4A8) "
                         "is not supported; only weight-only schemes (W4A16, W8A16)")
    w = _getter(g("weights") or {})
    if w("type", "int") != "int":
        raise ValueError(f"{where}.weights.type = {w('type')!r}: only 'int' is supported")
    bits = _check_bits(w("num_bits"), (4, 8), "config_groups.weights.num_bits")
    strategy = w("strategy")
    if strategy == "channel":
        group = -1
    elif strategy == "group":
        group = _check_group(w("group_size"), f"config_groups.{gname}.weights.group_size")
    else:
        raise ValueError(f"{where}.weights.strategy = {strategy!r}: allowed values are "
                         "'group' and 'channel'")
    if w("dynamic"):
        raise ValueError(f"{where}.weights.dynamic = true is not supported")
    actorder = w("actorder")
    if actorder not in (None, "group", "weight", "static", False, True):
        raise ValueError(f"{where}.weights.actorder = {actorder!r}: allowed values are null, "
                         "'group', 'weight' and 'static'")
    skip = tuple(str(i).removeprefix("re:").strip(".*") for i in get("ignore") or ())
    return IntQuantConfig("compressed-tensors", bits, group, bool(w("symmetric", True)),
                          actorder in ("group", True), skip=skip, names=CT_NAMES)


#: AWQ GEMM checkpoints' nibble order: nibble ``i`` of word ``j`` holds column
#: ``8 * j + AWQ_ORDER[i]``.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_along_n(packed: torch.Tensor, bits: int, awq_order: bool) -> torch.Tensor:
    """int32 ``[R, N/pack]`` packed along its columns (sequentially, or in AWQ's order) as
    uint8 ``[R, N]``."""
    pack = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    v = (packed[:, :, None] >> shifts) & ((1 << bits) - 1)
    if awq_order:  # nibble i holds column AWQ_ORDER[i]: put each back at its column
        v = v[:, :, [AWQ_ORDER.index(c) for c in range(pack)]]
    return v.reshape(packed.shape[0], -1).to(torch.uint8)


def rows_of(quant: IntQuantConfig, role: str, loaded: torch.Tensor) -> torch.Tensor:
    """A checkpoint's ``qweight`` / ``qzeros`` / ``scales`` tensor of one layer in the form
    every loader cuts and places: one row per output, ``[N, K]`` integers (``qweight``) or
    ``[N, K/G]`` (zero points as uint8, real ones even in GPTQ v1; scales as stored). A
    ValueError names a tensor of the wrong dtype."""
    name, method, bits = quant.name(role), quant.method, quant.bits
    if method == "mxfp4":  # [N, K / 32, 16] bytes of codes; scales [N, K / 32] uint8
        if loaded.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8, got {loaded.dtype}")
        return mxfp4_codes(loaded) if role == "qweight" else loaded
    if role in ("qweight", "qzeros") and loaded.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {loaded.dtype}")
    if role == "qweight":
        if method == "awq":  # [K, N/8], AWQ's order
            return unpack_along_n(loaded, bits, awq_order=True).T
        if method == "gptq":  # [K/pack, N]
            return unpack_along_k(loaded, bits).T
        return unpack_along_n(loaded, bits, awq_order=False)  # compressed-tensors [N, K/pack]
    if role == "qzeros":
        if method == "compressed-tensors":  # [N/pack, K/G], packed along the outputs
            return unpack_along_k(loaded, bits)
        zeros = unpack_along_n(loaded, bits, method == "awq").T  # [K/G, N/pack]
        if quant.zeros_minus_one:
            zeros = ((zeros.to(torch.int32) + 1) & ((1 << bits) - 1)).to(torch.uint8)
        return zeros
    if not loaded.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {loaded.dtype}")
    return loaded if method == "compressed-tensors" else loaded.T  # scales
