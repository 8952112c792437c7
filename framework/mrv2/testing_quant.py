"""Test helpers for int-quantized checkpoints: save a tiny checkpoint (see
:func:`mrv2.testing.make_tiny_checkpoint`) as GPTQ (:func:`gptq_checkpoint`), AWQ
(:func:`awq_checkpoint`) or compressed-tensors "pack-quantized"
(:func:`compressed_tensors_checkpoint`), or its routed experts as MXFP4 (gpt-oss,
:func:`mxfp4_checkpoint`), exactly as those formats are published, plus a
"reference" copy with the dequantized float weights (what HF should run to match).

The packing here is written from the formats' descriptions, independently of mrv2's kernels and
layers, so a loader can be tested against it; :func:`unpack_gptq`, :func:`unpack_awq` and
:func:`unpack_compressed_tensors` undo it in plain torch (used to check the writers themselves).

Quantized: every 2-D ``*_proj.weight`` outside ``.experts.`` (attention q/k/v/o_proj, MLP
gate/up/down_proj), a weight ``W`` being ``[N, K]`` = [out_features, in_features] with groups of
``group_size`` along ``K``. Everything else is copied unchanged.

With ``experts=True`` the routed experts of an MoE checkpoint are quantized too, stored as
published GPTQ / AWQ / compressed-tensors MoE checkpoints (e.g. Qwen3-30B-A3B-GPTQ-Int4) store
them: one quantized layer per expert and projection, ``<p>.experts.{e}.gate_proj.<tensors>``,
``<p>.experts.{e}.up_proj.<tensors>`` and ``<p>.experts.{e}.down_proj.<tensors>``, each with
exactly the tensors of a dense layer. Two source layouts are read:

- per expert, ``<p>.experts.{e}.{gate,up,down}_proj.weight`` (what transformers 5's
  ``save_pretrained`` writes for Qwen3-MoE: it converts back to the original layout on save);
- transformers 5's in-memory stacked layout, ``<p>.experts.gate_up_proj`` ``[E, 2I, H]`` (each
  expert's gate rows, then its up rows) and ``<p>.experts.down_proj`` ``[E, H, I]``: expert
  ``e``'s gate is ``gate_up_proj[e, :I]``, its up ``gate_up_proj[e, I:]``, its down
  ``down_proj[e]``.

The reference keeps the source's names and shapes (stacked stays stacked, gate and up
concatenated back), holding the dequantized values. The router (``mlp.gate.weight``) and
anything else not named ``*_proj.weight`` stays unquantized, unless a writer's ``also`` names
its ending (Qwen3.5's ``.in_proj_qkv.weight``, ``.in_proj_z.weight``: 2-D weights quantized as
the others).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

#: AWQ GEMM's nibble order: nibble ``i`` (bits ``4*i..4*i+3``) of packed column ``j`` holds
#: output column ``8 * j + AWQ_ORDER[i]``.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

#: ``(name, source weight) -> (tensors for dst, dequantized weight for reference)``
_Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]

#: transformers 5's stacked routed experts: ``<prefix>.experts.{gate_up_proj,down_proj}``
_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def is_quantized_weight(name: str, tensor: torch.Tensor, *, experts: bool = False) -> bool:
    """Whether the writers here quantize ``name`` as one layer: a 2-D ``*_proj.weight`` outside
    the routed experts (``.experts.``), or with ``experts`` inside them too (per-expert
    ``experts.{e}.{gate,up,down}_proj.weight``; stacked experts: :func:`is_stacked_experts`)."""
    return (name.endswith("_proj.weight") and (experts or ".experts." not in name)
            and tensor.dim() == 2)


def is_stacked_experts(name: str, tensor: torch.Tensor) -> bool:
    """Whether ``name`` is transformers 5's stacked routed experts: a 3-D
    ``<prefix>.experts.gate_up_proj`` ``[E, 2I, H]`` or ``<prefix>.experts.down_proj``
    ``[E, H, I]``, split per expert by the writers when ``experts=True``."""
    return _STACKED_EXPERTS.match(name) is not None and tensor.dim() == 3


def gptq_checkpoint(src: str | Path, dst: str | Path, reference: str | Path, *, bits: int = 4,
                    group_size: int = 32, desc_act: bool = False, sym: bool = True,
                    seed: int = 0, experts: bool = False, lm_head: bool = False,
                    also: tuple[str, ...] = ()) -> None:
    """Save ``src`` as a GPTQ checkpoint (``checkpoint_format: "gptq"``, i.e. "v1") in ``dst``
    and its dequantized twin in ``reference``.

    Per quantized weight ``<prefix>.weight`` ``[N, K]``, ``dst`` holds (with ``pack = 32 //
    bits``, ``G`` groups):

    - ``<prefix>.qweight``: int32 ``[K // pack, N]``, packed along ``K``: ``q[n, k]`` in row
      ``k // pack`` at bits ``(k % pack) * bits`` (lowest first);
    - ``<prefix>.qzeros``: int32 ``[G, N // pack]``, ``zero - 1`` packed along ``N`` the same
      way (symmetric: ``2**(bits-1) - 1``);
    - ``<prefix>.scales``: float16 ``[G, N]``; ``<prefix>.g_idx``: int32 ``[K]``, the group of
      each input column.

    ``desc_act`` draws one permutation ``perm`` of ``range(K)`` from ``seed`` (the same for every
    weight with that ``K``, so the q/k/v and the gate/up projections of a layer share it): column
    ``perm[i]`` is in group ``i // group_size``. Otherwise column ``k`` is in group
    ``k // group_size``. ``group_size=-1``: one group of all ``K``. ``experts``: quantize the
    routed experts too, one layer per expert and projection (see the module docstring), with
    the same per-``K`` permutation. ``lm_head``: quantize ``lm_head.weight`` too
    (``quantization_config.lm_head: true``, as GPTQModel writes it).

    Asymmetric zero points are kept in ``[1, 2**bits - 1]``: a stored ``zero - 1`` never wraps,
    so kernels that add one back with or without masking read the same zero.
    """
    if bits not in (2, 4, 8):
        raise ValueError(f"GPTQ bits must be 2, 4 or 8, got {bits}")
    pack = 32 // bits
    maxq = 2**bits - 1

    def quantize(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        n, k = w.shape
        if k % pack or n % pack:
            raise ValueError(f"{name}: shape {tuple(w.shape)} not a multiple of {pack} (pack)")
        g_idx = _group_index(k, group_size, desc_act, seed, name)
        q, zero, scale, deq = _quantize(w, g_idx, bits, sym, min_zero=1)
        prefix = name.removesuffix(".weight")
        out = {
            prefix + ".qweight": _pack_rows(q, bits).t().contiguous(),
            prefix + ".qzeros": _pack_rows(((zero - 1) & maxq).t(), bits).contiguous(),
            prefix + ".scales": scale.t().contiguous(),
            prefix + ".g_idx": g_idx.to(torch.int32).contiguous(),
        }
        return out, deq.to(w.dtype).contiguous()

    _rewrite(src, dst, reference, quantize, {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act,
        "sym": sym, "checkpoint_format": "gptq", "static_groups": False,
        "true_sequential": True, "damp_percent": 0.01,
        **({"lm_head": True} if lm_head else {})}, experts,
        extra=("lm_head.weight",) if lm_head else (), also=also)


def awq_checkpoint(src: str | Path, dst: str | Path, reference: str | Path, *,
                   group_size: int = 32, seed: int = 0, experts: bool = False,
                   also: tuple[str, ...] = ()) -> None:
    """Save ``src`` as an AWQ checkpoint (4 bits, zero point, GEMM version) in ``dst`` and its
    dequantized twin in ``reference``.

    Per quantized weight ``<prefix>.weight`` ``[N, K]``, ``dst`` holds (``G`` groups along
    ``K``, ``group_size=-1``: one):

    - ``<prefix>.qweight``: int32 ``[K, N // 8]``, packed along ``N``: nibble ``i`` of column
      ``j`` holds ``q[8 * j + AWQ_ORDER[i], k]``;
    - ``<prefix>.qzeros``: int32 ``[G, N // 8]``, the zero points packed the same way;
    - ``<prefix>.scales``: float16 ``[G, N]``.

    ``seed`` is unused (AWQ has no random part); it is there for symmetry with
    :func:`gptq_checkpoint`. ``experts``: quantize the routed experts too, one layer per expert
    and projection (see the module docstring).
    """
    del seed
    order = torch.tensor(AWQ_ORDER)

    def awq_pack(values: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N // 8]
        rows, n = values.shape
        return _pack_rows(values.reshape(rows, n // 8, 8)[..., order].reshape(rows, n), 4)

    def quantize(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        n, k = w.shape
        if n % 8:
            raise ValueError(f"{name}: {n} output features, not a multiple of 8")
        g_idx = _group_index(k, group_size, False, 0, name)
        q, zero, scale, deq = _quantize(w, g_idx, 4, False, min_zero=0)
        prefix = name.removesuffix(".weight")
        out = {
            prefix + ".qweight": awq_pack(q.t()).contiguous(),
            prefix + ".qzeros": awq_pack(zero.t()).contiguous(),
            prefix + ".scales": scale.t().contiguous(),
        }
        return out, deq.to(w.dtype).contiguous()

    _rewrite(src, dst, reference, quantize, {
        "quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
        "version": "gemm", "modules_to_not_convert": None}, experts, also=also)


def compressed_tensors_checkpoint(src: str | Path, dst: str | Path, reference: str | Path, *,
                                  bits: int = 4, group_size: int = 32, sym: bool = True,
                                  actorder: bool = False, seed: int = 0,
                                  experts: bool = False, also: tuple[str, ...] = ()) -> None:
    """Save ``src`` as an llm-compressor / compressed-tensors checkpoint (``format:
    "pack-quantized"``, W4A16 or W8A16) in ``dst`` and its dequantized twin in ``reference``.

    Values are quantized in the signed range ``[-2**(bits-1), 2**(bits-1) - 1]`` and stored
    unsigned, plus ``offset = 2**(bits-1)`` (a symmetric 4-bit 0 is stored as 8). Per quantized
    weight ``<prefix>.weight`` ``[N, K]`` (source dtype ``dtype``), ``dst`` holds (with
    ``pack = 32 // bits``, ``G`` groups along ``K``):

    - ``<prefix>.weight_packed``: int32 ``[N, K // pack]``, packed along ``K``: word ``j`` of row
      ``n`` holds column ``pack * j + i`` at bits ``bits * i`` (lowest first);
    - ``<prefix>.weight_scale``: ``dtype`` ``[N, G]``;
    - ``<prefix>.weight_zero_point`` (only if not ``sym``): int32 ``[N // pack, G]``, the zero
      points (plus the offset) packed along ``N``: word row ``j`` holds output row
      ``pack * j + i`` at bits ``bits * i``;
    - ``<prefix>.weight_g_idx`` (only with ``actorder``): int32 ``[K]``, the group of each input
      column, drawn as :func:`gptq_checkpoint` does with ``desc_act`` (one permutation per ``K``
      from ``seed``);
    - ``<prefix>.weight_shape``: int64 ``[2]``, ``[N, K]``.

    The dequantized weight is ``(q - zero) * scale`` in float32 (``zero = 0`` if ``sym``), the
    scale rounded to ``dtype`` first, then cast to ``dtype``. ``group_size=-1`` is the
    "channel" strategy (one scale per output row, ``G = 1``); ``actorder`` ("group" activation
    ordering) needs the "group" strategy. ``experts``: quantize the routed experts too, one
    layer per expert and projection (see the module docstring), with the same per-``K``
    permutation under ``actorder``.
    """
    if bits not in (4, 8):
        raise ValueError(f"compressed-tensors pack-quantized bits must be 4 or 8, got {bits}")
    if actorder and group_size == -1:
        raise ValueError("actorder needs the group strategy (group_size != -1)")
    pack = 32 // bits

    def quantize(name: str, w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        n, k = w.shape
        if k % pack or (not sym and n % pack):
            raise ValueError(f"{name}: shape {tuple(w.shape)} not a multiple of {pack} (pack)")
        g_idx = _group_index(k, group_size, actorder, seed, name)
        # unsigned q and zero of _quantize are the signed ones plus the offset (symmetric: the
        # zero is the offset, i.e. a signed zero of 0)
        q, zero, scale, deq = _quantize(w, g_idx, bits, sym, min_zero=0, scale_dtype=w.dtype)
        prefix = name.removesuffix(".weight")
        out = {
            prefix + ".weight_packed": _pack_rows(q, bits).contiguous(),
            prefix + ".weight_scale": scale.contiguous(),
            prefix + ".weight_shape": torch.tensor([n, k], dtype=torch.int64),
        }
        if not sym:
            out[prefix + ".weight_zero_point"] = _pack_rows(zero.t(), bits).t().contiguous()
        if actorder:
            out[prefix + ".weight_g_idx"] = g_idx.to(torch.int32).contiguous()
        return out, deq.to(w.dtype).contiguous()

    weights: dict[str, Any] = {
        "num_bits": bits, "type": "int", "symmetric": sym,
        "strategy": "channel" if group_size == -1 else "group",
        "group_size": None if group_size == -1 else group_size,
        "actorder": "group" if actorder else None, "dynamic": False, "observer": "minmax",
        "block_structure": None}
    _rewrite(src, dst, reference, quantize, {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": None, "output_activations": None,
            "weights": weights}}}, experts, also=also)


#: e2m1's magnitudes, by the low three bits of a code (bit 3: the sign).
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
#: gpt-oss's float experts in transformers 5's layout (``[E, H, 2I]`` / ``[E, I, H]``).
_GPT_OSS_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def mxfp4_checkpoint(src: str | Path, dst: str | Path, reference: str | Path) -> None:
    """Save a tiny gpt-oss checkpoint (``src``: transformers 5's float experts) with its routed
    experts in MXFP4 as OpenAI publishes gpt-oss: ``<p>.experts.gate_up_proj_blocks`` uint8
    ``[E, 2I, H / 32, 16]`` (the codes of 32 inputs in 16 bytes, the lower input in the low
    nibble) and ``..._scales`` uint8 ``[E, 2I, H / 32]`` (e8m0: ``2 ** (s - 127)``), likewise
    ``down_proj_*`` ``[E, H, I / 32, ...]``; rows as in the float stack transposed (gate and up
    interleaved). Each group's scale is the smallest power of two that brings its largest
    magnitude to 6 or below; each value rounds to the nearest e2m1. ``reference``: the same
    checkpoint with the dequantized float experts."""
    _convert_checkpoint(src, dst, reference, _mxfp4_experts, {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]})


def _mxfp4_experts(name: str, t: torch.Tensor, quantized: dict[str, torch.Tensor]
                   ) -> torch.Tensor:
    """:func:`mxfp4_checkpoint`'s tensor ``name``: a float expert stack's blocks and scales
    into ``quantized``, its dequantized values returned; anything else as it is."""
    if _GPT_OSS_EXPERTS.match(name) is None or t.dim() != 3:
        quantized[name] = t
        return t
    w = t.transpose(1, 2).float()  # [E, N, K]
    groups = w.unflatten(-1, (-1, 32))
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(2.0**-120) / 6))
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(_E2M1_MAGNITUDES)
    index = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)
    codes = index + 8 * (scaled < 0).long()
    quantized[name + "_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(
        torch.uint8).contiguous()
    quantized[name + "_scales"] = (exponent + 127).to(torch.uint8).contiguous()
    values = magnitudes[index] * torch.where(scaled < 0, -1.0, 1.0)
    real = (values * torch.exp2(exponent)[..., None]).flatten(-2)
    return real.transpose(1, 2).to(t.dtype).contiguous()


# -- internals ---------------------------------------------------------------------------------


def _rewrite(src: str | Path, dst: str | Path, reference: str | Path, quantize: _Quantizer,
             quant_config: dict[str, Any], experts: bool, extra: tuple[str, ...] = (),
             also: tuple[str, ...] = ()) -> None:
    """Copy ``src`` to ``dst`` and ``reference``, quantize its weights (with ``experts``, the
    routed experts too, split per expert if stacked; the 2-D weights named in ``extra`` and
    those whose names end in one of ``also`` too)
    into ``dst`` and their dequantized values into ``reference``, and set ``dst``'s
    ``quantization_config``."""
    def convert(name: str, t: torch.Tensor, quantized: dict[str, torch.Tensor]
                ) -> torch.Tensor:
        if experts and is_stacked_experts(name, t):
            return _quantize_stacked_experts(name, t, quantize, quantized)
        if is_quantized_weight(name, t, experts=experts) or name in extra or (
                also and name.endswith(also) and t.dim() == 2):
            packed, real = quantize(name, t)
            quantized.update(packed)
            return real
        quantized[name] = t
        return t

    _convert_checkpoint(src, dst, reference, convert, quant_config)


def _convert_checkpoint(
    src: str | Path, dst: str | Path, reference: str | Path,
    convert: Callable[[str, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor],
    quant_config: dict[str, Any],
) -> None:
    """Copy ``src`` to ``dst`` and ``reference``; ``convert(name, tensor, quantized)`` puts
    each tensor's stored form into ``quantized`` (``dst``'s) and returns its real values
    (``reference``'s); ``dst``'s config gets ``quant_config``."""
    src, dst, reference = Path(src), Path(dst), Path(reference)
    for out in (dst, reference):
        shutil.copytree(src, out, dirs_exist_ok=True)
    quantized: dict[str, torch.Tensor] = {}
    dequantized = {name: convert(name, t, quantized)
                   for name, t in load_file(src / "model.safetensors").items()}
    save_file(quantized, dst / "model.safetensors")
    save_file(dequantized, reference / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))


def _quantize_stacked_experts(name: str, t: torch.Tensor, quantize: _Quantizer,
                              quantized: dict[str, torch.Tensor]) -> torch.Tensor:
    """Quantize stacked experts ``name`` (``<prefix>.experts.gate_up_proj`` ``[E, 2I, H]`` or
    ``<prefix>.experts.down_proj`` ``[E, H, I]``) as one layer per expert and projection
    (``<prefix>.experts.{e}.{gate,up,down}_proj``), adding their tensors to ``quantized``.
    Returns the dequantized stack, shaped and typed as ``t``."""
    match = _STACKED_EXPERTS.match(name)
    assert match is not None, name
    prefix, kind = match.groups()
    if kind == "gate_up_proj" and t.shape[1] % 2:
        raise ValueError(f"{name}: odd gate_up rows {t.shape[1]}")
    inter = t.shape[1] // 2
    parts = []
    for e in range(t.shape[0]):
        if kind == "down_proj":
            layers = [("down_proj", t[e])]
        else:
            layers = [("gate_proj", t[e, :inter]), ("up_proj", t[e, inter:])]
        deq = []
        for proj, w in layers:
            packed, d = quantize(f"{prefix}.{e}.{proj}.weight", w.contiguous())
            quantized.update(packed)
            deq.append(d)
        parts.append(torch.cat(deq))
    return torch.stack(parts).contiguous()


def _group_index(k: int, group_size: int, desc_act: bool, seed: int, name: str) -> torch.Tensor:
    """The group of each of ``k`` input columns (int64 ``[k]``)."""
    size = k if group_size == -1 else group_size
    if size <= 0 or k % size:
        raise ValueError(f"{name}: group_size {group_size} does not divide in_features {k}")
    groups = torch.arange(k) // size
    if not desc_act:
        return groups
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = groups
    return g_idx


def _quantize(w: torch.Tensor, g_idx: torch.Tensor, bits: int, sym: bool, min_zero: int,
              scale_dtype: torch.dtype = torch.float16
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``w`` ``[N, K]`` per (output row, group of ``g_idx``), in float32, to unsigned
    ``[0, 2**bits)`` (symmetric: zero ``2**(bits-1)``).

    Returns ``q`` (int64 ``[N, K]``), ``zero`` (int64 ``[N, G]``), ``scale`` (``scale_dtype``
    ``[N, G]``) and the dequantized weight ``(q - zero) * scale`` (float32 ``[N, K]``), the
    scale rounded to ``scale_dtype`` first."""
    w = w.float()
    n = w.shape[0]
    maxq = 2**bits - 1
    num_groups = int(g_idx.max()) + 1
    index = g_idx.long().expand(n, -1)
    # the zeros the reductions start from make these min(w, 0) and max(w, 0)
    xmin = torch.zeros(n, num_groups).scatter_reduce(1, index, w, "amin")
    xmax = torch.zeros(n, num_groups).scatter_reduce(1, index, w, "amax")
    scale = torch.maximum(-xmin, xmax) * 2 / maxq if sym else (xmax - xmin) / maxq
    scale16 = torch.where(scale == 0, 1.0, scale).to(scale_dtype)
    scale16 = torch.where(scale16 == 0, 1.0, scale16)  # underflowed in scale_dtype
    s = scale16.float()
    if sym:
        zero = torch.full((n, num_groups), 2 ** (bits - 1), dtype=torch.int64)
    else:
        zero = torch.round(-xmin / s).clamp(min_zero, maxq).long()
    s_k, zero_k = s[:, g_idx.long()], zero[:, g_idx.long()]
    q = (torch.round(w / s_k) + zero_k).clamp(0, maxq).long()
    return q, zero, scale16, (q - zero_k).float() * s_k


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in ``[0, 2**32)`` as int32 with two's-complement wrap."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``values`` ``[R, M]`` (in ``[0, 2**bits)``) along ``M`` into int32 ``[R, M // pack]``:
    element ``m`` in word ``m // pack`` at bits ``(m % pack) * bits``."""
    pack = 32 // bits
    rows, m = values.shape
    shifts = torch.arange(pack, dtype=torch.int64) * bits
    words = (values.long().reshape(rows, m // pack, pack) << shifts).sum(-1)
    return _to_int32(words)


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Undo :func:`_pack_rows`: int32 ``[R, W]`` to int64 ``[R, W * pack]``."""
    pack = 32 // bits
    shifts = torch.arange(pack, dtype=torch.int64) * bits
    values = (packed.long().unsqueeze(-1) >> shifts) & (2**bits - 1)
    return values.reshape(packed.shape[0], -1)


# -- unpacking, to check the writers -----------------------------------------------------------


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Dequantize a GPTQ ("v1") weight: ``qweight`` int32 ``[K // pack, N]``, ``qzeros`` int32
    ``[G, N // pack]`` (zero points minus one), ``scales`` ``[G, N]``, ``g_idx`` ``[K]``.
    Returns float32 ``[N, K]``."""
    q = _unpack_rows(qweight.t(), bits)  # [N, K]
    zeros = _unpack_rows(qzeros, bits) + 1  # [G, N]
    g = g_idx.long()
    return (q - zeros.t()[:, g]).float() * scales.float().t()[:, g]


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group_size: int) -> torch.Tensor:
    """Dequantize an AWQ GEMM weight: ``qweight`` int32 ``[K, N // 8]``, ``qzeros`` int32
    ``[G, N // 8]``, ``scales`` ``[G, N]``. Returns float32 ``[N, K]``."""
    inverse = torch.argsort(torch.tensor(AWQ_ORDER))

    def unpack(packed: torch.Tensor) -> torch.Tensor:  # [R, N // 8] -> [R, N]
        nibbles = _unpack_rows(packed, 4).reshape(packed.shape[0], -1, 8)
        return nibbles[..., inverse].reshape(packed.shape[0], -1)

    q, zeros = unpack(qweight), unpack(qzeros)  # [K, N], [G, N]
    k = q.shape[0]
    g = torch.arange(k) // (k if group_size == -1 else group_size)
    return ((q - zeros[g]).float() * scales.float()[g]).t()


def unpack_compressed_tensors(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                              weight_zero_point: torch.Tensor | None,
                              g_idx: torch.Tensor | None, bits: int) -> torch.Tensor:
    """Dequantize a compressed-tensors "pack-quantized" weight: ``weight_packed`` int32
    ``[N, K // pack]``, ``weight_scale`` ``[N, G]``, ``weight_zero_point`` int32
    ``[N // pack, G]`` (``None``: symmetric), ``g_idx`` ``[K]`` (``None``: column ``k`` in group
    ``k // (K // G)``). Returns float32 ``[N, K]``."""
    offset = 2 ** (bits - 1)
    q = _unpack_rows(weight_packed, bits) - offset  # [N, K], signed
    k, num_groups = q.shape[1], weight_scale.shape[1]
    g = torch.arange(k) // (k // num_groups) if g_idx is None else g_idx.long()
    if weight_zero_point is None:
        zero = torch.zeros_like(weight_scale, dtype=torch.int64)
    else:
        zero = _unpack_rows(weight_zero_point.t(), bits).t() - offset  # [N, G], signed
    return (q - zero[:, g]).float() * weight_scale.float()[:, g]
