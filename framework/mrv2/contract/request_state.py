"""Per-request state of fixed size: what linear-attention and state-space layers keep between
steps instead of (or beside) a KV cache.

A layer whose token mixer is recurrent (Gated DeltaNet in Qwen3-Next, a Mamba-2 mixer) keeps,
per request, a few tensors whose size does not grow with the sequence: a short convolution's
last inputs and the recurrent state matrix. Such a layer subclasses :class:`RequestStateLayer`
and declares them (:meth:`RequestStateLayer.request_state_shapes`); the default
:class:`~mrv2.contract.model_state.ModelState` allocates each as ``[rows, *shape]`` (``rows``:
the state table's, ``scheduler.max_num_seqs``) when it is built, before the KV cache is sized,
so the KV budget is what is left after them. A request's state lives at its state-table row;
during a forward the layer reads the rows of the step's requests from
:attr:`~mrv2.contract.forward_context.ForwardContext.state_rows` and the sequences from the
attention metadata (``query_start_loc``, ``seq_lens``): a chunk that starts at position 0
begins from a zero state whatever the row holds (a new request, a row reused, a preempted
request computed again), a later chunk continues from the row.

Prefix caching needs the state after the cached prefix as well as its KV: the model state
allocates :func:`snapshot_slots` more rows (*slots*) after the requests' ones, where the kernels
store snapshots of the state at block boundaries as they pass them and from which a request
resuming after a cached prefix reads its first chunk's state; which boundaries, and which slot
holds which, is the engine's :mod:`mrv2.engine.state_snapshots`. The kernels learn it per
request row from :attr:`~mrv2.contract.forward_context.ForwardContext.state_table` (layout:
:data:`mrv2_kernels.linear_attention.STATE_TABLE_COLS`), which a layer passes on as it is.

Speculative decoding (:func:`state_row_slots`): a verify step runs a request's ``1 + k`` tokens
through the recurrence, and drafts it rejects must leave no trace. Each request then owns ``1 +
k`` consecutive rows (row ``r``'s are ``r * (1 + k) + j``; the snapshot slots follow all of
them), the kernels keep the state after each of a chunk's last ``1 + k`` tokens, the state after
``c`` tokens in the request's row ``c % (1 + k)``, and a chunk reads the one of its start: the
next step starts at the accepted count the device computed, so it reads the state after the
last accepted token with no host sync and nothing recomputed (``row_slots`` in
:mod:`mrv2_kernels.linear_attention`). A layer passes
:attr:`~mrv2.contract.forward_context.ForwardContext.state_row_slots` on as it is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch
from torch import nn

from mrv2.contract.forward_context import get_forward_context

__all__ = ["RequestStateLayer", "StepStates", "allocate_request_states", "request_state_layers",
           "snapshot_slots", "state_row_slots"]

#: ``cache.state_snapshot_slots``'s default bound.
DEFAULT_SNAPSHOT_SLOTS = 64

StateShapes = dict[str, tuple[tuple[int, ...], torch.dtype | None]]
"""``{name: (per-request shape, dtype)}``; dtype None: the model's."""


