"""Block tables of their own for sliding-window and chunked-attention layers, and the
tensors their layers share.

A layer that attends over its last ``W`` keys never reads a block again once the request's
queries have moved ``W`` tokens past it; one of chunked local attention (chunks of ``C``)
never again once its queries are in a later chunk. With one block table for every
layer such a block stays held as long as the request runs, because the full-attention layers
still need the same block id. Here, as in vLLM's hybrid KV cache manager, layers are split
into *tables*: the full-attention layers are table 0 and the sliding layers of each window
(the chunked layers of each chunk: :class:`~mrv2.contract.kv_cache.AttentionChunk`) are cut
into tables of as many layers as table 0 holds (every table of a model of such layers only,
when it has no full-attention layer). Each table has its own block ids, from one pool; a
request's blocks in another table that its next queries no longer see go back to the pool
(the scheduler frees them: :class:`mrv2.engine.block_tables.BlockTables`). Layer ``j`` of
every table reads and writes the same tensor (*slot* ``j``): the tables' block ids never
overlap, so a block id costs the bytes of one table's layers, not of the whole model.

gpt-oss-20b (12 full, 12 sliding layers of 128 keys) holds at ``max_model_len`` 131,072
8,192 + 9 blocks of 12 layers a request instead of 8,192 blocks of 24 layers: about half the
memory, twice the requests. A model of 12 full layers and 36 chunked ones (chunks of 8,192)
holds at 131,072 tokens 8,192 + 3 x 512 blocks of 12 layers instead of 8,192 of 48: 3.4x the
requests. Layers of different layouts (global layers of twice the sliding ones' head size,
other head counts) share a slot through pages (:func:`~mrv2.contract.kv_cache.shared_pages`): a
block id costs each slot's largest block, so a narrower layer leaves part of its page unused.
The layout is used only where it holds fewer bytes for a request of ``max_model_len`` than
one table (a last table of fewer layers, and pages, count in full), where layouts differ
only for paged keys and values, and for at most :data:`MAX_TABLES` tables.
``MRV2_SLIDING_KV_TABLES=0`` keeps one table for every layer.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mrv2.contract.attention import AttentionMetadata
from mrv2.contract.batch import InputBatch, InputBuffers
from mrv2.contract.kv_cache import AttentionChunk, KVCacheSpec, PagedKVSpec

#: ``0``: one block table for every layer (sliding-window blocks are kept, as before).
SLIDING_TABLES_ENV_VAR = "MRV2_SLIDING_KV_TABLES"
#: The element type the layout's byte comparisons assume (they are ratios: any one dtype).
_NOMINAL = torch.bfloat16
#: Most block tables a model gets (each costs a block-table row per request and a prep launch
#: per step); past it, one table.
MAX_TABLES = 16


@dataclass(frozen=True)
class KVTableLayout:
    """Which table each cache layer reads and which tensor (slot) it uses."""

    windows: tuple[int | None, ...]
    """Each table's window: a sliding window of keys, an
    :class:`~mrv2.contract.kv_cache.AttentionChunk`, or None (full attention). Table 0
    first."""
    layer_tables: tuple[int, ...]
    """The table of each cache layer, by ``layer_idx``."""
    layer_slots: tuple[int, ...]
    """The tensor of each cache layer, by ``layer_idx``: layers of one slot share it."""

    @property
    def num_tables(self) -> int:
        """Block tables per request."""
        return len(self.windows)

    @property
    def num_slots(self) -> int:
        """Cache tensors."""
        return max(self.layer_slots) + 1

    @classmethod
    def single(cls, num_layers: int) -> KVTableLayout:
        """One table for every layer, a tensor each."""
        return cls((None,), (0,) * num_layers, tuple(range(num_layers)))


def _window_of(spec: KVCacheSpec) -> int | None:
    return spec.window if isinstance(spec, PagedKVSpec) else None


def layout_of(spec: KVCacheSpec) -> KVCacheSpec:
    """``spec`` without its window or chunk: what its tensor's layout depends on (layers of
    equal layouts share a tensor as it is, others through pages)."""
    if isinstance(spec, PagedKVSpec) and spec.window is not None:
        return dataclasses.replace(spec, sliding_window=None, attention_chunk=None)
    return spec


def without_windows(specs: dict[int, KVCacheSpec]) -> dict[int, KVCacheSpec]:
    """``specs`` with every sliding window and chunk dropped: layers that must read table 0
    (a drafter's, whose metadata is built over table 0), still masked to their window or
    chunk by the attention call."""
    return {i: layout_of(spec) for i, spec in specs.items()}


def window_blocks(window: int, block_size: int) -> int:
    """The most blocks a request holds in a table of ``window`` at a decode step: the window's
    keys before the query, the query's block, one more where they straddle a boundary (a
    chunk of whole blocks never does)."""
    if isinstance(window, AttentionChunk) and window % block_size == 0:
        return window // block_size
    return -(-(window - 1) // block_size) + 1


def blocks_per_request(windows: Sequence[int | None], block_size: int, max_model_len: int
                       ) -> int:
    """Blocks a decoding request of ``max_model_len`` tokens holds over tables of
    ``windows``: every block of a full table, a window's in a sliding or chunked one."""
    per_table = -(-max_model_len // block_size)
    return sum(per_table if w is None else min(per_table, window_blocks(w, block_size))
               for w in windows)


def plan_tables(
    specs: dict[int, KVCacheSpec], block_size: int, max_model_len: int,
) -> KVTableLayout:
    """The layout for ``specs`` (see the module docstring); one table where it saves
    nothing or does not apply."""
    n = len(specs)
    single = KVTableLayout.single(n)
    windows = {i: _window_of(spec) for i, spec in specs.items()}
    if os.environ.get(SLIDING_TABLES_ENV_VAR, "1") == "0" or all(
            w is None for w in windows.values()):
        return single
    if len({layout_of(spec) for spec in specs.values()}) != 1 and not all(
            isinstance(spec, PagedKVSpec) for spec in specs.values()):
        return single  # layers of different layouts share tensors as paged KV only (pages)
    full = [i for i in sorted(specs) if windows[i] is None]
    by_window: dict[int, list[int]] = {}
    for i in sorted(specs):
        w = windows[i]
        if w is not None:
            by_window.setdefault(w, []).append(i)
    size = len(full) if full else min(len(layers) for layers in by_window.values())
    tables: list[tuple[int | None, list[int]]] = [(None, full)] if full else []
    for w, layers in by_window.items():
        tables += [(w, layers[j : j + size]) for j in range(0, len(layers), size)]
    if len(tables) > MAX_TABLES:
        return single
    # A block id costs every slot's page (its largest layer's block), whichever table holds it
    pages = [0] * size
    for _, layers in tables:
        for j, i in enumerate(layers):
            pages[j] = max(pages[j], specs[i].bytes_per_block(block_size, _NOMINAL))
    held = blocks_per_request([w for w, _ in tables], block_size, max_model_len)
    every = sum(spec.bytes_per_block(block_size, _NOMINAL) for spec in specs.values())
    if held * sum(pages) >= blocks_per_request([None], block_size, max_model_len) * every:
        return single  # (a short max_model_len, or a lone sliding layer padded to a table)
    layer_tables = [0] * n
    layer_slots = [0] * n
    for t, (_, layers) in enumerate(tables):
        for j, i in enumerate(layers):
            layer_tables[i], layer_slots[i] = t, j
    return KVTableLayout(tuple(w for w, _ in tables), tuple(layer_tables), tuple(layer_slots))


def table_metadata(metadata: AttentionMetadata, batch: InputBatch) -> list[AttentionMetadata]:
    """``metadata`` (table 0's) and each other table's: the same but for its block table and
    slot mapping (each a metadata object of its own, so backends' derived values are per
    table)."""
    return [metadata] + [dataclasses.replace(metadata, block_table=block_table,
                                             slot_mapping=slots)
                         for block_table, slots in batch.table_inputs]


def with_dummy_tables(batch: InputBatch, buffers: InputBuffers) -> InputBatch:
    """A dummy batch (:meth:`~mrv2.contract.model_state.ModelState.prepare_dummy_inputs`)
    with the other block tables' buffers made harmless the same way: block 0, no KV
    written."""
    if len(buffers.block_tables) == 1:
        return batch
    rows, tokens = batch.num_reqs_padded, batch.num_tokens_padded
    inputs = []
    for block_table, slots in zip(buffers.block_tables[1:], buffers.slot_mappings[1:],
                                  strict=True):
        block_table[:rows].zero_()
        slots[:tokens].fill_(-1)
        inputs.append((block_table[:rows], slots[:tokens]))
    return dataclasses.replace(batch, table_inputs=tuple(inputs))
