"""PinnedPool: aligned, bounded, reused, thread-safe; clear errors; every buffer comes back."""

import gc
import threading

import pytest
import torch

from minioffload import pinned
from minioffload.pinned import ALIGNMENT, PinnedPool, PoolExhausted, aligned_empty, is_pinned


def test_aligned_empty_is_page_aligned_and_pinned_when_asked():
    for nbytes in (1, 4095, 4096, 1 << 20):
        buffer = aligned_empty(nbytes)
        assert buffer.data_ptr() % ALIGNMENT == 0 and buffer.numel() == nbytes
        assert is_pinned(buffer) and is_pinned(buffer[nbytes // 2:])
    assert not is_pinned(torch.empty(1 << 20, dtype=torch.uint8))
    assert not is_pinned(aligned_empty(8192, pin=False))


@pytest.mark.parametrize("nbytes, alignment", [(0, 4096), (-1, 4096), (16, 3000)])
def test_aligned_empty_refuses_bad_sizes(nbytes, alignment):
    with pytest.raises(ValueError):
        aligned_empty(nbytes, alignment)


def test_slots_are_aligned_distinct_and_views_have_the_asked_shape():
    pool = PinnedPool(slot_bytes=10_000, slots=3)
    buffers = [pool.acquire() for _ in range(3)]
    addresses = {b.view(2500, torch.float32).data_ptr() for b in buffers}
    assert len(addresses) == 3 and all(a % ALIGNMENT == 0 for a in addresses)
    view = buffers[0].view((50, 50), torch.float32)
    view.fill_(1.5)
    assert view.shape == (50, 50) and view.dtype == torch.float32
    assert not buffers[1].view(2500).eq(1.5).any()  # slots do not overlap
    for b in buffers:
        b.release()


def test_a_released_slot_is_reused():
    pool = PinnedPool(slot_bytes=4096, slots=2)
    with pool.acquire() as first:
        address = first.view(1024).data_ptr()
    with pool.acquire() as again:
        assert again.view(1024).data_ptr() == address
    assert pool.stats().in_use == 0 and pool.stats().acquires == 2


def test_exhausted_pool_fails_clearly_without_blocking_or_after_a_timeout():
    pool = PinnedPool(slot_bytes=4096, slots=1, name="staging")
    held = pool.acquire()
    with pytest.raises(PoolExhausted, match="all 1 slots of 'staging' are in use"):
        pool.acquire(block=False)
    with pytest.raises(PoolExhausted, match="within 0.05 s"):
        pool.acquire(timeout=0.05)
    held.release()
    assert pool.stats().in_use == 0


def test_a_blocked_acquire_wakes_up_on_release():
    pool = PinnedPool(slot_bytes=4096, slots=1)
    held = pool.acquire()
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout=5)))
    waiter.start()
    held.release()
    waiter.join(timeout=5)
    assert got and pool.stats().waits == 1


@pytest.mark.parametrize("call, error, match", [
    (lambda pool: pool.acquire(nbytes=5000), ValueError, "its slots hold 1..4096 bytes"),
    (lambda pool: pool.acquire(nbytes=0), ValueError, "its slots hold"),
    (lambda pool: pool.acquire().view((2000,), torch.float32), ValueError, "needs 8000 bytes"),
])
def test_requests_past_the_bound_are_refused_and_change_nothing(call, error, match):
    pool = PinnedPool(slot_bytes=4096, slots=2)
    with pytest.raises(error, match=match):
        call(pool)
    stats = pool.stats()
    assert stats.in_use <= 1  # the view case holds its (valid) buffer; nothing else was lent


def test_use_after_release_and_double_release_are_errors():
    pool = PinnedPool(slot_bytes=4096, slots=1, name="p")
    buffer = pool.acquire()
    buffer.release()
    with pytest.raises(RuntimeError, match="used after release"):
        buffer.view(16)
    with pytest.raises(RuntimeError, match="released twice"):
        buffer.release()
    assert pool.stats().in_use == 0


@pytest.mark.parametrize("slot_bytes, slots", [(0, 1), (4096, 0), (4096, 1.5)])
def test_bad_pool_shapes_are_refused(slot_bytes, slots):
    with pytest.raises(ValueError):
        PinnedPool(slot_bytes=slot_bytes, slots=slots)


def test_eight_threads_hammering_never_share_a_slot_and_return_every_buffer():
    pool = PinnedPool(slot_bytes=4096, slots=3)
    lent: set[int] = set()
    lock = threading.Lock()
    problems: list[str] = []

    def worker(seed: int) -> None:
        for i in range(300):
            with pool.acquire(timeout=10) as buffer:
                with lock:
                    if buffer.index in lent:
                        problems.append(f"slot {buffer.index} lent twice")
                    lent.add(buffer.index)
                    if len(lent) > 3:
                        problems.append(f"{len(lent)} slots lent from a pool of 3")
                buffer.view(1024, torch.int32).fill_(seed * 1000 + i)
                assert buffer.view(1024, torch.int32)[0].item() == seed * 1000 + i  # nobody else wrote here
                with lock:
                    lent.discard(buffer.index)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    stats = pool.stats()
    assert not problems and stats.in_use == 0 and stats.acquires == 2400 and stats.peak_in_use <= 3


