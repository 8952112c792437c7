"""What a runner does between steps, on the engine's call: load new weights in place, sleep
mode (:mod:`mrv2.runner.sleep`) and ``collective_rpc``. :class:`~mrv2.runner.runner.Runner`
inherits these; a tensor-parallel runner sends each to its other ranks too."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from mrv2.contract.batch import InputBatch
from mrv2.model_loader.build import process_weights_after_loading, reloading
from mrv2.model_loader.loader import load_model_weights
from mrv2.runner.sleep import Sleeper

__all__ = ["BetweenSteps"]


class BetweenSteps:
    """:class:`~mrv2.runner.runner.Runner`'s operations between steps (a mixin: the runner
    gives the attributes below)."""

    model: torch.nn.Module
    model_state: Any
    speculator: Any
    kv: Any
    device: torch.device
    _sleeper: Sleeper
    _graph_capture: Callable[[InputBatch, Callable[[], Any]], object] | None

    def _drop_graphs(self) -> None:  # (the runner's)
        raise NotImplementedError

    def _capture_timed(self, capture: Callable[[InputBatch, Callable[[], Any]], object]
                       ) -> None:  # (the runner's)
        raise NotImplementedError

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run ``method`` on every rank's runner and return each rank's result, rank 0's
        first (vLLM's ``collective_rpc``): a method name of the runner, or a picklable
        function called as ``method(runner, *args, **kwargs)``. One rank here."""
        return [self.call_method(method, args, kwargs)]

    def call_method(self, method: str | Callable[..., Any], args: tuple[Any, ...] = (),
                    kwargs: dict[str, Any] | None = None) -> Any:
        """This rank's part of :meth:`collective_rpc`."""
        if isinstance(method, str):
            bound = getattr(self, method, None)
            if method.startswith("_") or not callable(bound):
                raise ValueError(f"method: the runner has no public method {method!r}")
            return bound(*args, **(kwargs or {}))
        return method(self, *args, **(kwargs or {}))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``(name, tensor)`` pairs, named as in the checkpoint, into the model in place,
        then rerun ``process_weights_after_loading`` of the modules they changed; returns the
        parameter names loaded (``LLMEngine.update_weights``; the CUDA graphs read the same
        memory). A name the model does not have is a ValueError."""
        with reloading(self.model) as reload:  # (integer layers: the checkpoint's names)
            with torch.no_grad():
                loaded = load_model_weights(self.model, weights, strict=False)
            process_weights_after_loading(self.model, changed=loaded)
            return reload.names(loaded)

    def check_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Run the model's loader over ``weights`` with every parameter (and persistent
        buffer) swapped for a meta tensor of its shape and dtype: a name the model does not
        have, or a tensor of the wrong shape, raises as :meth:`load_weights` would, but before
        any weight is written (none is: the copies land on the meta device;
        ``LLMEngine.update_weights`` of a list, a checkpoint directory's load)."""
        with torch.no_grad(), reloading(self.model), _meta_parameters(self.model):
            load_model_weights(self.model, weights, strict=False)

    # -- sleep mode --------------------------------------------------------------------------

    @property
    def asleep(self) -> tuple[str, ...]:
        """What is asleep (:meth:`sleep`): ``"weights"``, ``"kv_cache"``; empty when awake."""
        return self._sleeper.asleep

    def sleep(self, level: int = 1) -> None:
        """Give the device memory back while idle (:mod:`mrv2.runner.sleep`): the CUDA graphs
        dropped, the weights copied to host memory (at level 2 the model's parameters are
        discarded instead, to be loaded again after waking) and the KV cache (with any
        per-request state of linear-attention layers) discarded. No
        step runs until :meth:`wake_up` has woken everything. The caller forgets the KV
        cache's blocks (their contents are gone)."""
        self._sleeper.check(level)
        self._drop_graphs()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        # (per-request state sleeps with the KV cache: discarded, zeroed on waking; every
        # request was preempted, and prefix caching's snapshots are forgotten with the blocks)
        states = [t for layer in getattr(self.model_state, "request_state_layers", ())
                  for t in layer.request_states.values()]
        self._sleeper.sleep(level, (self.model, self.model_state, self.speculator),
                            self.model.parameters(), [*self.kv.tensors, *states])

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back ``tags`` (``"weights"``, ``"kv_cache"``; None: both): the kept weights
        copied back, the discarded memory zeroed. Once everything is awake, the CUDA graphs
        are captured again (the memory came back at other addresses). ValueError for an
        unknown tag; an out-of-memory error while the memory comes back leaves the tag
        asleep, to be woken again later; one while capturing leaves the runner awake without
        graphs (its steps run eager) and is raised."""
        was_asleep = self._sleeper.sleeping
        if not (self._sleeper.wake(tags) and was_asleep and self._graph_capture is not None):
            return
        try:
            self._capture_timed(self._graph_capture)
        except BaseException:  # awake all the same, without graphs: steps run eager
            self._drop_graphs()
            raise


@contextlib.contextmanager
def _meta_parameters(model: torch.nn.Module) -> Iterator[None]:
    """Every parameter of ``model`` replaced by a meta one of its shape and dtype, with its
    attributes (its ``weight_loader``...; a parameter shared by two modules stays one), and
    every persistent buffer likewise (a vision or audio encoder's loader may write those:
    ``buffers=True``), then the originals put back."""
    metas: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        for module in model.modules():
            stores: list[tuple[dict[str, Any], str, torch.Tensor | None]] = [
                (module._buffers, name, t) for name, t in module._buffers.items()
                if name not in module._non_persistent_buffers_set]  # (no computed tables)
            stores += [(module._parameters, name, t) for name, t in module._parameters.items()]
            for store, name, tensor in stores:
                if tensor is None:
                    continue
                meta = metas.get(id(tensor))
                if meta is None:
                    meta = torch.empty_like(tensor, device="meta")
                    if isinstance(tensor, torch.nn.Parameter):
                        meta = torch.nn.Parameter(meta, requires_grad=False)
                        meta.__dict__.update(tensor.__dict__)
                    metas[id(tensor)] = meta
                swapped.append((store, name, tensor))
                store[name] = meta
        yield
    finally:
        for store, name, tensor in swapped:
            store[name] = tensor
