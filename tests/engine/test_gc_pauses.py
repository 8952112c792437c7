"""The garbage collector in a serving process: the startup heap frozen, the pauses counted."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from mrv2.engine.gc_pauses import FREEZE_ENV_VAR, GCPauses, freeze_startup_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """Leave the test process as it was: a frozen heap would keep later tests' engines (their
    reference cycles) alive."""
    assert gc.get_freeze_count() == 0
    yield
    gc.unfreeze()


def test_freeze_takes_the_heap_alive_now_out_of_the_collectors_view(unfrozen: None) -> None:
    assert freeze_startup_heap()
    frozen = gc.get_freeze_count()
    assert frozen > 1000  # (this process's modules, at least)
    made_later = [[i] for i in range(100)]
    gc.collect()
    # objects made later are not frozen (frozen ones may still die by refcount: a pytest-xdist
    # worker's I/O thread frees a few of its own, so the count may fall, never rise)
    assert gc.get_freeze_count() <= frozen
    assert gc.is_tracked(made_later[0])


def test_the_freeze_can_be_turned_off(unfrozen: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FREEZE_ENV_VAR, "0")
    assert not freeze_startup_heap()
    assert gc.get_freeze_count() == 0


def test_pauses_are_counted_by_generation_until_closed() -> None:
    pauses = GCPauses()
    try:
        for _ in range(3):
            gc.collect(2)
        gc.collect(0)
        summary = pauses.summary()
        assert summary["collections"][2] == 3
        assert summary["collections"][0] >= 1
        assert pauses.total_seconds > 0
        assert 0 < summary["longest_ms"] <= sum(summary["ms"])
    finally:
        pauses.close()
        pauses.close()  # idempotent
    assert pauses._on_collect not in gc.callbacks
    before = list(pauses.counts)
    gc.collect(2)
    assert pauses.counts == before


def test_the_young_threshold_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from mrv2.engine.gc_pauses import GEN0_ENV_VAR, gen0_threshold

    before = gc.get_threshold()
    monkeypatch.setenv(FREEZE_ENV_VAR, "0")  # (the threshold only)
    try:
        monkeypatch.delenv(GEN0_ENV_VAR, raising=False)
        assert gen0_threshold() is None
        freeze_startup_heap()
        assert gc.get_threshold() == before  # unset: Python's own
        monkeypatch.setenv(GEN0_ENV_VAR, "20000")
        freeze_startup_heap()
        assert gc.get_threshold() == (20000, *before[1:])
        for bad in ("0", "-5", "many", "1.5"):
            monkeypatch.setenv(GEN0_ENV_VAR, bad)
            with pytest.raises(ValueError, match=f"{GEN0_ENV_VAR}='{bad}': expected a "
                                                 "positive integer"):
                gen0_threshold()
    finally:
        gc.set_threshold(*before)
