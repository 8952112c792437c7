"""Reading HF safetensors checkpoints into models, and dummy weights for benchmarks.

A model's ``load_weights(weights)`` maps checkpoint names to its parameters and returns the
names it filled; :func:`load_model_weights` then checks nothing was left out. Parameters may carry
a ``weight_loader(param, loaded[, shard_id])`` attribute (fused layers do); the rest take
:func:`default_weight_loader`. :func:`load_stacked_weights` is that mapping loop for the usual
decoder whose q/k/v and gate/up projections are fused (those live in :mod:`mrv2.layers.weights`
and are re-exported here).
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mrv2.layers.embedding import PoolingLogits
from mrv2.layers.norm import LayerNorm, RMSNorm
from mrv2.layers.weights import (  # noqa: F401 (re-exported: mrv2.model_loader's names)
    StackedMapping,
    default_weight_loader,
    expert_weight_target,
    load_param,
    load_stacked_weights,
    missing_shards,
    shard_coverage,
)

INDEX_FILE = "model.safetensors.index.json"
logger = logging.getLogger(__name__)

#: Name endings of a checkpoint's per-layer KV-cache (and attention) quantization scales:
#: FP8 / ModelOpt checkpoints' ``self_attn.k_scale`` (or ``self_attn.attn.k_scale``, the
#: deprecated ``kv_scale``), compressed-tensors' ``kv_cache_scheme`` (``k_proj.output_scale``
#: in older files). mrv2's KV cache stores keys and values unscaled: no model has parameters
#: for them (:func:`load_model_weights` leaves them out, :func:`check_kv_cache_scales` refuses
#: an fp8 cache they would scale).
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale", ".q_scale", ".prob_scale",
                     ".k_proj.output_scale", ".v_proj.output_scale", ".q_proj.output_scale",
                     ".prob_output_scale")

def _safetensors_files(model_dir: Path) -> list[Path]:
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted({str(name) for name in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{index} is not a safetensors index: expected a JSON object "
                             f"whose 'weight_map' maps tensor names to file names ({error!r})"
                             ) from None
        files = [model_dir / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index} lists weight files that are not in {str(model_dir)!r}: {missing}"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no weights in {str(model_dir)!r}: expected model.safetensors, or sharded "
            f"*.safetensors files with {INDEX_FILE}"
        )
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Iterate ``(name, cpu_tensor)`` over every tensor of the checkpoint in ``model_dir``.

    Reads the files named by ``model.safetensors.index.json`` when present, else every
    ``*.safetensors`` file of the directory. Raises ``FileNotFoundError`` right away (not on
    first iteration) if there are none.
    """
    return _iter_files(_safetensors_files(Path(model_dir)))


def is_kv_cache_scale(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a KV-cache scale (:data:`KV_SCALE_SUFFIXES`)."""
    return name.endswith(KV_SCALE_SUFFIXES)


def check_kv_cache_scales(model_dir: str | Path, kv_cache_dtype: str) -> None:
    """With an fp8 KV cache (``kv_cache_dtype`` not ``"auto"``), a ValueError if the
    checkpoint in ``model_dir`` holds KV-cache scales other than 1: vLLM divides keys and
    values by them before the fp8 cast, mrv2's fp8 cache does not (its kernels take no
    per-layer scales), so the cache would hold other values than the checkpoint was
    calibrated for. Scales of 1 are what mrv2 applies; the model-dtype cache needs none."""
    if kv_cache_dtype == "auto":
        return
    scales: list[str] = []
    for path in _safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in list(f.keys()):
                if is_kv_cache_scale(name) and not bool(
                        (f.get_tensor(name).float() == 1.0).all()):
                    scales.append(name)
    if scales:
        shown = ", ".join(sorted(scales)[:4]) + (", ..." if len(scales) > 4 else "")
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r}: the checkpoint in {str(model_dir)!r} holds "
            f"{len(scales)} KV-cache scale tensor(s) other than 1 ({shown}), and mrv2's fp8 KV "
            f"cache stores keys and values unscaled (it cannot apply per-layer k/v scales). "
            f"Use kv_cache_dtype='auto' (the model's dtype: the scales are not needed)")


def checkpoint_names(model_dir: str | Path) -> list[str]:
    """The names of every tensor of the checkpoint in ``model_dir`` (headers only)."""
    names: list[str] = []
    for path in _safetensors_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            names += list(f.keys())
    return names


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def _iter_files(paths: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor as a view of the memory-mapped file: nothing is read until a loader copies
    it, and a tensor-parallel rank that copies a slice (``narrow``) reads only the pages of
    that slice. The mapping is copy-on-write, so a loader that edits a tensor in place edits
    its private copy, never the file."""
    for path in paths:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        base = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:  # a dtype torch cannot view: read it the ordinary way
                with safe_open(str(path), framework="pt", device="cpu") as st:
                    yield name, st.get_tensor(name)
                continue
            begin, end = info["data_offsets"]
            shape = [int(d) for d in info["shape"]]
            if end == begin:
                yield name, torch.empty(shape, dtype=dtype)
                continue
            raw = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin,
                                   offset=base + begin)
            try:
                tensor = raw.view(dtype)
            except RuntimeError:  # an offset the dtype cannot view in place: copy it
                tensor = raw.clone().view(dtype)
            yield name, tensor.view(shape)


