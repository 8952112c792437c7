"""A sampling profiler for a running server: where each thread's time goes.

``mrv2 serve`` starts one when ``MRV2_SERVE_PROFILE=FILE`` is set and writes its report to
FILE when the server stops (an engine in a process of its own samples itself into
``FILE.engine``). Every ``interval`` seconds a daemon thread reads every other
thread's Python stack (``sys._current_frames``) and counts, per thread, each function on it
(inclusive) and the innermost one (self). A thread blocked in a C call (a queue wait, a
socket poll, a CUDA launch) shows at the Python line that made the call. The sampler needs the
GIL to take a sample, so the counts are the threads' positions at the moments the GIL changed
hands; beside them the report gives each thread's CPU seconds from ``/proc`` (Linux), which
are exact: the engine thread's and the event loop's CPU against the wall time say whether
the process is bound by one core. Taking a sample holds the GIL, so a server bound by the GIL
runs slower with it on: use it to see where time goes, not to time the server.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType

PROFILE_ENV_VAR = "MRV2_SERVE_PROFILE"


def _cpu_seconds(native_id: int | None) -> float | None:
    """User + system CPU seconds of one of this process's threads (None off Linux)."""
    if native_id is None:
        return None
    try:
        fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    # fields[0] is the state (field 3 of stat(5)); utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _where(frame: FrameType) -> str:
    code = frame.f_code
    parts = Path(code.co_filename).parts
    name = getattr(code, "co_qualname", code.co_name)  # (3.11+)
    return f"{'/'.join(parts[-2:])}:{name}"


class StackSampler:
    """Samples every thread's stack every ``interval`` seconds until :meth:`stop`."""

    def __init__(self, interval: float = 0.002, depth: int = 64) -> None:
        if not interval > 0:
            raise ValueError(f"interval={interval} is invalid: expected > 0 seconds")
        self.interval, self.depth = interval, depth
        self.samples: dict[int, int] = Counter()
        self.inclusive: dict[int, Counter[str]] = {}
        self.leaf: dict[int, Counter[str]] = {}
        self._names: dict[int, tuple[str, int | None]] = {}
        self._cpu0: dict[int, float | None] = {}
        #: The latest CPU reading of each thread (a thread that ends keeps its last one).
        self._cpu1: dict[int, float | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mrv2-stack-sampler",
                                        daemon=True)
        self._start = 0.0
        self.wall = 0.0

    def start(self) -> None:
        self._start = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        """Stop sampling; each thread's CPU seconds are read once more, so reports made after
        this say the same (a thread that has ended keeps its last reading)."""
        self._stop.set()
        self._thread.join()
        self.wall = time.monotonic() - self._start
        self._read_cpu()

    def _read_cpu(self) -> None:
        for ident, (_, native) in list(self._names.items()):
            cpu = _cpu_seconds(native)
            if cpu is not None:
                self._cpu1[ident] = cpu

    def _run(self) -> None:
        me = threading.get_ident()
        ticks = 0
        while not self._stop.wait(self.interval):
            ticks += 1
            if ticks % 50 == 0:  # /proc reads are slower than a sample: a few a second
                self._read_cpu()
            known = {t.ident: t for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                if ident not in self._names:
                    thread = known.get(ident)
                    native = thread.native_id if thread is not None else None
                    self._names[ident] = (thread.name if thread else str(ident), native)
                    self._cpu0[ident] = _cpu_seconds(native)
                self.samples[ident] += 1
                seen: set[str] = set()
                inclusive = self.inclusive.setdefault(ident, Counter())
                self.leaf.setdefault(ident, Counter())[_where(frame)] += 1
                f: FrameType | None = frame
                for _ in range(self.depth):
                    if f is None:
                        break
                    where = _where(f)
                    if where not in seen:
                        seen.add(where)
                        inclusive[where] += 1
                    f = f.f_back

    def report(self, top: int = 30) -> str:
        """Each thread's CPU seconds and samples, then its most frequent functions."""
        lines = [f"wall {self.wall:.2f} s, a sample every {self.interval * 1e3:g} ms"]
        order = sorted(self.samples, key=lambda i: -self.samples[i])
        for ident in order:
            name, native = self._names[ident]
            cpu0 = self._cpu0.get(ident)
            cpu1 = self._cpu1.get(ident)  # (read every 50 samples and at stop)
            cpu = "?" if cpu0 is None or cpu1 is None else f"{cpu1 - cpu0:.2f}"
            n = self.samples[ident]
            lines.append(f"\n== thread {name} (native {native}): CPU {cpu} s since its "
                         f"first sample, {n} samples")
            lines.append("  inclusive:")
            for where, count in self.inclusive[ident].most_common(top):
                lines.append(f"    {100 * count / n:5.1f}%  {where}")
            lines.append("  innermost:")
            for where, count in self.leaf[ident].most_common(top // 2):
                lines.append(f"    {100 * count / n:5.1f}%  {where}")
        return "\n".join(lines) + "\n"

    def write(self, path: str | Path) -> None:
        Path(path).write_text(self.report())
