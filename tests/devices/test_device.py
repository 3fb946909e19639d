"""Device semantics, the same on both backends: stream order, cross-stream waits, events, copies, OOM.

Each test runs on the sim device, and on cuda when torch sees a GPU (marked `gpu`).
"""

import threading
import time

import pytest
import torch

from minioffload.devices import Link, device, pipeline
from minioffload.predict.memory import MiB, OutOfMemoryError

BACKENDS = ["sim", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.fixture(params=BACKENDS)
def dev(request):
    with device(request.param) as d:
        yield d


def test_auto_says_which_device_it_picked(capsys):
    with device("auto") as d:
        assert d.kind == ("cuda" if torch.cuda.is_available() else "sim")
    assert f"using the {d.kind} device" in capsys.readouterr().out


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="choose 'auto', 'cuda' or 'sim'"):
        device("tpu")


def test_work_on_one_stream_runs_in_order(dev):
    stream = dev.stream("s")
    x = dev.empty(1)
    x.zero_()  # device memory from empty() is uninitialised (NaN on the strict sim)
    dev.stream_waits_for_compute(stream)  # the zero_ ran on the compute stream
    for k in range(50):  # x = 10*x + k mod 1000: any reordering changes the result
        dev.launch(stream, lambda k=k: x.mul_(10).add_(k).remainder_(1000))
    dev.synchronize()
    expected = 0
    for k in range(50):
        expected = (expected * 10 + k) % 1000
    assert x.item() == expected


def test_a_cross_stream_wait_holds_even_when_the_first_stream_is_slow(dev):
    a, b = dev.stream("a"), dev.stream("b")
    x = dev.empty(1)
    dev.launch(a, lambda: (time.sleep(0.05), x.fill_(7)) if dev.kind == "sim" else x.fill_(7))
    done = dev.event()
    done.record(a)
    b.wait(done)
    result = dev.empty(1)
    dev.launch(b, lambda: result.copy_(x))
    dev.synchronize()
    assert result.item() == 7


def test_copies_round_trip_and_go_on_the_right_lanes(dev):
    host = dev.host_empty((256, 256))
    host.copy_(torch.arange(256 * 256, dtype=torch.float32).view(256, 256))
    on_device, back = dev.empty((256, 256)), dev.host_empty((256, 256))
    stream = dev.stream("copy")
    dev.copy(on_device, host, stream)
    dev.copy(back, on_device, stream)
    dev.synchronize()
    assert torch.equal(back, host)
    assert [(s.lane, s.nbytes) for s in dev.trace.spans] == [("h2d", 256 * 1024), ("d2h", 256 * 1024)]


@pytest.mark.parametrize("shape, dtype, match", [
    ((4, 8), torch.float16, "same shape and dtype"),
    ((8, 4), torch.float32, "same shape and dtype"),
])
def test_mismatched_copies_are_refused_naming_both_sides(dev, shape, dtype, match):
    src = dev.host_empty((4, 8))
    with pytest.raises(ValueError, match=match) as err:
        dev.copy(dev.empty(shape, dtype), src)
    assert "(4, 8)" in str(err.value)
    assert dev.trace.spans == []


def test_host_to_host_copy_is_refused(dev):
    with pytest.raises(ValueError, match="both tensors are host tensors"):
        dev.copy(dev.host_empty(4), dev.host_empty(4))


@pytest.mark.parametrize("waiter", ["host", "stream"])
def test_waiting_on_an_event_never_recorded_is_an_error_not_a_hang(dev, waiter):
    event = dev.event()
    with pytest.raises(RuntimeError, match="never recorded"):
        event.synchronize() if waiter == "host" else dev.stream("s").wait(event)


def test_event_timestamps_are_monotonic_along_a_stream(dev):
    stream = dev.stream("s")
    x = dev.empty(1 << 16)
    events = []
    for _ in range(10):
        dev.launch(stream, lambda: x.add_(1))
        events.append(dev.event(timing=True))
        events[-1].record(stream)
    dev.synchronize()
    gaps = [a.elapsed_ms(b) for a, b in zip(events, events[1:], strict=False)]
    assert all(gap >= 0 for gap in gaps)
    assert all(e.query() for e in events)


def test_an_error_inside_stream_work_is_reported_once(dev):
    # sim: the worker thread hits it and synchronize() reports it; cuda: the host-side Python raises at launch
    with pytest.raises((RuntimeError, ZeroDivisionError), match="ZeroDivisionError|division by zero"):
        dev.launch(dev.stream("s"), lambda: 1 / 0, name="boom")
        dev.synchronize()
    dev.synchronize()  # reported once, then the device is usable again


# --- sim only ---------------------------------------------------------------------------------

