"""InFlight, alone: which request an id names while steps are in flight (async scheduling:
a step launched before a request ended may hold its token after a new request took its id),
the ids an ``n > 1`` request holds, and aborts."""

from __future__ import annotations

from typing import cast

import pytest

from mrv2.contract.params import SamplingParams
from mrv2.engine.in_flight import InFlight
from mrv2.engine.request import Request
from mrv2.engine.sampling_outputs import TrackedRequest
from mrv2.runner.async_output import AsyncStepOutput


def _step() -> AsyncStepOutput:
    return cast(AsyncStepOutput, object())  # (only its identity is read)


def _add(flight: InFlight, req_id: str) -> TrackedRequest:
    request = Request(req_id, [1, 2], SamplingParams(), 0, frozenset(), 4)
    tracked = TrackedRequest(request, None, None)
    flight.requests[req_id] = tracked
    return tracked


def test_a_reused_id_reads_only_the_steps_after_its_old_requests_last() -> None:
    """An id ended while steps were in flight: the steps up to the newest of them hold the
    ended request's results (``live`` None while one of them is processed); a new request
    of the id reads only later steps, and once that newest step is processed the id is the
    new request's alone."""
    flight = InFlight()
    old = _add(flight, "x")
    first, second = _step(), _step()
    flight.steps.extend([first, second])
    assert flight.live("x") is old and flight.steps_of("x") == [first, second]
    assert flight.remove("x") is old and flight.ended == {"x": second}
    new = _add(flight, "x")
    third = _step()
    flight.steps.append(third)
    assert flight.live("x") is None  # (first, then second: their token is old's)
    assert flight.steps_of("x") == [third]
    flight.processed(flight.steps.popleft())
    assert flight.ended == {"x": second}
    flight.processed(flight.steps.popleft())
    assert flight.ended == {} and flight.live("x") is new
    assert flight.steps_of("x") == [third]


def test_an_id_ended_with_no_step_in_flight_is_free_at_once() -> None:
    flight = InFlight()
    _add(flight, "x")
    flight.remove("x")
    assert flight.ended == {} and flight.ids_in_use("x", 1) == []
    assert flight.remove("x") is None  # (an unknown id)


def test_a_parent_holds_its_samples_ids_and_a_sample_its_parents() -> None:
    flight = InFlight()
    flight.fanout.add("p", 2, stream=False)
    _add(flight, "p#n0")
    _add(flight, "p#n1")
    assert flight.ids_in_use("p", 1) == ["p"]
    assert flight.is_sample("p#n1") and not flight.is_sample("p")
    flight.remove("p#n0")  # (finished: its output waits to be merged into p's)
    assert flight.ids_in_use("p#n0", 1) == ["p#n0"]
    _add(flight, "q#n1")  # a caller's own id, shaped like a sample's
    assert flight.ids_in_use("q", 2) == ["q#n1"]
    with pytest.raises(ValueError, match=r"'q' is already in use \(by its samples' ids "
                                         r"\['q#n1'\]\)"):
        flight.check_free("q", 2)
    with pytest.raises(ValueError, match=r"'p' is already in use$"):
        flight.check_free("p", 1)
    flight.check_free("q", 1)


def test_new_ids_skip_the_ids_callers_took() -> None:
    flight = InFlight()
    _add(flight, "0")
    _add(flight, "2#n1")
    assert flight.new_id(1) == "1"
    assert flight.new_id(2) == "3"  # ("2" is free, but not its sample "2#n1")
    assert flight.new_id(1) == "4"


def test_abort_removes_a_parents_samples_or_one_sample() -> None:
    """An abort of a parent removes its samples and forgets the parent; of one sample, that
    sample alone (still its parent's); ended ids are recorded as :meth:`remove`'s."""
    flight = InFlight()
    flight.fanout.add("p", 2, stream=False)
    samples = [_add(flight, "p#n0"), _add(flight, "p#n1")]
    step = _step()
    flight.steps.append(step)
    assert flight.remove_for_abort("p#n1") == samples[1:]
    assert flight.is_sample("p#n1") and list(flight.requests) == ["p#n0"]
    assert flight.remove_for_abort("p") == samples[:1]
    assert not flight.requests and not flight.fanout.parents
    assert flight.ended == {"p#n0": step, "p#n1": step}
    assert flight.remove_for_abort("p") == []
    others = [_add(flight, "a"), _add(flight, "b")]
    assert flight.remove_all() == others and not flight.requests
    flight.clear_steps()
    assert not flight.steps and not flight.ended
