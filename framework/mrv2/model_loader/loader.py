"""Reading HF safetensors checkpoints into models, and dummy weights for benchmarks.

A model's ``load_weights(weights)`` maps checkpoint names to its parameters and returns the
names it filled; :func:`load_model_weights` then checks nothing was left out. Parameters may carry
a ``weight_loader(param, loaded[, shard_id])`` attribute (fused layers do); the rest take
:func:`default_weight_loader`. :func:`load_stacked_weights` is that mapping loop for the usual
decoder whose q/k/v and gate/up projections are fused.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from mrv2.layers.norm import RMSNorm

INDEX_FILE = "model.safetensors.index.json"

StackedMapping = Sequence[tuple[str, str, Any]]
"""``(fused_fragment, checkpoint_fragment, shard_id)``, e.g. ``("qkv_proj", "q_proj", "q")``."""


def _safetensors_files(model_dir: Path) -> list[Path]:
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist")
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
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


def _iter_files(paths: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in paths:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy ``loaded`` into ``param`` (dtype and device converted); shapes must match."""
    if param.shape != loaded.shape:
        raise ValueError(
            f"parameter expects shape {tuple(param.shape)}, checkpoint tensor has "
            f"{tuple(loaded.shape)}"
        )
    with torch.no_grad():
        param.data.copy_(loaded)


def load_param(
    name: str,
    param: nn.Parameter,
    loaded: torch.Tensor,
    shard_id: Any = None,
    source: str | None = None,
) -> None:
    """Load ``loaded`` (checkpoint tensor ``source``) into parameter ``name``.

    Goes through the parameter's ``weight_loader`` (with ``shard_id`` when given), else
    :func:`default_weight_loader`. A ``ValueError`` from the loader (a shape mismatch) is
    re-raised naming the parameter and the checkpoint tensor.
    """
    loader: Callable[..., None] = getattr(param, "weight_loader", default_weight_loader)
    try:
        if shard_id is None:
            loader(param, loaded)
        else:
            loader(param, loaded, shard_id)
    except ValueError as e:
        what = f"checkpoint tensor {source!r}" if source else "checkpoint tensor"
        raise ValueError(f"cannot load {what} into parameter {name!r}: {e}") from e


def load_stacked_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedMapping = (),
    rename: Callable[[str], str | None] = lambda name: name,
) -> set[str]:
    """Load checkpoint ``weights`` into ``model``; return the parameter names filled.

    ``rename`` maps a checkpoint name to the model's name, or to None to skip the tensor.
    A name containing ``.{checkpoint_fragment}.`` of a ``stacked`` entry goes to shard
    ``shard_id`` of the fused parameter. A name matching no parameter is an error.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None:
            continue
        shard_id = None
        for fused, fragment, shard in stacked:
            if f".{fragment}." in name:
                name, shard_id = name.replace(f".{fragment}.", f".{fused}."), shard
                break
        if name not in params:
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} matches no parameter of "
                f"{type(model).__name__} (looked for {name!r})"
            )
        load_param(name, params[name], tensor, shard_id, source=ckpt_name)
        loaded.add(name)
    return loaded


def load_model_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *, strict: bool = True
) -> set[str]:
    """Run ``model.load_weights(weights)``; with ``strict``, fail if any parameter was not loaded.

    Returns the names of the parameters that were loaded.
    """
    load_weights = getattr(model, "load_weights", None)
    if load_weights is None:
        raise TypeError(
            f"{type(model).__name__} has no load_weights(weights) method: every mrv2 model must "
            f"map checkpoint names to its parameters itself"
        )
    loaded: set[str] = load_weights(weights)
    missing = sorted(name for name, _ in model.named_parameters() if name not in loaded)
    if strict and missing:
        shown = ", ".join(missing[:20]) + (", ..." if len(missing) > 20 else "")
        raise ValueError(
            f"{len(missing)} parameter(s) of {type(model).__name__} were not found in the "
            f"checkpoint: {shown}. Check that the checkpoint matches the model architecture "
            f"(or load with strict=False)."
        )
    return loaded


def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Fill ``model`` with random weights: normal(0, ``std``), ones for norms, zeros for biases.

    For ``--load-format dummy``: throughput does not depend on the values, but they must be
    finite and small so the activations stay sane.
    """
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if id(param) in norm_weights:
                param.fill_(1.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                if param.device not in generators:
                    generators[param.device] = torch.Generator(param.device).manual_seed(seed)
                param.normal_(0.0, std, generator=generators[param.device])
