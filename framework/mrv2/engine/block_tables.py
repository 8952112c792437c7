"""A request's KV blocks in each of the model's block tables, over one block manager.

Most models have one block table: every layer keeps every token. A model whose sliding-window
or chunked-attention layers have tables of their own (:mod:`mrv2.runner.kv_tables`) has more,
each with a window (a sliding window of keys, an
:class:`~mrv2.contract.kv_cache.AttentionChunk`, or None: full attention). Every table of a
request is positional: entry ``i`` holds positions ``i * block_size`` to ``(i + 1) *
block_size - 1``, and all tables grow together. In a sliding or chunked table the entries
before what the next queries see (:func:`~mrv2.contract.kv_cache.first_visible`) stop being
held: :meth:`BlockTables.free_outside_windows`
returns them to the pool (cached first, where their tokens are known, so a later request with
the same prefix can still find them) and ``Request.held_from`` says where the held entries
start; the ids before it stay in the list (and in the runner's table), never read again.

Prefix caching keys a block by its chain hash and its table: a hit of ``L`` blocks needs every
full-attention table's blocks ``0 .. L - 1`` and each other table's blocks from what the first
position computed, ``L * block_size``, sees.
"""

from __future__ import annotations

from collections.abc import Sequence

from mrv2.contract.kv_cache import first_query_past, first_visible, most_blocks_held
from mrv2.engine.block_manager import BlockHash, BlockManager
from mrv2.engine.request import Request


def table_key(block_hash: BlockHash, table: int) -> BlockHash:
    """The prefix-cache key of a block of ``table`` (table 0: the chain hash itself)."""
    return block_hash if table == 0 else block_hash + bytes([table])


def window_start(position: int, window: int, block_size: int) -> int:
    """The first block a query at ``position`` reads in a table of ``window``."""
    return first_visible(position, window) // block_size


