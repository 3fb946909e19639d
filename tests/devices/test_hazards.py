"""The strict sim's hazard checker: each rule catches its planted hazard, naming streams, tensor and fix, and the
correct version of the same code passes (the whole suite runs strict, so the runtime's own code is checked too)."""

import threading

import pytest
import torch

from minioffload.devices import Link, device, pipeline
from minioffload.devices import sim as sim_module
from minioffload.devices.hazards import HazardError


def double(x, out):
    torch.mul(x, 2, out=out)


@pytest.fixture
def dev():
    with device("sim", strict=True) as d:
        yield d


def test_a_copy_over_data_another_stream_may_still_read_is_refused(dev):
    h2d, d2h = dev.stream("h2d"), dev.stream("d2h")
    x = dev.empty(1024, name="x")
    host_in, host_out = dev.host_empty(1024), dev.host_empty(1024)
    host_in.fill_(1.0)
    dev.copy(host_out, x, d2h)  # d2h reads x ...
    with pytest.raises(HazardError, match=r"h2d copy .* on stream 'h2d' writes device tensor 'x#\d+'.*"
                                          r"stream 'd2h #\d+' may still read.*stream.wait\(event\)"):
        dev.copy(x, host_in, h2d)  # ... and h2d overwrites it with nothing ordering the two


def test_the_same_copies_ordered_by_an_event_pass(dev):
    h2d, d2h = dev.stream("h2d"), dev.stream("d2h")
    x = dev.empty(1024, name="x")
    host_in, host_out = dev.host_empty(1024), dev.host_empty(1024)
    host_in.fill_(1.0)
    dev.copy(host_out, x, d2h)
    done = dev.event()
    done.record(d2h)
    h2d.wait(done)
    dev.copy(x, host_in, h2d)
    dev.synchronize()
    assert torch.equal(x, host_in)


def test_a_read_of_data_another_stream_may_still_write_is_refused_unless_the_host_waited(dev):
    h2d, compute = dev.stream("h2d"), dev.stream("compute")
    x = dev.empty(1024, name="x")
    host = dev.host_empty(1024)
    host.fill_(2.0)
    dev.copy(x, host, h2d)
    with pytest.raises(HazardError, match=r"launch 'double' .* on stream 'compute' writes device tensor 'x#\d+'"):
        dev.launch(compute, torch.mul, x, 2, out=x, name="double")
    dev.synchronize()  # once the host has waited for the copy, work issued later is ordered after it
    dev.launch(compute, torch.mul, x, 2, out=x, name="double")
    dev.synchronize()
    assert torch.equal(x, torch.full((1024,), 4.0))


SLOW = Link(bandwidth=1e8)  # 4 MiB take 40 ms: the host surely acts while the copy runs


def test_a_host_read_before_a_d2h_copy_syncs_sees_nan(monkeypatch):
    """The copy is held in flight (after its start, before its bytes land) while the host reads: no sleep to guess how
    long a busy machine takes to start it."""
    in_flight, looked = threading.Event(), threading.Event()
    sleep_until = sim_module._sleep_until

    def held_in_flight(t):
        if not in_flight.is_set() and torch.isnan(out).all():  # poisoned: the copy has started
            in_flight.set()
            looked.wait(10)
        sleep_until(t)

    monkeypatch.setattr(sim_module, "_sleep_until", held_in_flight)
    dev = device("sim", strict=True, d2h=SLOW)
    d2h = dev.stream("d2h")
    x = dev.empty(1 << 20, name="x")
    x.fill_(3.0)
    out = dev.host_empty(1 << 20)
    out.fill_(0.0)
    dev.copy(out, x, d2h)
    done = dev.event()
    done.record(d2h)
    assert in_flight.wait(10)
    assert torch.isnan(out).any()  # read too early: poisoned, as a GPU's buffer holds who knows what
    looked.set()
    done.synchronize()
    assert torch.equal(out, x)  # read after the event: the bytes
    dev.close()


def test_a_host_write_to_a_pinned_source_during_its_copy_fails_the_stream(monkeypatch):
    in_flight, written = threading.Event(), threading.Event()
    checksum = sim_module.checksum

    def held_after_reading(tensor):
        digest = checksum(tensor)
        if not in_flight.is_set():  # the copy has read its source: it is in flight until its end
            in_flight.set()
            written.wait(10)
        return digest

    monkeypatch.setattr(sim_module, "checksum", held_after_reading)
    dev = device("sim", strict=True, h2d=SLOW)
    h2d = dev.stream("h2d")
    x = dev.empty(1 << 20, name="x")
    host = dev.host_empty(1 << 20)
    host.fill_(1.0)
    dev.copy(x, host, h2d)
    assert in_flight.wait(10)
    host.fill_(5.0)  # the copy is still in flight
    written.set()
    with pytest.raises(RuntimeError, match="the host wrote its pinned source while the copy was in flight"):
        dev.synchronize()
    dev.close()


def test_uninitialised_device_memory_is_nan(dev):
    assert torch.isnan(dev.empty(8)).all()
    assert torch.count_nonzero(device("sim", strict=False).empty(8)) == 0


@pytest.mark.parametrize("missing", sorted(pipeline.WAITS))
def test_every_missing_wait_of_the_chapter_2_pipeline_is_caught_at_once(dev, missing):
    chunks_in = [dev.host_empty(1 << 14) for _ in range(6)]
    chunks_out = [dev.host_empty(1 << 14) for _ in range(6)]
    for chunk in chunks_in:
        chunk.fill_(1.0)
    with pytest.raises(HazardError, match="nothing orders that work before this"):
        pipeline.overlapped(dev, chunks_in, chunks_out, double, waits=pipeline.WAITS - {missing})
        dev.synchronize()


def test_the_correct_pipeline_passes_the_checker(dev):
    chunks_in = [dev.host_empty(1 << 14) for _ in range(6)]
    chunks_out = [dev.host_empty(1 << 14) for _ in range(6)]
    for chunk in chunks_in:
        chunk.fill_(1.0)
    pipeline.overlapped(dev, chunks_in, chunks_out, double)
    dev.synchronize()
    assert all(torch.equal(o, torch.full_like(o, 2.0)) for o in chunks_out)
