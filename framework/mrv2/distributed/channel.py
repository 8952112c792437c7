"""How each step's scheduler output reaches the other ranks: one writer (rank 0), many readers.

- :class:`ShmRing` (one host): a byte ring in POSIX shared memory. The writer pickles the
  message and copies it in behind an 8-byte length; each reader copies it out and advances its
  own read position. No GPU work and no collective: publishing a decode step's output costs a
  pickle and a memcpy (tens of microseconds, see ``mrv2 bench tp-channel``), and a message
  larger than the ring (a step adding many long prompts) streams through it in pieces. Readers
  spin with ``sched_yield`` for :attr:`ShmRing.spin_s` after the last message (a GPU worker
  has a core to itself and spins 100 ms, so it never sleeps between steps; a CPU worker
  shares the cores with the model and spins 1 ms), then back off to sleeps of up to 1 ms.
- :class:`BroadcastChannel` (across hosts, under ``torchrun``): ``broadcast_object_list`` on the
  gloo group, a host-side broadcast.

Positions are monotonic int64 byte counts, each written by one process only (the writer's
``write_pos``, each reader's ``read_pos``), stored after the data they cover; the 8-byte
aligned stores and loads are single instructions on x86-64 and arm64.
"""

from __future__ import annotations

import os
import pickle
import struct
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from typing import Any

import torch.distributed as dist

_POS = struct.Struct("<q")
_LINE = 64  # one cache line per position: readers and the writer never share one
_MAX_SLEEP_S = 0.001


class ChannelClosed(RuntimeError):
    """The other side closed the channel or died."""


def _wait(ready: Callable[[], bool], alive: Callable[[], None] | None, spin_s: float) -> None:
    """Block until ``ready()``: spin (yielding the core) for ``spin_s``, then sleep in growing
    steps; ``alive()`` (raising when the peer is gone) runs every ~50 ms."""
    if ready():
        return
    start = last_check = time.monotonic()
    sleep = 1e-5
    while not ready():
        now = time.monotonic()
        if now - start < spin_s:
            os.sched_yield()
            continue
        if alive is not None and now - last_check > 0.05:
            alive()
            last_check = now
        time.sleep(sleep)
        sleep = min(sleep * 2, _MAX_SLEEP_S)


class ShmRing:
    """A single-writer, ``num_readers``-reader message ring in shared memory.

    The writer creates it (``ShmRing(num_readers, capacity)``) and passes :attr:`name` to the
    readers, who attach with ``ShmRing.attach(name, num_readers, capacity, reader)``.
    """

    def __init__(self, num_readers: int, capacity: int = 16 << 20, *, name: str | None = None,
                 reader: int | None = None, spin_s: float = 0.001) -> None:
        self.num_readers = num_readers
        #: How long a wait spins before it sleeps.
        self.spin_s = spin_s
        self.capacity = capacity
        self.reader = reader
        self._data = _LINE * (2 + num_readers)
        size = self._data + capacity
        if name is None:
            self._shm = shared_memory.SharedMemory(create=True, size=size)
            assert self._shm.buf is not None
            self._shm.buf[: self._data] = bytes(self._data)
        else:
            self._shm = shared_memory.SharedMemory(name=name)
            try:  # before Python 3.13 an attaching process's tracker would unlink it at exit
                from multiprocessing import resource_tracker

                resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
            except Exception:
                pass
        self.name = self._shm.name
        buf = self._shm.buf
        assert buf is not None
        self._buf: memoryview = buf
        self._mine = 0  # this side's position (a cache of what it last stored)
        self._owner = name is None

    @classmethod
    def attach(cls, name: str, num_readers: int, capacity: int, reader: int,
               spin_s: float = 0.001) -> ShmRing:
        """Open the writer's ring as reader ``reader`` (0-based)."""
        return cls(num_readers, capacity, name=name, reader=reader, spin_s=spin_s)

    # -- positions ---------------------------------------------------------------------------

    def _load(self, offset: int) -> int:
        return int(_POS.unpack_from(self._buf, offset)[0])

    def _store(self, offset: int, value: int) -> None:
        _POS.pack_into(self._buf, offset, value)

    def _write_pos(self) -> int:
        return self._load(0)

    def _read_pos(self, reader: int) -> int:
        return self._load(_LINE * (2 + reader))

    def closed(self) -> bool:
        """Whether the writer closed the ring."""
        return self._load(_LINE) != 0

    # -- writer ------------------------------------------------------------------------------

    def publish(self, obj: Any, alive: Callable[[], None] | None = None) -> None:
        """Send ``obj`` to every reader. Waits while a reader is a ring behind, calling
        ``alive()`` (which raises when a reader has died) every ~50 ms meanwhile."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._write(_POS.pack(len(payload)) + payload, alive)

    def _write(self, data: bytes, alive: Callable[[], None] | None) -> None:
        view = memoryview(data)
        while view:
            pos = self._mine

            def room(pos: int = pos) -> bool:
                slowest = min(self._read_pos(r) for r in range(self.num_readers))
                return pos - slowest < self.capacity

            _wait(room, alive, self.spin_s)
            slowest = min(self._read_pos(r) for r in range(self.num_readers))
            start = pos % self.capacity
            n = min(len(view), self.capacity - (pos - slowest), self.capacity - start)
            self._buf[self._data + start: self._data + start + n] = view[:n]
            self._mine = pos + n
            self._store(0, self._mine)
            view = view[n:]

    def close(self) -> None:
        """Writer: tell the readers to stop; both sides: release the mapping (the writer also
        removes the segment)."""
        if self._owner:
            self._store(_LINE, 1)
        self._buf.release()
        self._shm.close()
        if self._owner:
            self._shm.unlink()

    # -- reader ------------------------------------------------------------------------------

    def receive(self, alive: Callable[[], None] | None = None) -> Any:
        """The next message (blocking). Raises :class:`ChannelClosed` once the writer closed
        the ring; ``alive()`` runs every ~50 ms while waiting."""
        (length,) = _POS.unpack(self._read(_POS.size, alive))
        return pickle.loads(self._read(length, alive))

    def _read(self, length: int, alive: Callable[[], None] | None) -> bytes:
        assert self.reader is not None, "only a reader receives"
        out = bytearray(length)
        done = 0
        offset = _LINE * (2 + self.reader)
        while done < length:
            pos = self._mine

            def ready(pos: int = pos) -> bool:
                return self._write_pos() > pos or self.closed()

            _wait(ready, alive, self.spin_s)
            available = self._write_pos() - pos
            if available <= 0:
                raise ChannelClosed("the writer closed the channel")
            start = pos % self.capacity
            n = min(length - done, available, self.capacity - start)
            out[done: done + n] = self._buf[self._data + start: self._data + start + n]
            done += n
            self._mine = pos + n
            self._store(offset, self._mine)
        return bytes(out)


class BroadcastChannel:
    """Rank 0 broadcasts each message to the other ranks over a gloo group (multi-host)."""

    def __init__(self, group: Any, rank: int) -> None:
        self.group = group
        self.rank = rank

    def publish(self, obj: Any, alive: Callable[[], None] | None = None) -> None:
        """Rank 0: send ``obj`` to every rank."""
        dist.broadcast_object_list([obj], src=0, group=self.group)

    def receive(self, alive: Callable[[], None] | None = None) -> Any:
        """The other ranks: the next message."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def close(self) -> None:
        """Drop the group: once the group is destroyed nothing may hold it, or gloo's
        threads outlive it until the interpreter's exit, where destroying them aborts the
        process ("terminate called without an active exception", 1 run in 15-25 under
        torchrun on the CPU)."""
        self.group = None
