"""The host side of prefix caching for per-request state (:mod:`mrv2.engine.state_snapshots`):
which snapshots an admission plans, when they become findable, which slot is evicted, and that
a slot read or written by the step being scheduled is never handed out in it."""

from __future__ import annotations

import pytest

from mrv2.engine.block_manager import hash_block
from mrv2.engine.state_snapshots import StateSave, StateSnapshots


def chain(tokens: list[int], size: int = 4) -> list[bytes]:
    hashes: list[bytes] = []
    for i in range(len(tokens) // size):
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * size:(i + 1) * size]))
    return hashes


A = chain(list(range(100, 124)))  # 6 blocks
B = chain(list(range(100, 112)) + list(range(7, 19)))  # shares A's first 3 blocks


def test_plan_saves_the_junction_and_the_prompt_end_then_publishes_when_computed() -> None:
    snaps = StateSnapshots(4, 4)
    saves: list[StateSave] = []
    # 23 known tokens (5 full blocks before the last token); 3 blocks were cached but no
    # snapshot: resume from the start, save after 12 (junction) and 20 (prompt end).
    row = snaps.plan(saves, A, 23, 3, 0, None)
    assert [s.position for s in saves] == [12, 20]
    assert row == (-1, -1, 12, saves[0].slot, 20, saves[1].slot)
    assert snaps.deepest(A[:5]) == (0, None)  # reserved, not findable yet
    assert snaps.publish_due(saves, 0, 8) == []
    due = snaps.publish_due(saves, 8, 8)  # positions 9..16
    assert [s.position for s in due] == [12]
    # the step being scheduled writes it: found from the next step on (a same-step admission
    # resuming there would read the slot in the very launch that stores it)
    assert snaps.deepest(A[:5]) == (0, None)
    snaps.begin_step()
    assert snaps.deepest(A[:5]) == (3, saves[0].slot)
    snaps.publish_due(saves, 16, 7)
    assert snaps.deepest(A[:5]) == (3, saves[0].slot)  # (the deeper one written now)
    snaps.begin_step()
    assert snaps.deepest(A[:5]) == (5, saves[1].slot)
    assert snaps.num_saved == 2
    # A prompt resuming at the deepest snapshot plans nothing at or before it.
    again: list[StateSave] = []
    row = snaps.plan(again, A, 23, 5, 5, saves[1].slot)
    assert again == [] and row == (saves[1].slot, 20, -1, -1, -1, -1)
    assert snaps.num_resumed == 1


def test_eviction_is_least_recently_used_and_spares_this_steps_reads() -> None:
    snaps = StateSnapshots(2, 4)
    s0, s1 = snaps.reserve(), snaps.reserve()
    assert s0 is not None and s1 is not None
    snaps.publish(s0, A[2])
    snaps.publish(s1, B[4])
    snaps.begin_step()
    assert snaps.deepest(A[:3]) == (3, s0)  # read now: s0 is pinned, and the most recent
    assert snaps.reserve() == s1  # the least recently used unpinned one
    assert snaps.num_evicted == 1 and not snaps.has(B[4])
    assert snaps.reserve() is None  # s0 read this step, s1 reserved
    snaps.begin_step()
    assert snaps.reserve() == s0  # next step: s0 is evictable


def test_duplicates_unpublish_release_and_reset() -> None:
    snaps = StateSnapshots(3, 4)
    first, second = snaps.reserve(), snaps.reserve()
    assert first is not None and second is not None
    snaps.publish(first, A[0])
    snaps.publish(second, A[0])  # the same boundary: the first stays, this one frees later
    assert snaps.deepest(A[:1]) == (0, None)  # (written by this step)
    third = snaps.reserve()
    assert third not in (first, second, None)  # (second: written by this step, not yet free)
    assert snaps.reserve() is None  # (first: written by this step, never evicted in it)
    snaps.begin_step()
    assert snaps.deepest(A[:1]) == (1, first)
    assert snaps.reserve() == second
    # A publication taken back (its tokens unscheduled) is reserved again, then released.
    saves = [StateSave(4, second, A[1])]
    assert snaps.publish_due(saves, 0, 4) == saves and snaps.has(A[1])
    snaps.unpublish_all(saves)
    assert not snaps.has(A[1]) and not saves[0].published
    snaps.release_all(saves)
    assert saves == []
    assert snaps.reserve() == second
    snaps.reset()
    assert snaps.deepest(A) == (0, None) and snaps.num_published == 0
    with pytest.raises(ValueError, match="num_slots must be >= 1"):
        StateSnapshots(0, 4)


def test_plan_stops_when_no_slot_is_free() -> None:
    snaps = StateSnapshots(1, 4)
    saves: list[StateSave] = []
    row = snaps.plan(saves, A, 23, 3, 0, None)
    assert [s.position for s in saves] == [12] and row[4:] == (-1, -1)
    assert snaps.plan([], B, 23, 3, 0, None) == (-1, -1, -1, -1, -1, -1)


def test_a_stale_save_is_never_published_and_its_slot_comes_back() -> None:
    """A request kept running through a weight update (``Scheduler.forget_cached``): its
    planned snapshot holds the old weights' state, so it is not published when computed; its
    slot is free again once the request stops."""
    snaps = StateSnapshots(1, 4)
    saves: list[StateSave] = []
    snaps.plan(saves, A, 23, 0, 0, None)
    assert [s.position for s in saves] == [20]
    snaps.reset()
    saves[0].stale = True
    assert snaps.publish_due(saves, 16, 7) == []
    snaps.begin_step()
    assert snaps.deepest(A[:5]) == (0, None) and snaps.num_published == 0
    snaps.release_all(saves)
    assert snaps.reserve() is not None
