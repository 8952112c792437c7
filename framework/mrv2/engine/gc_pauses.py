"""Python's garbage collector in a serving process: the startup heap frozen, the pauses counted.

After startup a serving process holds a few hundred thousand long-lived objects (torch,
transformers, the model's modules, the tokenizer, FastAPI). CPython's oldest-generation
collection walks all of them, ~0.1-0.2 s in which the engine's loop or the server's event loop
stands still and every stream stalls; a stream of tokens allocates enough survivors to start
one every few seconds. vLLM's API server and engine core freeze the startup heap for that
reason, and so do the processes here that live as long as their engine: the engine's child
process (:func:`~mrv2.entrypoints.engine_core.run_engine_core`) and ``mrv2 serve``'s own
process (:func:`~mrv2.entrypoints.server_run.run_server`). ``gc.freeze()`` moves every object
alive now into a generation the collector never walks; objects made later are collected as
before. An offline ``LLM`` does not freeze: a test or a notebook may build many engines in one
process and count on the collector to free an old one's reference cycles (its KV cache).

``MRV2_GC_FREEZE=0`` turns the freeze off (for an A/B); :class:`GCPauses` counts what the
collector costs. ``MRV2_GC_GEN0_THRESHOLD=N`` sets the youngest generation's threshold in
those processes (allocations between young collections; Python's default is 700, 2,000 from
3.12): on the 2-core CPU, 256 streams, 20,000 cut the collector's time per round from
119-153 to 19-21 ms at equal throughput; not the default until an H200 A/B says so
(``gpu_session.sh gcgen0``).
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

from mrv2.config import positive_number_from_env

#: ``0`` keeps the startup heap in the collector's view (the freeze is on by default).
FREEZE_ENV_VAR = "MRV2_GC_FREEZE"


#: A positive integer: the youngest generation's threshold in serving processes (unset:
#: Python's own).
GEN0_ENV_VAR = "MRV2_GC_GEN0_THRESHOLD"


def gen0_threshold() -> int | None:
    """:data:`GEN0_ENV_VAR`'s value, or None when unset; ValueError naming the variable on
    anything but a positive integer."""
    value = positive_number_from_env(GEN0_ENV_VAR, int,
                                     "integer (allocations between young collections)")
    return None if value is None else int(value)


def freeze_startup_heap() -> bool:
    """Collect once, then take every object alive now out of the collector's view (unless
    ``MRV2_GC_FREEZE=0``), and set the youngest generation's threshold from
    :data:`GEN0_ENV_VAR` when given. Call it once the engine or server is built, before it
    serves; returns whether it froze."""
    threshold = gen0_threshold()
    if threshold is not None:
        gc.set_threshold(threshold, *gc.get_threshold()[1:])
    if os.environ.get(FREEZE_ENV_VAR, "1").strip() == "0":
        return False
    gc.collect()
    gc.freeze()
    return True


class GCPauses:
    """The collector's pauses in this process, by generation, from the moment it is made
    until :meth:`close` (a ``gc.callbacks`` entry; about a microsecond a collection)."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = 0.0
        self._began: float | None = None
        gc.callbacks.append(self._on_collect)

    def _on_collect(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        if self._began is None:
            return
        took = time.perf_counter() - self._began
        self._began = None
        generation = min(int(info.get("generation", 2)), 2)
        self.counts[generation] += 1
        self.seconds[generation] += took
        self.longest = max(self.longest, took)

    @property
    def total_seconds(self) -> float:
        """Every collection's time so far."""
        return sum(self.seconds)

    def summary(self) -> dict[str, Any]:
        """Collections and milliseconds by generation, and the longest pause (ms)."""
        return {"collections": list(self.counts),
                "ms": [round(s * 1e3, 2) for s in self.seconds],
                "longest_ms": round(self.longest * 1e3, 2)}

    def close(self) -> None:
        """Stop counting (idempotent)."""
        if self._on_collect in gc.callbacks:
            gc.callbacks.remove(self._on_collect)
