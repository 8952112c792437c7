"""Prefix caching for models with per-request state: snapshots of the state at block
boundaries, so a request whose prompt starts with a cached prefix resumes from it.

A cached KV block is not enough to skip a prefix when the model also keeps a recurrent state
(:mod:`mrv2.contract.request_state`): the state after the prefix is needed too. The engine
keeps ``num_slots`` extra state rows (*slots*, allocated beside the requests' rows), each
holding the state after some block boundary, found by that boundary's block chain hash (which
names every token before it, as the KV cache's). This module is the host's bookkeeping; the
kernels do the copies as they run (:data:`mrv2_kernels.linear_attention.STATE_TABLE_COLS`):
a chunk that covers a snapshot's position also stores the state there, and a request admitted
after a prefix hit reads its first chunk's initial state from the snapshot's slot.

Which boundaries are saved (at most two per admission, the kernels' limit): the *junction*,
the end of the longest run of cached KV blocks when the snapshot found is shorter (where this
prompt left the cached one: the next request sharing the same prefix resumes there), and the
prompt's last full block before its last token (a repeated prompt, or the next turn of a
conversation, resumes there). A prefix hit is cut to the deepest boundary that has a snapshot.

A slot is *reserved* from admission until the step that computes its position is scheduled,
then *published*, findable from the next step on: the step's kernels write it before any
later step reads it (one stream), while an admission of the same step would read it in the
very launch that stores it (a race on the GPU). Published slots are evicted least recently
used first; a slot read or written by the step being scheduled is not evicted in it (two
requests of one step would store into the same slot).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from mrv2.engine.block_manager import BlockHash

__all__ = ["StateSave", "StateSnapshots"]

#: Snapshots one admission may plan (the kernels' table has two).
MAX_SAVES = 2


@dataclass
class StateSave:
    """A snapshot a running request is to store: after ``position`` tokens, into ``slot``,
    findable under ``block_hash`` once the step computing the position is scheduled."""

    position: int
    slot: int
    block_hash: BlockHash
    published: bool = False
    stale: bool = False
    """The request kept running through a weight update: its state is the old weights', so
    the snapshot is never published (its slot stays reserved until the request stops)."""


class StateSnapshots:
    """The slots' host state: which block hash each published slot saves, which are reserved,
    which are free.

    ``num_slots``: slots (state rows past the requests'); ``block_size``: the KV cache's."""

    def __init__(self, num_slots: int, block_size: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.block_size = block_size
        self._published: OrderedDict[BlockHash, int] = OrderedDict()  # LRU order
        self._hash_of: dict[int, BlockHash] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._reserved: set[int] = set()
        self._read_now: set[int] = set()
        self._written_now: set[int] = set()  # published by the step being scheduled
        self._free_next: list[int] = []  # written by the step being scheduled, free after it
        #: Snapshots published, prefix hits served by a snapshot, and evictions, since start.
        self.num_saved = self.num_resumed = self.num_evicted = 0

    @property
    def num_published(self) -> int:
        """Slots holding a findable snapshot."""
        return len(self._published)

    def begin_step(self) -> None:
        """A new step is being scheduled: last step's reads and writes no longer pin their
        slots (its writes become findable), and slots it wrote only as duplicates are free."""
        self._read_now.clear()
        self._written_now.clear()
        self._free.extend(self._free_next)
        self._free_next.clear()

    def deepest(self, hashes: Sequence[BlockHash]) -> tuple[int, int | None]:
        """``(j, slot)``: the most leading blocks of ``hashes`` (the blocks a prompt found
        cached) whose end has a snapshot written by an earlier step, and its slot (pinned for
        this step; the least recently used order refreshed); ``(0, None)`` when none has."""
        for j in range(len(hashes), 0, -1):
            slot = self._published.get(hashes[j - 1])
            if slot is not None and slot not in self._written_now:
                self._published.move_to_end(hashes[j - 1])
                self._read_now.add(slot)
                return j, slot
        return 0, None

    def has(self, block_hash: BlockHash) -> bool:
        """Whether a snapshot of ``block_hash``'s boundary is published."""
        return block_hash in self._published

    def reserve(self) -> int | None:
        """A slot to write a new snapshot into: a free one, else the least recently used
        published slot neither read nor written by this step (evicted); None when every slot
        is busy."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._published.items()
                           if s not in self._read_now and s not in self._written_now), None)
            if victim is None:
                return None
            slot = self._published.pop(victim)
            del self._hash_of[slot]
            self.num_evicted += 1
        self._reserved.add(slot)
        return slot

    def publish(self, slot: int, block_hash: BlockHash) -> None:
        """The step just scheduled writes ``slot``: findable under ``block_hash`` from the next
        step on (a snapshot of the same boundary published meanwhile keeps its slot; this one
        is free after this step, which still writes it)."""
        self._reserved.remove(slot)
        if block_hash in self._published:
            self._free_next.append(slot)
            return
        self._published[block_hash] = slot
        self._hash_of[slot] = block_hash
        self._written_now.add(slot)
        self.num_saved += 1

    def unpublish(self, slot: int) -> None:
        """Take back a :meth:`publish` of this step (its tokens were unscheduled): reserved
        again."""
        block_hash = self._hash_of.pop(slot, None)
        self._written_now.discard(slot)
        if block_hash is not None:
            del self._published[block_hash]
            self.num_saved -= 1
        else:  # (it was a duplicate)
            self._free_next.remove(slot)
        self._reserved.add(slot)

    def release(self, slot: int) -> None:
        """Give back a reserved slot whose position was never computed."""
        self._reserved.remove(slot)
        self._free.append(slot)

    def reset(self) -> None:
        """Forget every published snapshot (reserved slots stay reserved)."""
        self._free.extend(self._published.values())
        self._published.clear()
        self._hash_of.clear()

    # -- a request's snapshots ----------------------------------------------------------------

    def plan(self, saves: list[StateSave], hashes: Sequence[BlockHash], num_tokens: int,
             num_hit: int, num_resumed: int, source: int | None
             ) -> tuple[int, int, int, int, int, int]:
        """At admission: the snapshots a request of ``num_tokens`` known tokens (``hashes``:
        its full blocks') stores, appended to ``saves``; ``num_hit`` blocks were cached, the
        request resumes after ``num_resumed`` of them from ``source`` (None: from the start).
        Returns its kernel table row in slot numbers (-1: none): ``(source, its position,
        position, slot, position, slot)``."""
        size = self.block_size
        if source is not None:
            self.num_resumed += 1
        ends = sorted({num_hit, (num_tokens - 1) // size})  # the junction, the prompt's end
        for end in ends:
            if len(saves) == MAX_SAVES:
                break
            if end <= num_resumed or end > len(hashes) or self.has(hashes[end - 1]):
                continue
            slot = self.reserve()
            if slot is None:
                break
            saves.append(StateSave(end * size, slot, hashes[end - 1]))
        row = [-1 if source is None else source, num_resumed * size if source is not None
               else -1, -1, -1, -1, -1]
        for i, save in enumerate(saves):
            row[2 + 2 * i], row[3 + 2 * i] = save.position, save.slot
        return (row[0], row[1], row[2], row[3], row[4], row[5])

    def publish_due(self, saves: list[StateSave], start: int, num_tokens: int
                    ) -> list[StateSave]:
        """A step computes the request's positions ``start + 1 .. start + num_tokens``: publish
        the snapshots it stores; returns them (for :meth:`unpublish_all`)."""
        due = [s for s in saves if not s.published and not s.stale
               and start < s.position <= start + num_tokens]
        for save in due:
            self.publish(save.slot, save.block_hash)
            save.published = True
        return due

    def unpublish_all(self, saves: list[StateSave]) -> None:
        """Take back this step's publications of these saves (their tokens unscheduled)."""
        for save in saves:
            self.unpublish(save.slot)
            save.published = False

    def release_all(self, saves: list[StateSave]) -> None:
        """The request stops (finished, preempted): give back the slots of the snapshots it
        did not reach; ``saves`` is emptied."""
        for save in saves:
            if not save.published:
                self.release(save.slot)
        saves.clear()
