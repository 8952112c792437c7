"""The server's stack sampler (``MRV2_SERVE_PROFILE``): a busy thread's functions and CPU
seconds, an idle thread's wait, the report file."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from mrv2.entrypoints.stack_sampler import StackSampler


def _spin_here(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(i * i for i in range(200))


def test_a_busy_and_an_idle_thread_show_where_they_are(tmp_path: Path) -> None:
    stop, idle = threading.Event(), threading.Event()
    busy = threading.Thread(target=_spin_here, args=(stop,), name="busy-one")
    waiter = threading.Thread(target=idle.wait, name="idle-one")
    sampler = StackSampler(interval=0.001)
    busy.start()
    waiter.start()
    sampler.start()
    time.sleep(0.6)
    sampler.stop()
    stop.set()
    idle.set()
    busy.join()
    waiter.join()
    report = sampler.report()
    sampler.write(tmp_path / "profile.txt")
    assert (tmp_path / "profile.txt").read_text() == report
    sections = {part.split(" ", 1)[0]: part for part in report.split("== thread ")[1:]}
    assert "_spin_here" in sections["busy-one"] and "_spin_here" not in sections["idle-one"]
    assert "Event.wait" in sections["idle-one"]
    assert sum(sampler.samples.values()) > 50
    if sys.platform.startswith("linux"):  # CPU seconds from /proc: the spinning thread's
        cpu = float(sections["busy-one"].split("CPU ", 1)[1].split(" s", 1)[0])
        assert cpu > 0.05


def test_a_bad_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="interval=0"):
        StackSampler(interval=0)
