"""Per-phase link bytes and device-memory utilisation (minioffload/course/instrument.py)."""

from types import SimpleNamespace

import pytest

from minioffload.course.instrument import device_memory_series, link_bytes_by_phase, utilisation_by_phase
from minioffload.predict.memory import Ledger
from minioffload.trace import Trace


def test_a_copy_straddling_two_phases_is_split_by_its_time_in_each():
    trace = Trace(origin=0.0)
    trace.record("h2d", "weights", 1.0, 3.0, 400)  # half in forward, half in backward
    trace.record("d2h", "grad", 2.5, 2.5, 10)  # instantaneous: counted where it happens
    trace.record("compute", "forward", 0.0, 2.0, 999)  # not a link lane
    moved = link_bytes_by_phase(trace, {"forward": (0.0, 2.0), "backward": (2.0, 4.0)})
    assert moved == {"forward": {"h2d": 200.0, "d2h": 0.0}, "backward": {"h2d": 200.0, "d2h": 10.0}}
    with pytest.raises(ValueError, match="start <= end"):
        link_bytes_by_phase(trace, {"update": (3.0, 1.0)})


def test_utilisation_is_time_weighted_on_the_trace_clock():
    now = [0.0]
    ledger = Ledger({"device": 1000}, clock=lambda: now[0])
    dev = SimpleNamespace(ledger=ledger, trace=Trace(origin=-10.0))  # the trace started 10 s before the ledger
    now[0] = 1.0
    ledger.allocate("weights", "device", 500)
    now[0] = 3.0
    ledger.free("weights")
    seconds, used = device_memory_series(dev)
    assert list(seconds) == [11.0, 11.0, 13.0] and list(used) == [0, 500, 0]  # from the first event
    shares = utilisation_by_phase(dev, {"before": (10.0, 12.0), "after": (12.0, 14.0), "late": (13.0, 15.0)})
    assert shares["before"] == pytest.approx({"mean": 0.25, "peak": 0.5})
    assert shares["after"] == pytest.approx({"mean": 0.25, "peak": 0.5})
    assert shares["late"] == pytest.approx({"mean": 0.0, "peak": 0.0})
