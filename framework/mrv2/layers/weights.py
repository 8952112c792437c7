"""Mapping checkpoint tensors onto a model's parameters: the loop every ``load_weights`` runs.

Parameters may carry a ``weight_loader(param, loaded[, shard_id])`` attribute (fused layers
do); the rest take :func:`default_weight_loader`. :func:`load_stacked_weights` is the mapping
loop of the usual decoder, whose q/k/v and gate/up projections are fused and whose routed
experts are stacked. :mod:`mrv2.model_loader` re-exports these names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

StackedMapping = Sequence[tuple[str, str, Any]]
"""``(fused_fragment, checkpoint_fragment, shard_id)``, e.g. ``("qkv_proj", "q_proj", "q")``.
A ``shard_id`` that is a tuple of several shard ids (``("in_proj_qkvz", "in_proj_qkv", (0, 1,
2))``) names a checkpoint tensor of those shards together that the model splits into them
before loading (Qwen3.5's ``in_proj_qkv``): it maps the name to its layer (the quantized
layers' discovery, LoRA adapters) but is never loaded, nor awaited, itself."""

_EXPERT_NAME = re.compile(
    r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\."
    r"(weight|weight_scale_inv|qweight|qzeros|scales|g_idx|weight_packed|weight_scale"
    r"|weight_zero_point|weight_g_idx|weight_shape|blocks)$"
)
_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
_EXPERT_SHARD = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                 "down_proj": "down", "w2": "down"}

ShardCoverage = dict[str, tuple[dict[Any, str], set[Any]]]
"""A fused parameter's name -> (its shards' checkpoint fragments by shard id, the shards
loaded)."""
_COVERAGE: ContextVar[ShardCoverage | None] = ContextVar("_COVERAGE", default=None)


@contextmanager
def shard_coverage() -> Iterator[ShardCoverage]:
    """Record, while active, which shards of each fused parameter :func:`load_stacked_weights`
    filled (a whole-checkpoint load checks them with :func:`missing_shards`; a partial update
    of the weights need not give every shard)."""
    coverage: ShardCoverage = {}
    token = _COVERAGE.set(coverage)
    try:
        yield coverage
    finally:
        _COVERAGE.reset(token)


def missing_shards(coverage: ShardCoverage) -> list[str]:
    """``"param (checkpoint fragment)"`` for each shard of a fused parameter (or of a stacked
    expert parameter: each expert's gate, up or down, :func:`expert_shards`) that
    ``coverage`` saw loaded in part but never got (its rows would hold uninitialized
    memory)."""
    return [f"{name} ({fragment})" for name, (wanted, got) in sorted(coverage.items())
            for shard, fragment in wanted.items() if shard not in got]


def expert_weight_target(name: str) -> tuple[str, Any] | None:
    """``(parameter_name, shard_id)`` of a routed expert's checkpoint tensor, else None.

    ``model.layers.3.mlp.experts.17.up_proj.weight`` (or Mixtral's ``w1``/``w3``/``w2``) goes
    to ``model.layers.3.mlp.experts.w13_weight`` shard ``(17, "up")`` (``...up_proj.qweight``
    to ``w13_qweight``: each tensor of a quantized format likewise) of a
    :class:`~mrv2.layers.moe.FusedMoE`; transformers 5's stacked ``experts.gate_up_proj``
    ``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]`` go whole (shard None).
    """
    m = _EXPERT_NAME.match(name)
    if m is not None:
        kind = _EXPERT_SHARD[m.group(3)]
        stack = "w2" if kind == "down" else "w13"  # fp8 scales, integer experts' tensors too
        return f"{m.group(1)}.{stack}_{m.group(4)}", (int(m.group(2)), kind)
    m = _STACKED_EXPERTS.match(name)
    if m is not None:
        param = "w13_weight" if m.group(2) == "gate_up_proj" else "w2_weight"
        return f"{m.group(1)}.{param}", None
    return None


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
    param.fresh_load = True  # type: ignore[attr-defined]


def is_fresh(param: torch.Tensor | None) -> bool:
    """Whether ``param`` got a checkpoint tensor (:func:`load_param`) since the modules last
    processed their weights (``mrv2.model_loader.build.process_weights_after_loading``
    clears the mark): what a module's hook may reorder or repack in place. A hook that
    transforms only its fresh tensors can run again after a load of some of them (an
    update of the weights) without transforming the others twice."""
    return bool(getattr(param, "fresh_load", False))


def clear_fresh(model: nn.Module) -> None:
    """Forget :func:`is_fresh`'s marks of every parameter of ``model``."""
    for param in model.parameters():
        param.__dict__.pop("fresh_load", None)


