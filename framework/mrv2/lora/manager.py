"""The runner's LoRA adapters: which adapter each device slot holds, each row's slot, and
each step's per-token slots.

A request with a :class:`~mrv2.contract.lora.LoRARequest` takes the slot already holding its
adapter, else a slot no live request uses, into which the adapter's weights are copied (from
an LRU of adapters read in host memory, ``max_cpu_loras``; pinned on CUDA, so the copy does
not wait for the device). Its row's slot goes to the device with the step's staged edits; a
step's per-token slots are gathered on the device from the rows (inside the CUDA graphs too),
so nothing per token is built on the host. The scheduler keeps at most ``max_loras`` adapters
live at once; a runner asked for more raises.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from mrv2.config import LoRAConfig
from mrv2.contract.batch import InputBatch
from mrv2.contract.lora import LoRARequest
from mrv2.contract.requests import NewRequest
from mrv2.contract.staged_edits import StagedEdits
from mrv2.distributed.parallel_state import tp_rank, tp_size
from mrv2.layers.weights import checkpoint_target
from mrv2.lora.adapter import AdapterWeights, read_adapter
from mrv2.lora.layers import (
    LoRALinearMixin,
    add_lora_slots,
    is_tower_module,
    shard_ids,
    target_names,
)

logger = logging.getLogger("mrv2.lora")

#: ``(layer, rank column, first output row, A part, B part)`` of one shard's weights.
_Part = tuple[LoRALinearMixin, int, int, torch.Tensor, torch.Tensor]


class LoRAManager:
    """Adapter slots of one model on one device (see the module's docstring)."""

    def __init__(self, config: LoRAConfig, model: torch.nn.Module, max_num_reqs: int,
                 max_num_tokens: int, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.layers = add_lora_slots(model, config.max_loras, config.max_lora_rank, dtype)
        self._targets = target_names(model)
        if not self.layers:
            raise ValueError(f"enable_lora: {type(model).__name__} has no linear layer "
                             f"adapters can target (named {sorted(self._targets)})")
        #: Device bytes of every slot of every layer (allocated before the KV cache is sized).
        self.slot_bytes = sum(t.numel() * t.element_size() for layer in self.layers.values()
                              for t in (layer.lora_a, layer.lora_b))
        if tp_rank() == 0:
            logger.info("LoRA: %d adapter slots of rank %d on %d layers: %.1f MiB",
                        config.max_loras, config.max_lora_rank, len(self.layers),
                        self.slot_bytes / (1 << 20))
        self._stacked = getattr(model, "stacked_params", ())
        self._rename: Callable[[str], str | None] = getattr(model, "rename", lambda n: n)
        self.row_slots = torch.full((max_num_reqs,), -1, dtype=torch.int32, device=device)
        self._token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int32,
                                       device=device)
        self._positions = torch.arange(max_num_tokens, dtype=torch.int32, device=device)
        #: The adapter id each slot holds (None: empty), and how many live rows use it.
        self.slot_ids: list[int | None] = [None] * config.max_loras
        self._slot_users = [0] * config.max_loras
        self._row_slot: dict[int, int] = {}
        #: Set by :meth:`forced` (graph capture): adapters' kernels on or off regardless.
        self.force: bool | None = None
        self._read: OrderedDict[int, list[_Part]] = OrderedDict()
        self._max_read = config.max_cpu_loras or config.max_loras
        #: Tensor parallelism: rank 0 keeps the adapters it read as read (:meth:`as_read`),
        #: for the other ranks, which use those (:meth:`give`) and never read the files
        #: themselves: read later, they could be gone or rewritten since rank 0 checked them.
        self._keep_read = tp_size() > 1 and tp_rank() == 0
        self._as_read: dict[int, AdapterWeights] = {}
        self._given: dict[int, list[_Part]] = {}
        # the server's event loop checks adapters while the engine thread loads them
        self._read_lock = threading.Lock()

    # -- adapters ------------------------------------------------------------------------------

    def check(self, lora: LoRARequest) -> None:
        """Read and check ``lora``'s adapter against this model (kept read for its requests):
        a ValueError names what does not fit."""
        self._parts(lora)

    def _parts(self, lora: LoRARequest) -> list[_Part]:
        with self._read_lock:
            return self._read_parts(lora)

    def as_read(self, lora: LoRARequest) -> AdapterWeights:
        """Rank 0: ``lora``'s adapter as read (and checked; read again if evicted)."""
        with self._read_lock:
            self._read_parts(lora)
            return self._as_read[lora.lora_int_id]

    def give(self, adapters: Sequence[tuple[LoRARequest, AdapterWeights]],
             forget: Sequence[int] = ()) -> None:
        """Another rank than 0: rank 0's adapters (:meth:`as_read`), used instead of reading
        their files; ``forget``: adapter ids rank 0 no longer keeps here."""
        with self._read_lock:
            for adapter_id in forget:
                self._given.pop(adapter_id, None)
            for lora, weights in adapters:
                self._given[lora.lora_int_id] = self._parts_of(lora, weights)

    def _read_parts(self, lora: LoRARequest) -> list[_Part]:
        given = self._given.get(lora.lora_int_id)
        if given is not None:
            return given
        parts = self._read.get(lora.lora_int_id)
        if parts is not None:
            self._read.move_to_end(lora.lora_int_id)
            return parts
        weights = read_adapter(lora.lora_path, self.config.max_lora_rank)
        parts = self._parts_of(lora, weights)
        self._read[lora.lora_int_id] = parts
        if self._keep_read:
            self._as_read[lora.lora_int_id] = weights
        while len(self._read) > self._max_read:
            self._as_read.pop(self._read.popitem(last=False)[0], None)
        return parts

    def _parts_of(self, lora: LoRARequest, weights: AdapterWeights) -> list[_Part]:
        """This rank's parts of the adapter ``weights``, checked against the model."""
        parts: list[_Part] = []
        pin = self.device.type == "cuda"
        tower = [m for m in weights.modules if is_tower_module(m)]
        if tower:  # as vLLM: adapters apply to the language model of a multimodal model
            logger.warning("LoRA adapter %r: %d modules of the vision tower (%s...) are "
                           "ignored: adapters apply to the language model", lora.lora_name,
                           len(tower), tower[0])
        for module, (a, b) in weights.modules.items():
            if module in tower:
                continue
            layer, module_shard = self._target(lora, module)
            a_part = layer.rank_a(a).to(self.dtype)  # (a fused module's shards share it)
            if pin:
                a_part = a_part.pin_memory()
            for shard, b_whole in _by_shard(lora, module, layer, module_shard, b):
                b_part = layer.rank_b(b_whole, shard).to(self.dtype)
                if layer.row_order is not None:  # rows the owner reorders after loading
                    b_part = _reordered(layer, b_part, shard)
                column, first_row = layer.shard_slice(shard)
                rows = layer.shard_rows(shard)[1] if shard is not None else layer.output_size
                if a_part.shape[1] != layer.input_size or b_part.shape[0] != rows:
                    raise ValueError(
                        f"LoRA adapter {lora.lora_name!r}: module {module!r} has lora_A "
                        f"{tuple(a.shape)} and lora_B {tuple(b.shape)}, which do not fit the "
                        f"model's layer (input {layer.input_size}, output {rows} on this rank)")
                if pin:
                    b_part = b_part.pin_memory()
                parts.append((layer, column, first_row, a_part, b_part))
        return parts

    def _target(self, lora: LoRARequest, module: str) -> tuple[LoRALinearMixin, Any]:
        """The layer (and its shard) an adapter's module name adapts."""
        target = checkpoint_target(f"{module}.weight", self._stacked, self._rename)
        name = target[0].removesuffix(".weight") if target is not None else module
        layer = self.layers.get(name)
        if layer is None or target is None:
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r}: module {module!r} is not an adaptable "
                f"layer of this model (adapters may target {', '.join(sorted(self._targets))} "
                "of the text model)")
        return layer, target[1]

    def _load(self, slot: int, parts: Sequence[_Part]) -> None:
        for layer in self.layers.values():
            layer.lora_a[slot].zero_()
            layer.lora_b[slot].zero_()
        for layer, column, first_row, a, b in parts:
            rank = a.shape[0]
            layer.lora_a[slot, column:column + rank].copy_(a, non_blocking=True)
            layer.lora_b[slot, first_row:first_row + b.shape[0],
                         column:column + rank].copy_(b, non_blocking=True)

    def check_requests(self, requests: Sequence[NewRequest]) -> None:
        """Before any row changes: every adapter read and fitting, and slots for them all."""
        requested = set()
        for request in requests:
            if request.lora_request is not None:
                self.check(request.lora_request)
                requested.add(request.lora_request.lora_int_id)
        new_ids = requested - set(self.slot_ids)
        idle = [s for s, users in enumerate(self._slot_users) if users == 0]
        free = sum(1 for s in idle if self.slot_ids[s] not in requested)
        if len(new_ids) > free:
            raise RuntimeError(
                f"the step's requests need {len(new_ids)} more LoRA slots, {free} are free "
                f"(max_loras={self.config.max_loras}: a scheduler keeps at most that many "
                "adapters live)")

    def _acquire(self, lora: LoRARequest, keep: set[int]) -> int:
        """``lora``'s slot (loaded into a free one if it has none, never one holding an
        adapter of ``keep``: the other adapters this step's requests need)."""
        if lora.lora_int_id in self.slot_ids:
            slot = self.slot_ids.index(lora.lora_int_id)
        else:
            free = [s for s, users in enumerate(self._slot_users)
                    if users == 0 and self.slot_ids[s] not in keep]
            if not free:
                raise RuntimeError(
                    f"LoRA adapter {lora.lora_name!r} needs a slot, but all max_loras="
                    f"{self.config.max_loras} hold adapters of live requests (a scheduler "
                    "keeps at most max_loras adapters live)")
            # an empty slot first, else the one loaded longest ago is as good as any
            slot = next((s for s in free if self.slot_ids[s] is None), free[0])
            self._load(slot, self._parts(lora))
            self.slot_ids[slot] = lora.lora_int_id
        self._slot_users[slot] += 1
        return slot

    # -- rows and steps ------------------------------------------------------------------------

    def add_requests(self, requests: Sequence[NewRequest], rows: Sequence[int],
                     staged: StagedEdits) -> None:
        """Give the new rows their adapters' slots (-1 for the base model), staged."""
        slots = []
        keep = {r.lora_request.lora_int_id for r in requests if r.lora_request is not None}
        for request, row in zip(requests, rows, strict=True):
            lora = request.lora_request
            slot = -1 if lora is None else self._acquire(lora, keep)
            if slot >= 0:
                self._row_slot[row] = slot
            slots.append(slot)
        if rows:
            staged.put(self.row_slots, (np.asarray(rows),), np.asarray(slots, dtype=np.int32))

    def remove_request(self, row: int) -> None:
        """A row left: its slot has one user less (the weights stay for the next request)."""
        slot = self._row_slot.pop(row, None)
        if slot is not None:
            self._slot_users[slot] -= 1

    @property
    def active(self) -> bool:
        """Whether a live request names an adapter: the forward then runs the adapters'
        kernels; without one it runs the plain layers (and the graphs captured so)."""
        return bool(self._row_slot)

    @contextlib.contextmanager
    def forced(self, on: bool) -> Iterator[None]:
        """Within: the forward runs the adapters' kernels (``on``) or not, whatever the live
        requests (the runner captures a graph set each way)."""
        self.force = on
        try:
            yield
        finally:
            self.force = None

    def forward_slots(self, batch: InputBatch) -> torch.Tensor | None:
        """The forward context's ``lora_slots`` for ``batch``: :meth:`token_slots` while
        adapters are :attr:`active` (or :meth:`forced` on), else None (the layers run
        plain)."""
        on = self.active if self.force is None else self.force
        return self.token_slots(batch) if on else None

    def token_slots(self, batch: InputBatch) -> torch.Tensor:
        """Each of the step's tokens' slot (``[max_num_tokens]``; its first
        ``num_tokens_padded`` entries are this step's, -1 for padding), on the device."""
        n, k = batch.num_tokens_padded, batch.num_reqs_padded
        out = self._token_slots
        if k == 0:
            out[:n].fill_(-1)
            return out
        ends = batch.query_start_loc[1:k + 1]
        request = torch.searchsorted(ends, self._positions[:n], right=True)
        rows = batch.idx_mapping[:k][request.clamp(max=k - 1)].long()
        out[:n] = torch.where(request < k, self.row_slots[rows], -1)
        return out