def test_a_buffer_freed_while_the_registry_lock_is_held_does_not_deadlock():
    from minioffload import pinned

    buffer = aligned_empty(8192)
    done = threading.Event()

    def free_inside_the_lock():
        nonlocal buffer
        with pinned._registry_lock:
            del buffer  # its finalizer unregisters it right here
        done.set()

    worker = threading.Thread(target=free_inside_the_lock, daemon=True)
    worker.start()
    assert done.wait(5), "freeing a pinned buffer inside the registry lock deadlocked"


def test_a_registry_being_read_never_changes_under_its_reader():
    # A garbage collection can start at any allocation on this thread and run a buffer's finalizer inside a read of
    # the registry (Lab 7's check once failed so: CPython 3.11's dict.copy() collected midway, and the copy held the
    # old entries under the new count). A reader must never see the dict it holds change.
    import gc

    from minioffload import pinned

    buffer, kept = aligned_empty(4096), aligned_empty(4096)
    address = buffer.data_ptr()
    being_read = pinned._registered
    as_read = dict(being_read)
    del buffer
    gc.collect()
    assert address not in pinned._registered and kept.data_ptr() in pinned._registered
    assert being_read == as_read, "unregistering changed the dict a reader may be iterating"
    fresh = aligned_empty(4096)
    assert being_read == as_read and is_pinned(fresh) and is_pinned(kept)


# with CUDA: our own memory, page-locked for exactly its size (a fake cudart here; the GPU test is in
# tests/devices/test_cuda_backend.py) ----------------------------------------------------------------------------

def test_with_cuda_a_pinned_buffer_is_locked_for_its_exact_size_and_unlocked_with_its_last_view(fake_cudart):
    import gc

    buffer = aligned_empty(10_000)  # torch's pinned allocator would take 16 KiB
    address = buffer.data_ptr()
    assert address % ALIGNMENT == 0 and fake_cudart.calls == [("register", address, 10_000, 0)]
    assert is_pinned(buffer) and is_pinned(buffer[5000:])
    view = buffer[100:].view(torch.int16)
    del buffer
    gc.collect()
    assert len(fake_cudart.calls) == 1  # a view still uses the memory
    del view
    gc.collect()
    assert fake_cudart.calls[1:] == [("unregister", address)]
    aligned_empty(8192, pin=False)
    assert len(fake_cudart.calls) == 2  # pageable: never locked


def test_with_cuda_a_buffer_that_cannot_be_locked_is_a_clear_error(fake_cudart):
    fake_cudart.refuse = True
    with pytest.raises(RuntimeError, match=r"could not page-lock 4096 bytes .*`ulimit -l`"):
        aligned_empty(4096)
    assert [call[0] for call in fake_cudart.calls] == ["register"]  # nothing to unlock


# the host budget ---------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_garbage_pinned():
    """Buffers earlier tests dropped, waiting in reference cycles, freed now: a budget counts what is alive."""
    gc.collect()


def test_a_buffer_past_the_budget_is_refused_before_any_memory_is_pinned():
    before = pinned.aligned_empty(8 * 4096)  # pinned before the block: not the block's
    with pinned.HostBudget(3 * 4096) as budget:
        kept = [pinned.aligned_empty(4096) for _ in range(3)]  # exactly the budget: fits
        held = pinned.held_bytes()
        with pytest.raises(pinned.OutOfHostBudget, match="cannot pin 4.00 KiB: 12.00 KiB of the 12.00 KiB host budget"):
            pinned.aligned_empty(4096)
        assert pinned.held_bytes() == held  # nothing was pinned by the refused call
        assert pinned.aligned_empty(4096, pin=False) is not None  # pageable memory is not the budget's
        assert budget.peak == budget.held == 3 * 4096
        del kept[0]
        pinned.aligned_empty(4096)  # a freed buffer's bytes are the budget's again
    assert before.numel() == 8 * 4096


def test_the_peak_is_measured_from_the_buffers_alive_at_once():
    with pinned.HostBudget(None) as budget:  # no bound: the peak is still measured
        for _ in range(4):  # one 8 KiB buffer at a time: the peak is one of them, not four
            buffer = pinned.aligned_empty(8192)
            del buffer
        assert budget.peak == 8192
        both = [pinned.aligned_empty(8192), pinned.aligned_empty(8192)]
        assert budget.peak == 2 * 8192 and len(both) == 2


def test_nested_budgets_each_hold():
    with pinned.HostBudget(4 * 4096), pinned.HostBudget(4096) as inner:
        kept = pinned.aligned_empty(4096)
        with pytest.raises(pinned.OutOfHostBudget):
            pinned.aligned_empty(4096)  # within the outer budget, past the inner one
        assert inner.peak == 4096 and kept.numel() == 4096


@pytest.mark.parametrize("nbytes", [0, -1, 1.5, True, "1GB"])
def test_a_budget_must_be_a_positive_int_of_bytes(nbytes):
    with pytest.raises(ValueError, match="a host budget is a positive int of bytes"):
        pinned.HostBudget(nbytes)


def test_threads_pinning_at_once_never_pass_the_budget_together():
    budget_bytes = 10 * 4096
    kept, refused = [], []
    lock = threading.Lock()

    def pin():
        for _ in range(5):
            try:
                buffer = pinned.aligned_empty(4096)
            except pinned.OutOfHostBudget:
                with lock:
                    refused.append(1)
            else:
                with lock:
                    kept.append(buffer)

    with pinned.HostBudget(budget_bytes) as budget:
        threads = [threading.Thread(target=pin) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(kept) == 10 and len(refused) == 10  # 20 asked, room for 10
    assert budget.peak <= budget_bytes