def checkpoint_target(
    ckpt_name: str, stacked: StackedMapping = (),
    rename: Callable[[str], str | None] = lambda name: name,
) -> tuple[str, Any] | None:
    """``(parameter name, shard_id)`` checkpoint tensor ``ckpt_name`` loads into (see
    :func:`load_stacked_weights`), or None when ``rename`` skips it."""
    name = rename(ckpt_name)
    if name is None:
        return None
    expert = expert_weight_target(name) if ".experts." in name else None
    if expert is not None:
        return expert
    for fused, fragment, shard in stacked:
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{fused}."), shard
    return name, None


def load_stacked_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: StackedMapping = (),
    rename: Callable[[str], str | None] = lambda name: name,
) -> set[str]:
    """Load checkpoint ``weights`` into ``model``; return the parameter names filled.

    ``rename`` maps a checkpoint name to the model's name, or to None to skip the tensor.
    A routed expert's tensor goes to its shard of the stacked expert weights
    (:func:`expert_weight_target`); otherwise a name containing ``.{checkpoint_fragment}.`` of a
    ``stacked`` entry goes to shard ``shard_id`` of the fused parameter. A name matching no
    parameter is an error, unless its tensor has no elements: transformers builds and saves
    a zero-width layer where a config sizes one 0 (DeepSeek's and GLM's
    ``n_shared_experts: 0``, Qwen2-MoE's ``shared_expert_intermediate_size: 0``), which adds
    nothing and which mrv2's families do not build.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    coverage = _COVERAGE.get()
    wanted: dict[str, dict[Any, str]] = {}  # fused fragment -> {shard id: checkpoint fragment}
    for fused, fragment, shard in stacked:
        if isinstance(shard, tuple) and not _is_expert_shard(shard):
            continue  # (a tensor of several shards, split by the model before loading)
        wanted.setdefault(fused, {}).setdefault(shard, fragment)
    for ckpt_name, tensor in weights:
        target = checkpoint_target(ckpt_name, stacked, rename)
        if target is None:
            continue
        name, shard_id = target
        if name not in params:
            if isinstance(tensor, torch.Tensor) and tensor.numel() == 0:
                continue  # a zero-width layer of a zero-size config: no values, no layer here
            raise ValueError(
                f"checkpoint tensor {ckpt_name!r} matches no parameter of "
                f"{type(model).__name__} (looked for {name!r})"
            )
        load_param(name, params[name], tensor, shard_id, source=ckpt_name)
        loaded.add(name)
        if coverage is None or shard_id is None:
            continue
        if name not in coverage and _is_expert_shard(shard_id):
            shards = expert_shards(model, name)
            if shards is not None:
                coverage[name] = (shards, set())
        if name in coverage:
            if shard_id in coverage[name][0]:
                coverage[name][1].add(shard_id)
            continue
        stack = next((f for f in wanted if f".{f}." in name), None)
        if stack is not None and shard_id in wanted[stack]:
            coverage.setdefault(name, (wanted[stack], set()))[1].add(shard_id)
    return loaded


def _is_expert_shard(shard_id: Any) -> bool:
    return (isinstance(shard_id, tuple) and len(shard_id) == 2
            and isinstance(shard_id[0], int) and shard_id[1] in ("gate", "up", "down"))


def expert_shards(model: nn.Module, name: str) -> dict[Any, str] | None:
    """Every ``(expert, kind)`` shard a stacked expert parameter ``name`` (``...experts.
    w13_<tensor>``: gate and up of each expert; ``w2_<tensor>``: down) takes from a
    checkpoint of one tensor per expert, with the checkpoint fragment that fills it; None
    where the parameter's module has no ``num_experts``. A whole-checkpoint load checks
    them (:func:`missing_shards`): an expert the checkpoint leaves out would keep
    uninitialized memory."""
    module_name, _, param = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    experts = getattr(module, "num_experts", None)
    if not isinstance(experts, int):
        return None
    kinds = ("down",) if param.startswith("w2_") else ("gate", "up")
    return {(e, kind): f"experts.{e}.{kind}_proj" for e in range(experts) for kind in kinds}


def apply_moving_only(module: nn.Module, names: Iterable[str],
                      apply: Callable[[Any], Any], fn: Any) -> None:
    """Run ``apply(fn)`` (a module's ``super()._apply``) with parameters ``names`` left out of
    it, then put them back moved, never cast: ``model.to(dtype)`` must not touch an fp32
    correction bias or fp8 weights and their scales. A parameter on the meta device (a model
    built there) is allocated, uninitialized, on the device ``fn`` moves to."""
    kept = {n: module._parameters.pop(n) for n in names if module._parameters.get(n) is not None}
    try:
        apply(fn)
    finally:
        device = fn(torch.empty(0)).device
        for name, param in kept.items():
            assert param is not None
            if param.is_meta and device.type != "meta":
                loader = getattr(param, "weight_loader", None)
                param = nn.Parameter(torch.empty_like(param.data, device=device),
                                     requires_grad=False)
                if loader is not None:
                    param.weight_loader = loader  # type: ignore[attr-defined]
            elif param.device != device:
                param.data = param.data.to(device)
            module._parameters[name] = param


def load_text_and_encoder(load_text: Callable[[Iterable[tuple[str, torch.Tensor]]], set[str]],
                          encoder: Any, prefixes: tuple[str, ...],
                          weights: Iterable[tuple[str, torch.Tensor]], name: str) -> set[str]:
    """A vision-language checkpoint's tensors: those under ``prefixes`` through
    ``encoder.load_weights`` (its names returned under ``name.``), the rest through
    ``load_text`` (the decoder's loader); the names loaded. ``encoder`` None: every tensor to
    ``load_text``."""
    held: list[tuple[str, torch.Tensor]] = []

    def text() -> Iterable[tuple[str, torch.Tensor]]:
        for tensor_name, tensor in weights:
            if encoder is not None and tensor_name.startswith(prefixes):
                held.append((tensor_name, tensor))
            else:
                yield tensor_name, tensor

    loaded = load_text(text())
    if encoder is None:
        return loaded
    return loaded | {f"{name}.{n}" for n in encoder.load_weights(held)}


def tower_target_name(ckpt_name: str, prefixes: tuple[str, ...], tower: str,
                      built_layers: int, total_layers: int) -> str | None:
    """A :func:`load_encoder_weights` ``target_name`` for a LLaVA-style checkpoint: a vision
    tower under ``tower`` (``"vision_tower."``, its HF ``vision_model.`` level dropped) and a
    projector, both under ``prefixes`` (HF's ``model.`` dropped). None for other names, for
    the tower's ``post_layernorm`` / ``head`` / ``embeddings.position_ids`` (never run), and
    for encoder layers ``built_layers..total_layers-1`` (past the deepest feature layer, not
    built)."""
    if not ckpt_name.startswith(prefixes):
        return None
    name = ckpt_name.removeprefix("model.")
    if not name.startswith(tower):
        return name
    rest = name.removeprefix(tower).removeprefix("vision_model.")
    if rest.startswith(("post_layernorm.", "head.")) or rest == "embeddings.position_ids":
        return None
    if rest.startswith("encoder.layers."):
        index = rest.split(".")[2]
        if index.isdigit() and built_layers <= int(index) < total_layers:
            return None  # (past the deepest feature layer: never run)
    return tower + rest


def load_encoder_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                         target_name: Callable[[str], str | None], what: str, *,
                         hint: str = "", buffers: bool = False,
                         convert: Callable[[str, torch.Tensor], torch.Tensor] | None = None
                         ) -> set[str]:
    """The loop of a vision (or audio) encoder's ``load_weights``: each checkpoint tensor whose
    ``target_name(checkpoint_name)`` is not None is copied into the parameter (``buffers``:
    or buffer) of that name in ``module``; names mapping to None are not the encoder's and are
    skipped. ``convert(name, tensor)`` may reshape a tensor first (a Conv3d patch weight into
    its linear layout). Returns the names loaded. ``ValueError`` naming the checkpoint tensor
    for a name that matches nothing in ``module`` (``what`` names the encoder, ``hint`` says
    which config field to check) or for a shape mismatch, raised before that tensor is
    copied."""
    targets: dict[str, torch.Tensor] = (dict(module.state_dict(keep_vars=True)) if buffers
                                        else dict(module.named_parameters()))
    kind = "parameter or buffer" if buffers else "parameter"
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = target_name(ckpt_name)
        if name is None:
            continue
        if name not in targets:
            extra = f" (check {hint})" if hint else ""
            raise ValueError(f"{ckpt_name}: no {kind} {name!r} in the {what}{extra}")
        target = targets[name]
        src = convert(name, tensor) if convert is not None else tensor
        if src.shape != target.shape:
            raise ValueError(f"{ckpt_name}: shape {tuple(src.shape)} != {kind} {name} shape "
                             f"{tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(src)
        loaded.add(name)
    return loaded


def under_prefixes(prefixes: tuple[str, ...], strip: str = "model.",
                   skip: Callable[[str], bool] | None = None) -> Callable[[str], str | None]:
    """A ``target_name`` for :func:`load_encoder_weights`: names under ``prefixes`` map to
    themselves less a leading ``strip`` (transformers 5's ``model.`` wrapper), others (and
    those ``skip`` accepts: unused heads, computed tables) to None."""
    def target(ckpt_name: str) -> str | None:
        if not ckpt_name.startswith(prefixes):
            return None
        name = ckpt_name.removeprefix(strip)
        return None if skip is not None and skip(name) else name
    return target