def _by_shard(lora: LoRARequest, module: str, layer: LoRALinearMixin, shard: Any,
              b: torch.Tensor) -> list[tuple[Any, torch.Tensor]]:
    """``b``'s rows by the shard of ``layer`` they adapt: all of them ``shard``'s, or, for an
    adapter of a module the model fuses that names it whole (Phi-3's ``qkv_proj``,
    ``gate_up_proj``), each shard's rows of the fused ``B`` (the shards share its ``A``); a
    ``shard`` that is a tuple of shard ids (a module of several of the layer's shards: Qwen3.5's
    ``in_proj_qkv``, shards ``(0, 1, 2)`` of ``in_proj_qkvz``) those shards' rows."""
    shards = shard_ids(layer)
    if isinstance(shard, tuple) and shard and all(s in shards for s in shard):
        whole = dict(zip(shards, layer.whole_shard_rows(), strict=True))
        shards, sizes = list(shard), [whole[s] for s in shard]
    elif shard is not None or shards == [None]:
        return [(shard, b)]
    else:
        sizes = layer.whole_shard_rows()
    if b.dim() != 2 or b.shape[0] != sum(sizes):
        raise ValueError(f"LoRA adapter {lora.lora_name!r}: module {module!r} has lora_B "
                         f"{tuple(b.shape)}; the model's fused layer has {sum(sizes)} output "
                         f"rows ({' + '.join(map(str, sizes))})")
    return list(zip(shards, b.split(sizes), strict=True))


def _reordered(layer: LoRALinearMixin, b: torch.Tensor, shard: Any) -> torch.Tensor:
    """``b`` (this rank's rows of ``shard``'s ``B``) reordered as ``layer.row_order`` reorders
    the weight's rows: over the layer's whole output, a fused layer's other shards zero (the
    order keeps each shard's rows in the shard). A ``b`` of the wrong size is left as it is,
    for the caller's check to name."""
    assert layer.row_order is not None
    if shard is None:
        return layer.row_order(b.clone())
    start, rows = layer.shard_rows(shard)
    if b.dim() != 2 or b.shape[0] != rows:
        return b
    whole = b.new_zeros(layer.output_size, b.shape[1])
    whole[start:start + rows] = b
    return layer.row_order(whole)[start:start + rows].clone()


def make_lora_manager(config: Any, model: torch.nn.Module, max_num_reqs: int,
                      max_num_tokens: int, device: torch.device, dtype: torch.dtype
                      ) -> LoRAManager | None:
    """The runner's :class:`LoRAManager` when ``config.lora.enable_lora``, else None."""
    if not config.lora.enable_lora:
        return None
    return LoRAManager(config.lora, model, max_num_reqs, max_num_tokens, device, dtype)
