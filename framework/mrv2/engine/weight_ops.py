"""What an idle engine does with its weights and device memory between uses (an RL loop's
rollouts): load new weights in place (given here, read from disk, or broadcast by a trainer in
other processes), load the checkpoint's again, run a function on every rank
(``collective_rpc``), and sleep mode (vLLM's ``sleep`` / ``wake_up``: the device memory given
back while a trainer uses the GPU). :class:`~mrv2.engine.engine.LLMEngine` inherits these."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from mrv2.runner.sleep import check_level, check_tags

if TYPE_CHECKING:
    from mrv2.config import EngineConfig
    from mrv2.engine.block_manager import BlockManager
    from mrv2.engine.in_flight import InFlight

__all__ = ["PAUSE_MODES", "WeightOps"]

#: What :meth:`WeightOps.pause_generation` does with the running requests' KV cache.
PAUSE_MODES = ("keep", "recompute", "abort", "wait")

logger = logging.getLogger(__name__)


class WeightOps:
    """:class:`~mrv2.engine.engine.LLMEngine`'s weight and memory operations (a mixin: the
    engine gives the attributes below)."""

    config: EngineConfig
    runner: Any
    block_manager: BlockManager
    #: Parameters discarded by ``sleep(level=2)`` and not loaded since (requests refused
    #: until a load: :meth:`update_weights`, :meth:`reload_weights`).
    _discarded: set[str] | None = None

    scheduler: Any
    _flight: InFlight
    _held: list[Any]
    #: Set by :meth:`pause_generation`: the engine takes no step until continued.
    _paused: bool = False
    #: ``pause_generation("wait")``: no new request starts; paused once none is left.
    _draining: bool = False

    def has_unfinished(self) -> bool:  # (the engine's)
        raise NotImplementedError

    def _process_steps(self, outputs: list[Any], keep: int = 0) -> None:  # (the engine's)
        raise NotImplementedError

    def _check_open(self) -> None:  # (the engine's)
        raise NotImplementedError

    def _check_idle(self, what: str) -> None:
        """RuntimeError unless no step can run: no request in flight, or paused."""
        self._check_open()
        if self.has_unfinished() and not self._paused:
            raise RuntimeError(f"{what} needs an idle engine: requests are in flight "
                               "(or pause_generation() first)")

    def _check_loadable(self, what: str) -> None:
        """ValueError where weights cannot be loaded in place: an fp8 model (quantized at
        load). Integer models (GPTQ, AWQ, compressed-tensors, MXFP4) take the checkpoint's
        packed tensors again (``mrv2.model_loader.build.reloading``)."""
        from mrv2.layers.fp8 import fp8_config_of

        hf_config, requested = self.runner.hf_config, self.config.model.quantization
        if fp8_config_of(hf_config, requested) is not None:
            raise ValueError(f"{what}: not for an fp8 model (its weights are quantized at "
                             "load)")

    def _check_load(self, what: str) -> None:
        """Before weights load in place: the engine idle (or paused), no fp8 model, its
        weights awake."""
        self._check_idle(what)
        self._check_loadable(what)
        if "weights" in self.runner.asleep:
            raise RuntimeError(f"{what}: the weights are asleep: "
                               "wake_up(tags=['weights']) first")

    def _check_awake(self) -> None:
        """RuntimeError while anything sleeps, or while weights discarded by
        ``sleep(level=2)`` wait to be loaded."""
        asleep = self.runner.asleep
        if asleep:
            raise RuntimeError(f"the engine is asleep ({', '.join(asleep)}): wake_up() first")
        if self._discarded is not None:
            raise RuntimeError("the weights were discarded by sleep(level=2): load them with "
                               "update_weights() or reload_weights() first")

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``(name, tensor)`` pairs, named as in the checkpoint, into the served model in
        place (an RL trainer's new policy, as TRL and verl hand vLLM theirs), then forget the
        prefix cache (its KV is the old weights'). The CUDA graphs replay the new values.
        The engine must be idle, its weights awake (:meth:`wake_up`); an fp8 model refuses
        (its weights are quantized at load). Under tensor parallelism rank 0 broadcasts each
        whole tensor and every rank loads its part, as at start-up. Modules whose weights
        changed rerun their ``process_weights_after_loading`` (in place: the graphs read the
        same memory); give a module's tensors together. Returns the parameter names loaded; a
        name the model does not have is a ValueError. A list or tuple is checked whole
        first, so a bad name or shape changes no weight; an iterator (a trainer's tensors
        gathered one at a time) is loaded as it comes, and one refused midway leaves those
        before it loaded. After ``sleep(level=2)`` this is the load the engine waits for (a
        warning names parameters it did not cover)."""
        self._check_load("update_weights")
        if isinstance(weights, list | tuple):
            self.runner.check_weights(weights)
        return self._loaded(self.runner.load_weights(weights))  # (every rank's)

    def update_weights_from_disk(self, model_dir: str) -> set[str]:
        """:meth:`update_weights` of the safetensors checkpoint in ``model_dir`` (SGLang's
        ``/update_weights_from_disk``), every tensor's name and shape checked before any is
        loaded: a checkpoint of another model changes nothing. FileNotFoundError without
        safetensors files."""
        from mrv2.model_loader.loader import iter_safetensors

        self._check_load("update_weights_from_disk")
        self.runner.check_weights(iter_safetensors(model_dir))  # (memory-mapped views)
        return self._loaded(self.runner.load_weights(iter_safetensors(model_dir)))

    def _loaded(self, loaded: set[str]) -> set[str]:
        """After a load: forget the prefix cache (its KV is the old weights'); after
        ``sleep(level=2)``, stop waiting (a warning names parameters the load missed)."""
        self._forget_cached()
        if self._discarded is not None:
            missing = self._discarded - loaded
            if missing:
                logger.warning("weights loaded after sleep(level=2): %d parameters were not "
                               "loaded and hold zeros (%s...)", len(missing),
                               ", ".join(sorted(missing)[:3]))
            self._discarded = None
        return loaded

    def collective_rpc(self, method: str | Callable[..., Any], args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run ``method`` on every rank's runner, between steps, and return each rank's
        result, rank 0's first (vLLM's ``collective_rpc``): a public method of the runner by
        name, or a picklable function called as ``method(runner, *args, **kwargs)``. The
        escape hatch of RL frameworks: what they run there is theirs to keep consistent."""
        self._check_open()
        return list(self.runner.collective_rpc(method, tuple(args), kwargs))

    def init_weights_update_group(self, master_address: str, master_port: int,
                                  rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group",
                                  backend: str = "nccl", timeout_s: float = 600.0) -> None:
        """Join a trainer's process group for new weights (SGLang's name;
        :mod:`mrv2.distributed.weight_sync`): the trainer's rank 0 serves it at
        ``master_address:master_port`` and calls ``trainer_group`` (or its own equivalent)
        at the same time; engine rank ``r`` joins as ``rank_offset + r``. Returns once every
        member joined. ValueError naming a bad field."""
        from mrv2.distributed.weight_sync import GroupSpec, join

        self._check_open()
        spec = GroupSpec(master_address, master_port, rank_offset, world_size, group_name,
                         backend, timeout_s).check(self.config.parallel.tensor_parallel_size)
        self.runner.collective_rpc(join, (spec,))

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any],
                                        shapes: list[list[int]],
                                        group_name: str = "weight_update_group") -> set[str]:
        """Receive new weights from the trainer's rank 0 over the group
        :meth:`init_weights_update_group` joined (SGLang's name): it broadcasts each tensor,
        in the order of ``names`` (checkpoint names; ``dtypes`` as torch dtype names,
        ``"bfloat16"``; ``shapes``), and every rank loads its part, as
        :meth:`update_weights` does. Returns the parameter names loaded."""
        from mrv2.distributed.weight_sync import check_metas, receive

        self._check_load("update_weights_from_distributed")
        metas = check_metas(names, dtypes, shapes)
        loaded: set[str] = self.runner.collective_rpc(receive, (metas, group_name))[0]
        return self._loaded(loaded)

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> bool:
        """Leave the trainer's group on every rank; whether this engine had joined it."""
        from mrv2.distributed.weight_sync import leave

        self._check_open()
        return bool(self.runner.collective_rpc(leave, (group_name,))[0])

    def reload_weights(self) -> set[str]:
        """Load the served checkpoint's weights again from its directory
        (:meth:`update_weights` of its safetensors files): after ``sleep(level=2)``, or to
        undo an update."""
        from mrv2.model_loader.loader import iter_safetensors

        self._check_load("reload_weights")
        return self._loaded(self.runner.load_weights(iter_safetensors(self.runner.model_dir)))

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache's blocks (vLLM's name): False, and nothing done, while
        requests run or wait (their blocks are being registered) unless paused, else True."""
        if self.has_unfinished() and not self._paused:
            return False
        self._forget_cached()
        return True

    def _forget_cached(self) -> None:
        """The prefix cache's blocks and the per-request state's snapshots (a request kept
        running through it registers none of its blocks: :meth:`Scheduler.forget_cached`)."""
        self.scheduler.forget_cached()

    # -- sleep mode --------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Give the device memory back while the engine is idle (vLLM's sleep mode: an RL
        trainer uses the GPU between rollouts; :mod:`mrv2.runner.sleep`). Level 1 copies the
        weights to host memory and discards the KV cache and the CUDA graphs. Level 2 also
        discards the model's parameters, for a trainer that loads new ones after waking
        (:meth:`update_weights`, :meth:`reload_weights`): requests are refused until one
        has run. The prefix cache is forgotten. While asleep, requests are refused (a
        RuntimeError); :meth:`wake_up` brings everything back. ValueError for a ``level``
        other than 1 or 2; level 2 is refused where weights cannot be loaded in place (an
        fp8 model). Under tensor parallelism every rank sleeps and wakes."""
        check_level(level)
        self._check_idle("sleep")
        if level == 2:
            self._check_loadable("sleep(level=2)")
        self.scheduler.preempt_all()  # paused requests: their KV goes, they recompute it
        self.runner.sleep(level)
        self._forget_cached()  # (the blocks' contents are gone)
        if level == 2:
            self._discarded = {name for name, _ in self.runner.model.named_parameters()}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what :meth:`sleep` gave away: ``tags`` ``["weights"]``,
        ``["kv_cache"]`` or None (both). Waking the weights first lets a trainer load new ones
        (:meth:`update_weights`) before the KV cache takes its memory. Once both are back the
        CUDA graphs are captured again (a few seconds). ValueError for an unknown tag; if
        the device has no room, the error is raised and the tag stays asleep."""
        self._check_open()
        self.runner.wake_up(list(check_tags(tags)))

    # -- pausing -----------------------------------------------------------------------------

    def pause_generation(self, mode: str = "keep") -> None:
        """Stop generating (SGLang's ``pause_generation`` and vLLM's ``pause``, for weights
        updated mid-rollout): the steps already launched finish (their outputs come with the
        next :meth:`step`), then no step runs until :meth:`continue_generation`; new requests
        wait. Meanwhile the weight operations run (:meth:`update_weights`,
        :meth:`update_weights_from_distributed`, :meth:`sleep`...). ``mode``:

        - ``"keep"`` (SGLang's ``in_place``): running requests keep their KV cache and go on
          from it (the tokens after an update come from the new weights, the cache before it
          from the old);
        - ``"recompute"`` (``retract``): they give their KV blocks back and recompute prompt
          and output so far when generation continues;
        - ``"abort"`` (vLLM's default): every request ends now, its output finished with
          ``finish_reason="abort"``;
        - ``"wait"`` (vLLM's ``wait_for_inflight_requests``): no new request starts, the
          started ones run to their end, and only then is the engine paused
          (:meth:`is_paused`; the server's ``/pause`` waits for it).

        Sleeping while paused recomputes the running requests (the cache is discarded).
        ValueError naming ``mode``."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        self._check_open()
        if mode == "wait":
            self.scheduler.admitting = False
            self._draining = True
            self._drain_if_done()
            return
        self._process_steps(self._held)
        if mode == "recompute":
            self.scheduler.preempt_all()
        elif mode == "abort":
            self._held.extend(self._abort_all())
        if not self.has_unfinished():  # (the last requests ended in those steps: rows too)
            self.runner.remove_requests(self.scheduler.take_finished_ids())
        self._paused = True

    def _drain_if_done(self) -> None:
        """While draining (``pause_generation("wait")``): pause once no started request is
        left (their last steps processed)."""
        if not self._draining or self.scheduler.num_started:
            return
        self._process_steps(self._held)
        self._draining, self._paused = False, True

    def _abort_all(self) -> list[Any]:
        """End every request now (``pause_generation("abort")``): each one's output,
        finished with ``finish_reason="abort"`` (an ``n > 1`` request's merged)."""
        ended = []
        for tracked in self._flight.remove_all():
            self.scheduler.finish(tracked.request, "abort")
            if tracked.detokenizer is not None:
                tracked.detokenizer.flush()
            ended.append(tracked.output())
        if not self.has_unfinished():
            self.runner.remove_requests(self.scheduler.take_finished_ids())
        merged = [self._flight.fanout.merge(o) for o in ended]
        return [o for o in merged if o is not None]

    def continue_generation(self) -> None:
        """Take steps again after :meth:`pause_generation` (nothing if not paused). Asleep,
        or after ``sleep(level=2)`` until new weights are loaded, the requests still wait."""
        self._check_open()
        self._paused = self._draining = False
        self.scheduler.admitting = True

    def is_paused(self) -> bool:
        """Whether :meth:`pause_generation` holds the engine."""
        return self._paused

    def is_draining(self) -> bool:
        """Whether ``pause_generation("wait")`` waits for the started requests' end (False
        once paused, or once :meth:`continue_generation` called the pause off)."""
        return self._draining

    def is_sleeping(self) -> bool:
        """Whether anything is asleep (:meth:`sleep`, until :meth:`wake_up` of every tag)."""
        return bool(self.runner.asleep)