class StepStates(NamedTuple):
    """A forward's view of its step's per-request states: what every state kernel of
    :mod:`mrv2_kernels.recurrent_state`'s contract takes (:meth:`RequestStateLayer.step_states`).
    ``query_start_loc`` ``[n + 1]``, ``seq_lens`` ``[n]`` and ``rows`` ``[n]`` of the step's
    ``n`` requests (device tensors); ``state_table`` (prefix caching's snapshots, or None) and
    ``row_slots`` (speculative decoding's rows per request) passed on as they are;
    ``max_query_len`` the step's longest chunk (a bound: a graph's padded token count)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    rows: torch.Tensor
    state_table: torch.Tensor | None
    row_slots: int
    max_query_len: int


class RequestStateLayer(nn.Module):
    """Base of a module that keeps fixed-size state per request across steps.

    Subclasses implement :meth:`request_state_shapes`; after the model state allocated them,
    :attr:`request_states` holds ``{name: tensor [rows, *shape]}`` (zeroed once; a chunk at
    position 0 must not read its row). The tensors stay put for the engine's life, so a
    captured CUDA graph reads and writes the same memory at every replay."""

    request_states: dict[str, torch.Tensor]

    def request_state_shapes(self) -> StateShapes:
        """``{name: (shape of one request's tensor, dtype or None for the model's)}``."""
        raise NotImplementedError(f"{type(self).__name__} must implement request_state_shapes()")

    def step_states(self) -> StepStates:
        """The running forward's :class:`StepStates`; a ``RuntimeError`` naming the layer
        outside a forward of a model with per-request state (no ``state_rows``)."""
        ctx = get_forward_context()
        if ctx.state_rows is None:
            raise RuntimeError(f"{type(self).__name__} needs the forward context's state_rows "
                               f"(set by the runner for a model with per-request state)")
        md = ctx.metadata
        n = md.num_reqs
        return StepStates(md.query_start_loc[: n + 1], md.seq_lens[:n], ctx.state_rows[:n],
                          ctx.state_table, ctx.state_row_slots, md.max_query_len)


def request_state_layers(model: nn.Module) -> list[RequestStateLayer]:
    """Every :class:`RequestStateLayer` of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, RequestStateLayer)]


def allocate_request_states(layers: Iterable[RequestStateLayer], rows: int,
                            dtype: torch.dtype, device: torch.device, rows_doc: str = "") -> int:
    """Give each layer its zeroed ``[rows, *shape]`` tensors (``dtype``: the model's, for
    shapes that name none); returns the bytes allocated. ``ValueError`` for a non-positive
    dimension, naming the layer and the tensor, and (on a GPU) for tensors that would not fit
    in 90% of its free memory, naming what sets ``rows`` (``rows_doc``) before allocating."""
    layers = list(layers)
    shapes = []
    for layer in layers:
        for name, (shape, own) in layer.request_state_shapes().items():
            if not shape or min(shape) < 1:
                raise ValueError(f"{type(layer).__name__}.request_state_shapes(): {name!r} has "
                                 f"shape {shape}; every dimension must be >= 1")
            shapes.append((layer, name, shape, own or dtype))
    total = rows * sum(math.prod(shape) * t.itemsize for _, _, shape, t in shapes)
    if device.type == "cuda" and shapes:
        free = torch.cuda.mem_get_info(device)[0]
        if total > 0.9 * free:
            raise ValueError(
                f"the per-request state needs {total / (1 << 30):.2f} GiB ({rows} rows"
                f"{': ' + rows_doc if rows_doc else ''}) and {free / (1 << 30):.2f} GiB are "
                "free: lower scheduler.max_num_seqs, speculative.num_speculative_tokens or "
                "cache.state_snapshot_slots")
    for layer in layers:
        layer.request_states = {
            name: torch.zeros((rows, *shape), dtype=t, device=device)
            for owner, name, shape, t in shapes if owner is layer}
    return total


def snapshot_slots(config: Any) -> int:
    """The state rows kept for prefix caching's snapshots past the requests' rows
    (``config``: the engine's): ``cache.state_snapshot_slots``, by default ``min(64,
    max_num_seqs)``; 0 without prefix caching."""
    cache = config.cache
    if not cache.enable_prefix_caching:
        return 0
    if cache.state_snapshot_slots is not None:
        return int(cache.state_snapshot_slots)
    return min(DEFAULT_SNAPSHOT_SLOTS, int(config.scheduler.max_num_seqs))


def state_row_slots(config: Any) -> int:
    """The state rows each request owns (``config``: the engine's): ``1 +
    num_speculative_tokens`` with speculative decoding (the states after each token of a
    verify step's query, so the accepted count's can be kept), else 1."""
    spec = config.speculative
    return 1 + int(spec.num_speculative_tokens) if spec.method is not None else 1


def describe(layers: list[RequestStateLayer], rows: int, nbytes: int) -> dict[str, Any]:
    """Start-up facts of the request states (logged by the runner)."""
    return {"request_state_layers": len(layers), "request_state_rows": rows,
            "request_state_bytes": nbytes}