def load_model_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True,
    optional: frozenset[str] = frozenset(),
) -> set[str]:
    """Run ``model.load_weights(weights)``; with ``strict``, fail if any parameter was not loaded
    but those named in ``optional``, or if a fused parameter got some of its checkpoint tensors
    but not all (``q_proj`` and ``v_proj`` but no ``k_proj``). KV-cache scales
    (:func:`is_kv_cache_scale`) are left out, with a log line.

    Returns the names of the parameters that were loaded.
    """
    load_weights = getattr(model, "load_weights", None)
    if load_weights is None:
        raise TypeError(
            f"{type(model).__name__} has no load_weights(weights) method: every mrv2 model must "
            f"map checkpoint names to its parameters itself"
        )
    if isinstance(getattr(model, "lm_head", None), PoolingLogits) and not getattr(
            model, "tie_word_embeddings", False):
        # a pooling engine's LM head is gone: the checkpoint's is not read (a tied one's name
        # fills the embedding, the model's rename says so)
        weights = ((name, t) for name, t in weights if name != "lm_head.weight")
    skipped: list[str] = []

    def without_kv_scales(tensors: Iterable[tuple[str, torch.Tensor]]
                          ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            if is_kv_cache_scale(name):
                skipped.append(name)
            else:
                yield name, tensor

    with shard_coverage() as coverage:
        loaded: set[str] = load_weights(without_kv_scales(weights))
    if skipped:
        logger.info("%d KV-cache scale tensor(s) of the checkpoint (%s%s) are not used: "
                    "mrv2's KV cache stores keys and values unscaled (kv_cache_dtype='auto': "
                    "in the model dtype; an fp8 cache refuses scales other than 1)",
                    len(skipped), skipped[0], ", ..." if len(skipped) > 1 else "")
    if not strict:
        return loaded
    missing = sorted(name for name, p in model.named_parameters()
                     if name not in loaded and name not in optional
                     and not getattr(p, "optional", False))
    for names, what, advice in (
            (missing_shards(coverage), "part(s) of fused parameters", "is complete and "
             "matches the model architecture"),
            (missing, "parameter(s)", "matches the model architecture (or load with "
             "strict=False)")):
        if names:
            shown = ", ".join(names[:20]) + (", ..." if len(names) > 20 else "")
            raise ValueError(f"{len(names)} {what} of {type(model).__name__} were not found "
                             f"in the checkpoint: {shown}. Check that the checkpoint {advice}.")
    return loaded


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill ``model`` with random weights: normal(0, ``std``), ones for norms, zeros for biases.

    For ``--load-format dummy``: throughput does not depend on the values, but they must be
    finite and small so the activations stay sane.
    """
    norm_weights = {id(m.weight) for m in model.modules()
                    if isinstance(m, (RMSNorm, LayerNorm)) and m.weight is not None}
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dtype in fp8 or not param.is_floating_point():
                continue  # drawn by their layer (mrv2.layers.fp8, mrv2.layers.int_model)
            if id(param) in norm_weights:
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                if param.device not in generators:
                    generators[param.device] = torch.Generator(param.device).manual_seed(seed)
                param.normal_(0.0, std, generator=generators[param.device])
