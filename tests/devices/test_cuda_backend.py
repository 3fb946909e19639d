"""The CUDA backend's own machinery (devices/cuda.py), on the CPU with fakes where CUDA would be needed: which events
it makes, the pending spans (thread-safe, bounded, holding a copy's host tensor until the copy ran), pinned host
memory from the project's own page-locked allocation. The tests marked `gpu` check the same on a GPU."""

import gc
import threading
import weakref

import pytest
import torch

from minioffload import pinned
from minioffload.devices.cuda import PENDING_LIMIT, CudaDevice, PendingSpans
from minioffload.trace import Trace


class FakeEvent:
    """A torch.cuda.Event stand-in: records how it was made; `done` says whether the GPU has reached it; `ms` is its
    time from the reference event."""

    made: list[dict] = []

    def __init__(self, ms: float = 0.0, done: bool = True, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        FakeEvent.made.append({"enable_timing": enable_timing, "blocking": blocking})
        self.ms, self.done = ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end) -> float:
        assert self.done and end.done, "CUDA refuses elapsed_time on an event not yet reached"
        return end.ms - self.ms


@pytest.fixture
def fake_events(monkeypatch):
    FakeEvent.made = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return FakeEvent.made


def bare_device() -> CudaDevice:
    """A CudaDevice whose __init__ (which needs a GPU) never ran: for the methods that use no state."""
    return CudaDevice.__new__(CudaDevice)


# events ------------------------------------------------------------------------------------------------------
def test_ordering_events_block_the_host_and_record_no_time(fake_events):
    dev = bare_device()
    ordering, timing = dev.event(), dev.event(timing=True)
    assert fake_events == [{"enable_timing": False, "blocking": True},  # a host wait sleeps, it does not spin
                           {"enable_timing": True, "blocking": True}]
    assert not ordering.timing and timing.timing


def test_elapsed_ms_needs_timing_events(fake_events):
    dev = bare_device()
    start, end, ordering = dev.event(timing=True), dev.event(timing=True), dev.event()
    start.event.ms, end.event.ms = 1.0, 3.5
    assert start.elapsed_ms(end) == 2.5
    for a, b in ((ordering, end), (start, ordering)):
        with pytest.raises(RuntimeError, match=r"dev.event\(timing=True\)"):
            a.elapsed_ms(b)


# pending spans -----------------------------------------------------------------------------------------------
def spans_of(trace: Trace, limit: int = PENDING_LIMIT) -> PendingSpans:
    """Pending spans whose reference event completed 1 s after the trace's origin."""
    return PendingSpans(trace, FakeEvent(0.0), trace.origin + 1.0, limit)


def test_completed_spans_are_folded_in_without_a_synchronize_and_none_is_lost():
    trace = Trace()
    spans = spans_of(trace, limit=100)
    longest = 0
    for k in range(10_000):
        spans.add("h2d", f"copy {k}", FakeEvent(k), FakeEvent(k + 0.5), 8)
        longest = max(longest, len(spans))
    assert longest <= 101  # bounded: nobody called fold()
    spans.fold()
    assert len(spans) == 0 and [s.name for s in trace.spans] == [f"copy {k}" for k in range(10_000)]
    first = trace.spans[0]  # placed on the trace's clock through the reference event
    assert first.start == pytest.approx(1.0) and first.end == pytest.approx(1.0005) and first.nbytes == 8


def test_spans_still_running_are_kept_until_they_complete():
    trace = Trace()
    spans = spans_of(trace, limit=100)
    running = []
    for k in range(1000):
        end = FakeEvent(k + 0.5, done=k % 4 != 0)  # the GPU runs far behind every fourth op
        running += [] if end.done else [end]
        spans.add("compute", f"op {k}", FakeEvent(k), end, 0)
        assert len(spans) <= 2 * len(running) + 101  # folding bounds what is done; what runs is kept
    spans.fold()
    assert len(spans) == len(running) == 250 and len(trace.spans) == 750
    for end in running:
        end.done = True
    spans.fold()
    assert sorted(s.name for s in trace.spans) == sorted(f"op {k}" for k in range(1000))


