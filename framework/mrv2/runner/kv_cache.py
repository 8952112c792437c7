"""KV cache groups, sizing and allocation, from the specs the model's ModelState declares.

Layers of equal :class:`~mrv2.contract.kv_cache.KVCacheSpec` form a group with one attention
backend (registered for the spec's kind). Block ids come from one pool, sized once for all
groups. With one block table (the usual case) every layer has a tensor of its own and one block
costs the sum of every layer's bytes per block; with sliding-window tables
(:mod:`mrv2.runner.kv_tables`) layers of different tables share tensors (through pages where
their layouts differ) and a block costs one table's layers. ``max_model_len="auto"`` then
takes the longest length one request of which the pool holds (:func:`fit_max_model_len`).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any, cast

import torch

from mrv2.config import CacheConfig, EngineConfig
from mrv2.contract.kv_cache import (
    KVCacheGroup,
    KVCacheSpec,
    PagedKVSpec,
    group_specs,
    longest_fitting,
    most_blocks_held,
    shared_pages,
)
from mrv2.registry import Registries
from mrv2.runner.kv_tables import KVTableLayout, layout_of
from mrv2_kernels.kv_cache import FP8_KV_DTYPE

#: ``cache.kv_cache_dtype`` values that mean a float8 e4m3 cache.
FP8_NAMES = ("fp8", "fp8_e4m3")

_GIB = 1 << 30


class KVCaches:
    """The groups of a model's cache layers, their backends and (once sized) their tensors."""

    def __init__(
        self, specs: dict[int, KVCacheSpec], registries: Registries, device: torch.device,
        backend_name: str | None, kv_cache_dtype: str = "auto", allow_empty: bool = False,
        owner: str | None = None,
    ) -> None:
        """``owner``: the plugin that registered the model, whose own backend for a cache kind
        serves it before another's (:meth:`~mrv2.registry.Registries.attention_backend_for`)."""
        if not specs and not allow_empty:
            raise ValueError("the model declares no KV cache layer (no KVCacheLayer modules)")
        if sorted(specs) != list(range(len(specs))):
            raise ValueError(f"KV cache layers must be numbered 0..N-1; got {sorted(specs)}")
        self.specs = specs
        self.groups: list[KVCacheGroup] = []
        self.backends: list[Any] = [None] * len(specs)
        by_name: dict[str, Any] = {}
        for spec, layers in group_specs(specs):
            entry = registries.attention_backend_for(device.type, spec.kind, backend_name,
                                                     owner)
            if entry.name not in by_name:
                by_name[entry.name] = entry.load()()
            self.groups.append(KVCacheGroup(spec, layers, entry.name))
            for layer_idx in layers:
                self.backends[layer_idx] = by_name[entry.name]
        if backend_name is not None and backend_name not in by_name:
            kinds = ", ".join(sorted({g.spec.kind for g in self.groups}))
            raise ValueError(
                f"attention backend {backend_name!r} serves none of this model's KV cache "
                f"kinds ({kinds})"
            )
        #: The cache element type when it is not the model's (``kv_cache_dtype``).
        self.kv_dtype: torch.dtype | None = None
        if kv_cache_dtype in FP8_NAMES:
            refused = sorted({f"{g.backend!r} (KV kind {g.spec.kind!r})" for g in self.groups
                              if not getattr(self.backends[g.layer_indices[0]], "fp8_kv_cache",
                                             False)})
            if refused:
                raise ValueError(
                    f"cache.kv_cache_dtype={kv_cache_dtype!r} is not supported by the attention "
                    f"backend {', '.join(refused)} of this model; allowed here: 'auto'"
                )
            self.kv_dtype = FP8_KV_DTYPE
        elif kv_cache_dtype != "auto":
            raise ValueError(f"cache.kv_cache_dtype must be one of 'auto', 'fp8', 'fp8_e4m3'; "
                             f"got {kv_cache_dtype!r}")
        self.tensors: list[torch.Tensor] = []
        #: Which block table each layer reads and which tensor it uses (set by the runner
        #: before sizing: :func:`~mrv2.runner.kv_tables.plan_tables`); one table by default.
        self.layout = KVTableLayout.single(len(specs))

    def _slot_layers(self) -> list[list[int]]:
        """The layers of each tensor slot (of one layout, or paged keys and values of
        several: :func:`~mrv2.contract.kv_cache.shared_pages`)."""
        slots: dict[int, list[int]] = {}
        for layer_idx, slot in enumerate(self.layout.layer_slots):
            slots.setdefault(slot, []).append(layer_idx)
        return [slots[j] for j in range(len(slots))]

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The caches' element type for a model of ``model_dtype``."""
        return self.kv_dtype or model_dtype

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        """Device bytes of one block id across every tensor (``dtype``: the model's)."""
        dtype = self.dtype(dtype)
        return sum(max(self.specs[i].bytes_per_block(block_size, dtype) for i in layers)
                   for layers in self._slot_layers())

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """One tensor per slot, in the layout of its spec (``dtype``: the model's), or, for a
        slot of paged keys and values of several layouts, one buffer of pages viewed in each;
        :attr:`tensors` gives each layer its slot's."""
        dtype = self.dtype(dtype)
        tensors: list[torch.Tensor] = [torch.empty(0)] * len(self.specs)
        for layers in self._slot_layers():
            layouts = list(dict.fromkeys(layout_of(self.specs[i]) for i in layers))
            if len(layouts) == 1:
                views = [layouts[0].allocate(num_blocks, block_size, dtype, device)]
            else:  # (plan_tables pages paged KV only)
                views = shared_pages(cast(list[PagedKVSpec], layouts), num_blocks, block_size,
                                     dtype, device)
            for i in layers:
                tensors[i] = views[layouts.index(layout_of(self.specs[i]))]
        self.tensors = tensors

    def release(self) -> None:
        """Drop the tensors (after the profiling forward)."""
        self.tensors = []