class BlockTables:
    """The block tables of every request, windows ``windows`` (table 0 first), over
    ``blocks``. ``margin``: tokens a step's result may take back from a request's computed
    count (its drafts), kept in the window when freeing."""

    def __init__(self, blocks: BlockManager, windows: Sequence[int | None] = (None,),
                 margin: int = 0) -> None:
        if not windows:
            raise ValueError("a model has at least one block table")
        self.blocks = blocks
        self.windows = tuple(windows)
        self.num_tables = len(self.windows)
        self.margin = margin
        #: Whether some table frees blocks that fall out of its window.
        self.frees = any(w is not None for w in self.windows)
        #: Blocks freed so far because they fell out of a window (sliding or chunked).
        self.num_freed = 0

    def tables(self, request: Request) -> list[list[int]]:
        """The request's block ids in each table, table 0 (``block_ids``) first."""
        return [request.block_ids, *request.extra_block_ids]

    def _held_from(self, request: Request, table: int) -> int:
        return request.held_from[table] if request.held_from else 0

    def blocks_needed(self, num_tokens: int, num_held: int) -> int:
        """Blocks to allocate, over all tables, for a request whose tables have ``num_held``
        entries each to store ``num_tokens``."""
        return self.blocks.blocks_needed(num_tokens, num_held) * self.num_tables

    def allocate(self, request: Request, num_tokens: int) -> list[list[int]]:
        """Extend every table to ``num_tokens``; the new ids of each (empty: none needed).
        The caller checked :meth:`blocks_needed` against the free blocks."""
        per_table = self.blocks.blocks_needed(num_tokens, len(request.block_ids))
        if not per_table:
            return []
        new = [self.blocks.allocate(per_table) for _ in range(self.num_tables)]
        for ids, more in zip(self.tables(request), new, strict=True):
            ids.extend(more)
        return new

    def most_held(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks, over all tables, a request of ``num_tokens`` tokens ever holds at
        once when a step computes at most ``max_step_tokens`` of its tokens: a sliding
        table holds the window before a step's first query and the step's tokens."""
        return most_blocks_held(self.windows, self.blocks.block_size, num_tokens,
                                max_step_tokens, self.margin)

    def first_needed(self, window: int, position: int) -> int:
        """The first block a query at ``position`` (or up to :attr:`margin` before it) may
        read in a table of ``window``."""
        return window_start(position - self.margin, window, self.blocks.block_size)

    def may_free(self, request: Request) -> bool:
        """Whether :meth:`free_outside_windows` would free a block of the request now (one
        comparison: the scheduler asks for every running request every step)."""
        return self.frees and request.num_computed_tokens >= request.free_at

    def _update_free_at(self, request: Request) -> None:
        """The computed count at which the next block falls out of a window."""
        size = self.blocks.block_size
        request.free_at = min(
            first_query_past((self._held_from(request, t) + 1) * size, window) + self.margin
            for t, window in enumerate(self.windows) if window is not None)

    def free_outside_windows(self, request: Request) -> int:
        """Free the request's blocks its next queries (from its computed count on) can no
        longer see, in every sliding or chunked table; returns how many. Register them in the prefix
        cache first (the scheduler's ``_cache_blocks``)."""
        freed = 0
        tables = self.tables(request)
        for t, window in enumerate(self.windows):
            if window is None:
                continue
            ids = tables[t]
            start = self._held_from(request, t)
            end = min(self.first_needed(window, request.num_computed_tokens), len(ids))
            if end > start:
                if not request.held_from:
                    request.held_from = [0] * self.num_tables
                self.blocks.free(ids[start:end])
                request.held_from[t] = end
                freed += end - start
        self.num_freed += freed
        if self.frees:
            self._update_free_at(request)
        return freed

    def release(self, request: Request) -> None:
        """Free every block the request holds, in every table, and empty its tables."""
        for t, ids in enumerate(self.tables(request)):
            self.blocks.free(ids[self._held_from(request, t):])
        request.block_ids = []
        request.extra_block_ids = [[] for _ in range(self.num_tables - 1)]
        request.held_from = []
        request.free_at = 0

    def cache(self, request: Request, index: int, block_hash: BlockHash) -> None:
        """Register block ``index`` of each of the request's tables (those it still holds)
        under ``block_hash``."""
        for t, ids in enumerate(self.tables(request)):
            if index >= self._held_from(request, t):
                self.blocks.cache_block(ids[index], table_key(block_hash, t))

    # -- prefix caching ----------------------------------------------------------------------

    def find_prefix(self, hashes: Sequence[BlockHash]) -> tuple[list[list[int]], list[int]]:
        """The longest cached prefix of ``hashes`` every table can serve: each table's block
        ids (another table's entries before what it sees: 0, not held) and where each
        table's held entries start. Not yet referenced: see :meth:`take`."""
        lookup = self.blocks.cached_block
        found: dict[int, list[int | None]] = {}
        length = len(hashes)
        for t, window in enumerate(self.windows):
            if window is None:  # every block from the first: the cached chain
                chain = self.blocks.find_cached_prefix([table_key(h, t) for h in hashes])
                found[t] = list(chain)
                length = min(length, len(chain))
        for t, window in enumerate(self.windows):
            if window is not None:
                found[t] = [lookup(table_key(hashes[i], t)) for i in range(length)]
        runs = {t: _runs(found[t]) for t, window in enumerate(self.windows)
                if window is not None}
        size = self.blocks.block_size

        def served(length: int) -> bool:  # each other table holds what position length sees
            return all(runs[t][length - 1] >= length - window_start(length * size, window, size)
                       for t, window in enumerate(self.windows) if window is not None)

        while length > 0 and not served(length):
            length -= 1
        tables: list[list[int]] = []
        held_from: list[int] = []
        for t, window in enumerate(self.windows):
            start = 0 if window is None else window_start(length * size, window, size)
            tables.append([0] * start + [b if b is not None else 0
                                         for b in found[t][start:length]])
            held_from.append(start)
        return tables, held_from

    def held_hits(self, tables: list[list[int]], held_from: list[int]) -> list[int]:
        """The block ids a hit of :meth:`find_prefix` holds, over all tables."""
        return [b for t, ids in enumerate(tables) for b in ids[held_from[t]:]]

    def take(self, request: Request, tables: list[list[int]], held_from: list[int],
             num_tokens: int) -> None:
        """Give the request the hit's blocks (referenced now) and fresh ones up to
        ``num_tokens`` in every table (the caller checked that they are free)."""
        self.blocks.take_cached(self.held_hits(tables, held_from))  # before allocating
        request.block_ids = list(tables[0])
        request.extra_block_ids = [list(ids) for ids in tables[1:]]
        request.held_from = list(held_from) if any(held_from) else []
        if self.frees:
            self._update_free_at(request)
        self.allocate(request, num_tokens)


def _runs(ids: list[int | None]) -> list[int]:
    """For each index, how many entries up to it (it included) are found in a row."""
    runs, n = [], 0
    for block in ids:
        n = n + 1 if block is not None else 0
        runs.append(n)
    return runs