def test_two_threads_adding_at_once_release_no_host_tensor_early_and_lose_no_span():
    """The speculative worker or a checkpoint writer adds spans while the host thread does: without a lock both pop
    the copy they saw complete, and the second pop releases a tensor whose copy has not run."""
    trace = Trace()
    spans = spans_of(trace)
    added = threading.Event()
    other = threading.Thread(target=lambda: (spans.add("d2h", "other", FakeEvent(5.0), FakeEvent(6.0), 0),
                                             added.set()))

    class SlowToQuery(FakeEvent):
        armed = False

        def query(self) -> bool:  # asked by an add, to release the copies that ran
            if self.armed and not other.is_alive() and not added.is_set():
                other.start()
                added.wait(0.5)  # without a lock, the other thread's add runs now, in the middle of this one
            return self.done

    first, second = torch.ones(4), torch.ones(4)
    first_end, second_end = SlowToQuery(2.0, done=False), FakeEvent(4.0, done=False)
    spans.add("h2d", "first", FakeEvent(1.0), first_end, 16, keep=first)
    spans.add("h2d", "second", FakeEvent(3.0), second_end, 16, keep=second)
    second_alive = weakref.ref(second)
    del first, second
    first_end.done = first_end.armed = True  # the first copy has run
    spans.add("compute", "third", FakeEvent(7.0), FakeEvent(8.0), 0)
    other.join(5)
    gc.collect()
    assert second_alive() is not None, "a host tensor was released while its copy was still queued"
    second_end.done = True
    spans.fold()
    assert sorted(s.name for s in trace.spans) == ["first", "other", "second", "third"]


def test_a_copy_holds_its_host_tensor_until_the_copy_has_run():
    spans = spans_of(Trace())
    host, end = torch.ones(16), FakeEvent(1.0, done=False)
    spans.add("h2d", "copy", FakeEvent(0.5), end, 64, keep=host)
    alive = weakref.ref(host)
    del host
    gc.collect()
    spans.add("compute", "later", FakeEvent(2.0), FakeEvent(2.5), 0)
    assert alive() is not None  # the DMA may still read it: its memory must not be freed (and unlocked)
    end.done = True
    spans.add("compute", "later still", FakeEvent(3.0), FakeEvent(3.5), 0)
    gc.collect()
    assert alive() is None  # released as soon as the copy is seen done, with no synchronize


# pinned host memory ------------------------------------------------------------------------------------------

def test_pinned_host_buffers_are_our_memory_locked_for_exactly_their_size(fake_cudart):
    dev = bare_device()
    buffer = dev.host_empty((3, 5), torch.float16)
    assert buffer.shape == (3, 5) and buffer.dtype == torch.float16
    assert fake_cudart.locked == {buffer.data_ptr(): 30}  # not rounded up to a power of two
    assert pinned.is_pinned(buffer) and buffer.data_ptr() % pinned.ALIGNMENT == 0
    del buffer
    gc.collect()
    assert fake_cudart.locked == {}  # unlocked (and freed) with its last tensor
    pageable = dev.host_empty(1000, pinned=False)
    assert fake_cudart.locked == {} and not pinned.is_pinned(pageable)


# on a GPU ----------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_pinned_buffers_bypass_torchs_pinned_allocator_and_live_until_their_copy_ran():
    with CudaDevice() as dev:
        before = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
        host = dev.host_empty(3 * 2**20 + 1, torch.uint8)
        assert torch.cuda.host_memory_stats().get("num_host_alloc", 0) == before  # not torch's pinned pool
        assert host.is_pinned() and pinned.is_pinned(host)  # CUDA itself sees it page-locked
        host.copy_(torch.arange(host.numel()) % 251)
        expected = host.clone()
        on_device, stream = dev.empty(host.numel(), torch.uint8), dev.stream("h2d")
        dev.launch(stream, torch.cuda._sleep, 200_000_000)  # ~0.1 s: the copy below cannot have run yet
        dev.copy(on_device, host, stream)
        alive, address = weakref.ref(host), host.data_ptr()
        del host
        gc.collect()
        assert alive() is not None and address in pinned._registered  # held by the copy still queued
        dev.synchronize()
        gc.collect()
        assert alive() is None and address not in pinned._registered  # unlocked and freed once it ran
        assert torch.equal(on_device.cpu(), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_spans_stay_bounded_without_a_synchronize_and_timing_events_time():
    with CudaDevice() as dev:
        x, stream = dev.empty(1024), dev.stream("s")
        x.zero_()
        dev.stream_waits_for_compute(stream)
        longest = 0
        for _ in range(3 * PENDING_LIMIT):
            dev.launch(stream, x.add_, 1)
            longest = max(longest, len(dev._pending))
        assert longest <= 2 * PENDING_LIMIT + 1
        start, end = dev.event(timing=True), dev.event(timing=True)
        start.record(stream)
        dev.launch(stream, torch.cuda._sleep, 20_000_000)
        end.record(stream)
        end.synchronize()  # a blocking event: the host sleeps here
        assert start.elapsed_ms(end) > 0
        with pytest.raises(RuntimeError, match="timing=True"):
            dev.event().elapsed_ms(end)
        dev.synchronize()
        assert len([s for s in dev.trace.spans if s.lane == "compute"]) == 3 * PENDING_LIMIT + 1
        assert x[0].item() == 3 * PENDING_LIMIT