def num_blocks_for(
    cache: CacheConfig, per_block: int, device: torch.device, peak_bytes: int = 0
) -> int:
    """How many blocks of ``per_block`` bytes fit: the override, else ``kv_cache_memory_bytes``
    (on any device), else the CPU budget, else device memory left.

    On CUDA: ``gpu_memory_utilization`` of total memory, less what is in use now (weights,
    other processes) and less the profiling forward's activation peak ``peak_bytes``.
    """
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    parts = ""
    if cache.kv_cache_memory_bytes is not None:  # (vLLM's: the size asked, not checked)
        budget = cache.kv_cache_memory_bytes
    elif device.type == "cpu":
        budget = int(cache.cpu_kv_cache_gb * _GIB)
    else:
        # An engine of this process that nobody references any more (a test's, a notebook's
        # earlier one) may wait in a reference cycle, its KV cache counted as in use; and
        # blocks the caching allocator keeps free count as in use too.
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free
        budget = int(total * cache.gpu_memory_utilization) - in_use - peak_bytes
        parts = (f" = {cache.gpu_memory_utilization} x {total / _GIB:.1f} GiB - "
                 f"{in_use / _GIB:.2f} GiB in use - {peak_bytes / _GIB:.2f} GiB activation peak")
    blocks = budget // per_block
    if blocks < 1:
        raise RuntimeError(
            f"no memory left for the KV cache (budget {budget / _GIB:.2f} GiB{parts}; one block "
            f"{per_block} bytes): raise {kv_budget_knob(cache, device)} or lower "
            "max_num_batched_tokens")
    return int(blocks)


def kv_budget_knob(cache: CacheConfig, device: torch.device) -> str:
    """The setting that sized the KV cache (what an error tells the user to raise)."""
    if cache.num_gpu_blocks_override is not None:
        return "num_gpu_blocks_override"
    if cache.kv_cache_memory_bytes is not None:
        return "kv_cache_memory_bytes"
    return "cpu_kv_cache_gb" if device.type == "cpu" else "gpu_memory_utilization"


def fit_max_model_len(config: EngineConfig, num_blocks: int, block_size: int,
                      windows: Sequence[int | None], num_speculative_tokens: int,
                      num_lookahead_tokens: int, bound: int, device: torch.device) -> int:
    """``max_model_len="auto"`` (vLLM's): the longest length, at most ``bound``, one request
    of which a pool of ``num_blocks`` holds, counted as the scheduler counts it
    (:func:`~mrv2.contract.kv_cache.longest_fitting` over block tables of ``windows``, the
    token budget and the drafter's lookahead; its drafts kept in a window), so the engine's
    start-up check (``Scheduler.check_capacity``) passes. ValueError naming the setting that
    sized the pool where not even one token fits."""
    step = config.scheduler.max_num_batched_tokens + num_lookahead_tokens
    fit = longest_fitting(num_blocks, windows, block_size, step, num_speculative_tokens, bound)
    if fit < 1:
        knob = kv_budget_knob(config.cache, device)
        needed = most_blocks_held(windows, block_size, 1, step, num_speculative_tokens)
        raise ValueError(
            f"max_model_len='auto': the KV cache holds {num_blocks} blocks, but a request of "
            f"one token needs {needed} (one in each of the model's {len(windows)} block "
            f"tables): not even one token fits. Raise {knob}")
    return fit
