"""`Ledger`: named memory tiers with capacities, allocations by name, and a history of every change.

An out-of-memory error says, like CUDA's, what was asked and what was free, and what to change. Both
devices keep their device tier's books in one; chapter 1 uses one to plan placements.

What this is not: an allocator (nothing here holds real memory) or a profiler.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .units import format_bytes
from .units import require_positive as _require_positive


class OutOfMemoryError(MemoryError):
    """An allocation that does not fit its tier. Like CUDA's OOM, it says what was asked and free."""

    def __init__(self, tier: str, name: str, requested: int, free: int, capacity: int, largest: str):
        self.tier, self.name, self.requested, self.free, self.capacity = tier, name, requested, free, capacity
        msg = (f"cannot allocate {format_bytes(requested)} for {name!r} on {tier!r}: "
               f"{format_bytes(free)} free of {format_bytes(capacity)}")
        if largest:
            msg += f" (largest holder: {largest})"
        msg += (f". Free something on {tier!r} first, give {tier!r} a larger capacity, "
                f"or place {name!r} on another tier.")
        super().__init__(msg)


@dataclass(frozen=True)
class Event:
    """One change of a tier's usage, for memory-over-time plots."""

    time: float
    tier: str
    name: str
    delta: int  # bytes, + for allocate, - for free
    used: int  # bytes in use on the tier after the change


@dataclass(frozen=True)
class Allocation:
    name: str
    tier: str
    nbytes: int


class Ledger:
    """Named tiers with capacities; allocations by name; a history of every change.

    >>> ledger = Ledger({"device": 80 * GiB, "host": 512 * GiB, "nvme": None})
    >>> ledger.allocate("weights", "device", 14 * GiB)
    >>> ledger.free_bytes("device") == 66 * GiB
    True

    A capacity of None means unbounded. Every refused call raises before changing anything.
    Thread-safe: later chapters allocate from stream worker threads.
    """

    def __init__(self, capacities: dict[str, int | None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self._capacity: dict[str, int | None] = {}
        self._used: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._allocations: dict[str, Allocation] = {}
        self._history: list[Event] = []
        self._clock = clock
        # Reentrant: device backends free from weakref finalizers, which garbage collection can run while
        # this thread is inside allocate(); a plain Lock would deadlock there.
        self._lock = threading.RLock()
        for tier, capacity in (capacities or {}).items():
            self.add_tier(tier, capacity)

    # tiers ------------------------------------------------------------------------------------
    def add_tier(self, tier: str, capacity: int | None) -> None:
        if not isinstance(tier, str) or not tier:
            raise ValueError(f"a tier needs a non-empty string name, got {tier!r}")
        if capacity is not None:
            _require_positive(capacity, f"capacity of tier {tier!r}")
        with self._lock:
            if tier in self._capacity:
                raise ValueError(f"tier {tier!r} exists already; tiers are {self.tiers}")
            self._capacity[tier] = None if capacity is None else int(capacity)
            self._used[tier] = self._peak[tier] = 0

    @property
    def tiers(self) -> list[str]:
        return list(self._capacity)

    def _check_tier(self, tier: str) -> None:
        if tier not in self._capacity:
            raise ValueError(f"unknown tier {tier!r}; this ledger has {self.tiers} (add_tier to add one)")

    def capacity(self, tier: str) -> int | None:
        self._check_tier(tier)
        return self._capacity[tier]

    def used(self, tier: str) -> int:
        self._check_tier(tier)
        return self._used[tier]

    def peak(self, tier: str) -> int:
        self._check_tier(tier)
        return self._peak[tier]

    def free_bytes(self, tier: str) -> int | None:
        """Bytes still free on `tier` (None when unbounded)."""
        self._check_tier(tier)
        capacity = self._capacity[tier]
        return None if capacity is None else capacity - self._used[tier]

    # allocations ------------------------------------------------------------------------------
    def allocate(self, name: str, tier: str, nbytes: int) -> None:
        """Record `nbytes` on `tier` under `name`; OutOfMemoryError if it does not fit."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"an allocation needs a non-empty string name, got {name!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive integer, got {nbytes!r} for {name!r}")
        with self._lock:
            self._check_tier(tier)
            if name in self._allocations:
                held = self._allocations[name]
                raise ValueError(f"{name!r} is allocated already ({format_bytes(held.nbytes)} on "
                                 f"{held.tier!r}); free it first or choose another name")
            capacity = self._capacity[tier]
            if capacity is not None and self._used[tier] + nbytes > capacity:
                holders = [a for a in self._allocations.values() if a.tier == tier]
                largest = max(holders, key=lambda a: a.nbytes, default=None)
                raise OutOfMemoryError(
                    tier, name, nbytes, capacity - self._used[tier], capacity,
                    f"{largest.name!r} {format_bytes(largest.nbytes)}" if largest else "")
            self._allocations[name] = Allocation(name, tier, nbytes)
            self._record(tier, name, nbytes)

    def free(self, name: str) -> None:
        with self._lock:
            if name not in self._allocations:
                known = ", ".join(map(repr, self._allocations)) or "nothing"
                raise ValueError(f"cannot free {name!r}: it was never allocated (or is freed already); "
                                 f"allocated now: {known}")
            alloc = self._allocations.pop(name)
            self._record(alloc.tier, name, -alloc.nbytes)

    def _record(self, tier: str, name: str, delta: int) -> None:
        self._used[tier] += delta
        self._peak[tier] = max(self._peak[tier], self._used[tier])
        self._history.append(Event(self._clock(), tier, name, delta, self._used[tier]))

    @property
    def allocations(self) -> dict[str, Allocation]:
        return dict(self._allocations)

    @property
    def history(self) -> list[Event]:
        return list(self._history)

    def summary(self) -> str:
        """One line per tier: used / capacity (peak)."""
        rows = []
        for tier, capacity in self._capacity.items():
            cap = "unbounded" if capacity is None else format_bytes(capacity)
            rows.append(f"{tier:<8} {format_bytes(self._used[tier]):>11} used of {cap:>11}"
                        f"  (peak {format_bytes(self._peak[tier])})")
        return "\n".join(rows)