def test_sim_out_of_memory_raises_and_leaves_the_ledger_unchanged():
    with device("sim", memory_bytes=64 * MiB) as dev:
        keep = dev.empty(10 * MiB // 4)  # noqa: F841  (held on purpose)
        before = (dev.ledger.used("device"), dev.ledger.allocations, len(dev.ledger.history))
        with pytest.raises(OutOfMemoryError, match="60.00 MiB .* 54.00 MiB free of 64.00 MiB"):
            dev.empty(60 * MiB // 4, name="too_big")
        assert (dev.ledger.used("device"), dev.ledger.allocations, len(dev.ledger.history)) == before


def test_sim_device_memory_is_freed_with_the_tensor(sim):
    x = sim.empty((1024, 1024))
    assert sim.ledger.used("device") == 4 * MiB
    del x
    assert sim.ledger.used("device") == 0 and sim.ledger.peak("device") == 4 * MiB


def test_sim_copy_time_follows_the_link_and_engines_serialise_one_direction():
    link = Link(bandwidth=1e9, latency=0.0)
    with device("sim", h2d=link, d2h=link) as dev:
        n = 4 * MiB // 4  # 4 MiB: 4.2 ms at 1 GB/s
        a, b = dev.empty(n), dev.empty(n)
        ha, hb = dev.host_empty(n), dev.host_empty(n)
        dev.copy(a, ha, dev.stream("one"))
        dev.copy(b, hb, dev.stream("two"))  # same direction, another stream: waits for the engine
        dev.synchronize()
        first, second = sorted(dev.trace.spans, key=lambda s: s.start)
        assert first.duration >= link.seconds(4 * MiB) * 0.95
        assert second.start >= first.end - 1e-4  # never two H2D copies at once


def test_sim_pageable_copy_blocks_the_host_and_is_slower():
    with device("sim", pageable_slowdown=3.0) as dev:
        n = 2 * MiB // 4
        dev.copy(dev.empty(n), dev.host_empty(n, pinned=False), dev.stream("s"), name="pageable")
        dev.synchronize()
        host = [s for s in dev.trace.spans if s.lane == "host"]
        copy = [s for s in dev.trace.spans if s.lane == "h2d"]
        assert host and host[0].name == "blocked: pageable pageable"
        assert copy[0].duration >= 3.0 * dev.links["h2d"].seconds(2 * MiB) * 0.95


def test_sim_restores_the_gil_switch_interval():
    import sys

    before = sys.getswitchinterval()
    with device("sim", switch_interval=2e-4):
        assert sys.getswitchinterval() == pytest.approx(2e-4)
    assert sys.getswitchinterval() == before


def test_sim_refuses_bad_options_and_work_after_close():
    with pytest.raises(ValueError, match="pageable_slowdown"):
        device("sim", pageable_slowdown=0.5)
    dev = device("sim")
    dev.close()
    with pytest.raises(RuntimeError, match="closed"):
        dev.launch(dev.default_stream, lambda: None)


def triple_plus_one(x, out):  # not idempotent: a stale or half-copied chunk gives a wrong answer
    torch.mul(x, 3, out=out).add_(1)


def _chunks(dev, count=8, numel=1 << 14):
    chunks_in = [dev.host_empty(numel) for _ in range(count)]
    for k, chunk in enumerate(chunks_in):
        chunk.copy_(torch.arange(numel, dtype=torch.float32) + 1000 * k)
    return chunks_in, [dev.host_empty(numel) for _ in range(count)]


def _correct(waits, trials=20, jitter=2e-3):
    ok = 0
    for seed in range(trials):
        with device("sim", jitter=jitter, seed=seed, strict=False) as jittery:  # jitter alone: no hazard checker
            chunks_in, chunks_out = _chunks(jittery)
            pipeline.overlapped(jittery, chunks_in, chunks_out, triple_plus_one, waits=waits)
            expected = pipeline.reference(chunks_in, triple_plus_one)
            ok += all(torch.equal(o, r) for o, r in zip(chunks_out, expected, strict=True))
    return ok


def test_jitter_never_fails_the_correct_pipeline():
    """Jitter reorders nothing that is ordered. (A missing wait is caught in every run by the strict sim:
    tests/devices/test_hazards.py; under jitter alone it shows up only in some runs, so no test counts on that.)"""
    assert _correct(pipeline.WAITS) == 20


def test_a_tensor_freed_while_the_ledger_lock_is_held_does_not_deadlock(sim):
    # Garbage collection can run a release finalizer inside ledger.allocate() on the same thread.
    x = sim.empty(16)
    done = threading.Event()

    def free_inside_the_lock():
        nonlocal x
        with sim.ledger._lock:
            del x  # the finalizer runs right here and frees from the ledger
        done.set()

    worker = threading.Thread(target=free_inside_the_lock, daemon=True)
    worker.start()
    assert done.wait(5), "freeing a device tensor inside the ledger's lock deadlocked"
    assert sim.ledger.used("device") == 0


def test_spans_after_clearing_the_trace_are_on_its_new_clock(dev):
    # bench scripts clear the trace every step; copy spans must still line up with the host's spans
    dev.synchronize()
    dev.trace.clear()
    host = dev.host_empty(1 << 16)
    on_device = dev.empty(1 << 16)
    before = dev.trace.now()
    dev.copy(on_device, host, dev.stream("h2d"))
    dev.synchronize()
    after = dev.trace.now()
    (span,) = [s for s in dev.trace.spans if s.lane == "h2d"]
    assert before - 1e-3 <= span.start <= span.end <= after + 1e-3


def test_adopting_views_counts_their_storage_once_and_whole(dev):
    # autograd saves q, k and v as three views of one projection's output: the device holds that storage, whole
    fused = dev.to_device(torch.randn(4, 3 * 256)) if dev.kind == "sim" else torch.randn(4, 3 * 256, device="cuda")
    q, k, v = fused.split(256, dim=1)
    before = dev.ledger.used("device")
    for view in (q, k, v):
        dev.adopt(view, "saved")
    assert dev.ledger.used("device") - before == fused.untyped_storage().nbytes() == 4 * 3 * 256 * 4
    del q, k, v, view, fused
    assert dev.ledger.used("device") == before  # freed with its storage
