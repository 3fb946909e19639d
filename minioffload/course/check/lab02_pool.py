"""Graders for Lab 2, Task 2.1: a bounded, thread-safe slot pool.

A broken pool fails on a timeout, never hangs the notebook.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .grading import grader

POOL_SLOTS = 3
HAMMER_THREADS, HAMMER_ROUNDS = 8, 200
WAKE_TIMEOUT = 2.0  # s: a blocked acquire must wake this soon after a release
HAMMER_TIMEOUT = 20.0  # s: all hammering threads must be done by then (a deadlock fails, never hangs)


def _acquire_in_thread(pool, block: bool) -> tuple[threading.Thread, dict]:
    """Call pool.acquire(block=...) in a daemon thread; the result (or error) lands in the dict."""
    box: dict = {}

    def run() -> None:
        try:
            box["index"] = pool.acquire(block=block)
        except BaseException as err:  # reported by the grader
            box["error"] = err

    thread = threading.Thread(target=run, daemon=True, name="lab02-acquire")
    thread.start()
    return thread, box


@grader("2.1", rebuilds=("minioffload.pinned.PinnedPool.acquire", "minioffload.pinned.PinnedBuffer.release"))
def slot_pool(cls: Callable) -> str:
    """cls(slots) with acquire(block=False) -> int and release(index); thread-safe."""
    pool = cls(POOL_SLOTS)
    lent = [pool.acquire(block=False) for _ in range(POOL_SLOTS)]
    assert all(isinstance(i, int) and not isinstance(i, bool) for i in lent), (
        f"acquire() should return slot indices (int), got {lent!r}")
    assert sorted(lent) == list(range(POOL_SLOTS)), (
        f"a {POOL_SLOTS}-slot pool lent {lent} for its first {POOL_SLOTS} acquires; expected each of "
        f"0..{POOL_SLOTS - 1} exactly once (never the same slot twice while it is lent)")
    try:
        extra = pool.acquire(block=False)
    except RuntimeError as err:
        assert "exhausted" in str(err).lower(), (
            f"acquire(block=False) on an empty pool raised RuntimeError({str(err)!r}); expected the message to "
            "say the pool is 'exhausted'")
    else:
        raise AssertionError(f"acquire(block=False) with all {POOL_SLOTS} slots lent returned {extra!r}; expected "
                             f"RuntimeError('... exhausted ...'): never lend more than {POOL_SLOTS} slots")

    pool.release(lent[1])
    again = pool.acquire(block=False)
    assert again == lent[1], (f"after releasing slot {lent[1]} (the only free one), acquire() returned {again!r}; "
                              f"expected {lent[1]}")
    pool.release(lent[0])
    for index, what in ((lent[0], "twice"), (POOL_SLOTS + 5, "that the pool does not have")):
        try:
            pool.release(index)
        except ValueError:
            continue
        raise AssertionError(f"release({index}) of a slot {what} was accepted; expected ValueError (a slot that "
                             "is not lent out cannot be given back)")
    fresh = cls(POOL_SLOTS)
    try:
        fresh.release(0)
    except ValueError:
        pass
    else:
        raise AssertionError("release(0) on a new pool (nothing lent yet) was accepted; expected ValueError")

    # a blocked acquire waits, and wakes on a release
    thread, box = _acquire_in_thread(pool, block=True)  # slot lent[0] is free: returns at once
    thread.join(WAKE_TIMEOUT)
    assert box.get("index") == lent[0], (
        f"acquire(block=True) with slot {lent[0]} free returned {box.get('index', box.get('error'))!r}; "
        f"expected {lent[0]}")
    thread, box = _acquire_in_thread(pool, block=True)  # now the pool is empty: must wait
    thread.join(0.05)
    assert thread.is_alive(), (
        f"acquire(block=True) on an empty pool returned {box.get('index', box.get('error'))!r} at once; "
        "expected it to wait until a slot is released (threading.Condition.wait_for)")
    pool.release(lent[2])
    thread.join(WAKE_TIMEOUT)
    assert not thread.is_alive(), (
        f"acquire(block=True) still waits {WAKE_TIMEOUT:.0f} seconds after slot {lent[2]} was released; "
        "does release() call notify() on the condition?")
    assert box.get("index") == lent[2], (
        f"the woken acquire(block=True) returned {box.get('index', box.get('error'))!r}; expected slot {lent[2]}")

    # many threads at once
    pool = cls(POOL_SLOTS)
    guard, held, problems = threading.Lock(), set(), []
    most = [0]

    def hammer() -> None:
        try:
            for _ in range(HAMMER_ROUNDS):
                index = pool.acquire(block=True)
                with guard:
                    if index in held:
                        problems.append(f"slot {index} was lent to two threads at once")
                    held.add(index)
                    most[0] = max(most[0], len(held))
                time.sleep(0)  # let another thread run while this one holds the slot
                with guard:
                    held.discard(index)
                pool.release(index)
        except BaseException as err:  # reported by the grader
            problems.append(f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=hammer, daemon=True, name=f"lab02-hammer-{n}")
               for n in range(HAMMER_THREADS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + HAMMER_TIMEOUT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(t.is_alive() for t in threads)
    assert not stuck, (f"{stuck} of {HAMMER_THREADS} threads still wait after {HAMMER_TIMEOUT:.0f} seconds of "
                       "acquire/release: a release that does not wake a waiter, or a slot never given back?")
    assert not problems, f"{HAMMER_THREADS} threads sharing a {POOL_SLOTS}-slot pool: {problems[0]}"
    assert most[0] <= POOL_SLOTS, f"{most[0]} slots were lent at once from a {POOL_SLOTS}-slot pool"
    back = []
    try:
        for _ in range(POOL_SLOTS):
            back.append(pool.acquire(block=False))
    except RuntimeError as err:
        raise AssertionError(f"after {HAMMER_THREADS} threads released everything, only {len(back)} of "
                             f"{POOL_SLOTS} slots could be acquired again ({err})") from None
    assert sorted(back) == list(range(POOL_SLOTS)), (
        f"after the threads finished, the pool lent {back}; expected every slot once")
    return (f"{POOL_SLOTS}-slot pool: distinct slots, exhaustion and bad releases refused, a blocked acquire "
            f"woke on release; {HAMMER_THREADS} threads x {HAMMER_ROUNDS} acquire/release, all slots returned")
