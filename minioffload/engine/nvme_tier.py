"""The NVMe tier of OffloadAdam: subgroups' fp32 state (master, exp_avg, exp_avg_sq) in files, streamed through
a few pinned working sets while the CPU updates.

    for sub in tier.visit(subgroups):   # sub.buffers holds its state while the loop body runs
        update(sub); upload(sub)        # then its state is written back, and the set is reused

The pipeline with three sets: read subgroup k+1 into one while subgroup k is updated in another and subgroup
k-1 is written from the third. A set is refilled only when its write is durable and the upload that read
its master weights has landed (an event on the H2D stream). With more sets, reads run further ahead.
Gradients and staging stay in pinned host memory (the host needs 4 B/param of gradient plus staging;
the 12 B/param of state go to the disk).

The order (MLP-Offload's cache-friendly update): at the end of a visit every working set still holds the state of
one of the last subgroups updated, written back and so on disk too. With order="alternate" the next visit runs the
other way and starts with those subgroups, updating them without reading them again; "forward" keeps the caller's
order and reads every subgroup. The order cannot change the result: each subgroup's update reads only its own state
and gradient (clipping and loss scaling are decided before the visit). `reads_avoided_fraction` predicts the saving;
the tier counts its reads and writes (`bytes_read`, `bytes_written`, `reads_avoided`, `last_visit`) to check it.

A failed write (a path gone or full) is raised when its set is next needed, or by `drain`. That subgroup's newest
state then lives only in its working set: the set is kept out of use, and the next visit, store or drain writes
it again first (raising again while the path is still broken), so no step runs on the older version on disk.

With `extra` names (OffloadAdam with gradients on NVMe: "grad"), each update reads those too, into the same set,
and never writes them back (grad_spill.py wrote them; a set found holding the state reads its extras only).

What this is not: a cache of reads; a subgroup is found in a set only because it was updated there last.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from ..layout import STATE

ORDERS = ("forward", "alternate")


def reads_avoided_fraction(subgroups: int, sets: int, order: str = "alternate") -> float:
    """The share of a step's subgroup reads that the order avoids, when every step updates the same `subgroups`
    through `sets` working sets. Reads run sets - 2 subgroups ahead but none is issued past the last subgroup, so
    no set is refilled after its subgroup was written back: a visit ends with each set holding one of the last
    `sets` subgroups. "alternate" starts the next visit with them and reads min(sets, subgroups) fewer;
    "forward" meets them last, after their sets were refilled, and avoids none."""
    if isinstance(subgroups, bool) or not isinstance(subgroups, int) or subgroups < 1:
        raise ValueError(f"subgroups must be an int >= 1, got {subgroups!r}")
    if isinstance(sets, bool) or not isinstance(sets, int) or sets < 3:
        raise ValueError(f"sets must be an int >= 3 (one reading, one updating, one writing), got {sets!r}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return min(sets, subgroups) / subgroups if order == "alternate" else 0.0


@dataclass
class VisitCounts:
    """What one visit (or, as `NvmeTier.total`, the whole run) moved: subgroups updated, read from the disk or
    found in a working set, and the bytes read and written."""

    subgroups: int = 0
    reads: int = 0
    reads_avoided: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


class NvmeTier:
    """The working sets and the disk traffic of OffloadAdam's NVMe tier. `buffers`: working sets (>= 3); `order`:
    "forward" or "alternate" (see the module docstring). `holds[i]`: the subgroup whose latest state set i holds
    (None while it is being read or updated); `total` and `last_visit`: VisitCounts, for the run and the last visit."""

    def __init__(self, swapper, dev, h2d_stream, subgroups: list, buffers: int = 3,  # buffers >= 3: options.py
                 order: str = "alternate", extra: tuple[str, ...] = ()):
        if order not in ORDERS:
            raise ValueError(f"nvme_order must be one of {ORDERS}, got {order!r}")
        self.swapper, self.dev, self.h2d, self.order = swapper, dev, h2d_stream, order
        self.extra = extra  # read with the state for each update, never written back ("grad": grad_spill.py)
        if swapper.trace is None:
            swapper.trace = dev.trace  # reads and writes show on the nvme_read / nvme_write lanes
        largest = max(sub.numel for sub in subgroups)
        self.sets = [{name: dev.host_empty(largest) for name in (*STATE, *extra)} for _ in range(buffers)]
        self._busy: list[tuple | None] = [None] * buffers  # per set: (write futures, upload event) in flight
        self.holds: list = [None] * buffers  # per set: the subgroup whose latest state it holds, or None
        self._unsaved: set[int] = set()  # sets whose write failed: their subgroup's newest state is only there
        self._released = [0] * buffers  # per set: when its subgroup was last written back (the oldest is reused)
        self._clock = 0
        self._index = {id(sub): i for i, sub in enumerate(subgroups)}
        self.visits = 0
        self.total, self.last_visit = VisitCounts(), VisitCounts()

    def key(self, sub, name: str) -> str:
        return f"subgroup{self._index[id(sub)]}/{name}"

    # the counters, for the chapter and the benchmark ---------------------------------------------------
    @property
    def bytes_read(self) -> int:
        return self.total.bytes_read

    @property
    def bytes_written(self) -> int:
        return self.total.bytes_written

    @property
    def reads_avoided(self) -> int:
        return self.total.reads_avoided

    @property
    def unsaved(self) -> list[int]:
        """Subgroups whose newest state is only in a working set (a write of it failed)."""
        return sorted(self._index[id(self.holds[s])] for s in self._unsaved)

    def _count(self, **moved: int) -> None:
        for counts in (self.total, self.last_visit):
            for name, value in moved.items():
                setattr(counts, name, getattr(counts, name) + value)

    # the working sets ------------------------------------------------------------------------------------
    def _views(self, set_index: int, sub, names: tuple[str, ...] = STATE) -> dict:
        return {name: self.sets[set_index][name][:sub.numel] for name in names}

    def _wait(self, set_index: int) -> None:
        """The set's previous write is durable and the upload that read it has landed. A failed write is raised,
        and its set kept for the retry (its subgroup's newest state is there only)."""
        busy, self._busy[set_index] = self._busy[set_index], None
        if busy is not None:
            writes, uploaded = busy
            errors = [future.exception() for future in writes]  # every write done before the set is touched
            if uploaded is not None:
                uploaded.synchronize()
            failed = next((err for err in errors if err is not None), None)
            if failed is not None:
                self._unsaved.add(set_index)
                raise failed

    def _write_back(self, set_index: int, sub) -> list:
        views = self._views(set_index, sub)
        self._count(bytes_written=sum(v.numel() * v.element_size() for v in views.values()))
        return [self.swapper.write(self.key(sub, name), views[name]) for name in STATE]

    def _release(self, set_index: int, sub, writes: list, uploaded) -> None:
        self._busy[set_index] = (writes, uploaded)
        self.holds[set_index] = sub
        self._clock += 1
        self._released[set_index] = self._clock

    def _save_unsaved(self) -> None:
        """Write again what failed to be written (raising again, naming the path, while it still fails)."""
        for set_index in sorted(self._unsaved):
            for future in self._write_back(set_index, self.holds[set_index]):
                future.result()
            self._unsaved.discard(set_index)

    def drain(self) -> None:
        """Every write durable (those that failed written again first); the first failure is raised."""
        failed = None
        for i in range(len(self.sets)):
            try:
                self._wait(i)
            except BaseException as err:  # noqa: BLE001 - the other sets are still waited for
                failed = failed or err
        if failed is not None:
            raise failed
        self._save_unsaved()

    def store(self, sub, fill) -> None:
        """Write a subgroup's whole state: `fill(views)` sets the values in a working set first."""
        self._save_unsaved()
        set_index = min(range(len(self.sets)), key=self._released.__getitem__)
        self._wait(set_index)
        self.holds[set_index] = None
        fill(self._views(set_index, sub))
        writes = self._write_back(set_index, sub)
        for future in writes:
            future.result()
        self._release(set_index, sub, [], None)

    # the visit -------------------------------------------------------------------------------------------
    def _order(self, subgroups: list, found: dict) -> list:
        if self.order == "forward":
            return subgroups
        if self.visits % 2:
            subgroups = subgroups[::-1]
        return [s for s in subgroups if id(s) in found] + [s for s in subgroups if id(s) not in found]

    def visit(self, subgroups: list, record_upload: bool = True) -> Iterator:
        """Yield each subgroup with its state bound in `sub.buffers`; write it back after the caller's body."""
        self._save_unsaved()
        found = {id(sub): s for s, sub in enumerate(self.holds) if sub is not None}
        order = self._order(list(subgroups), found)
        cached = {k: found[id(sub)] for k, sub in enumerate(order) if id(sub) in found} \
            if self.order == "alternate" else {}
        free = deque(sorted((s for s in range(len(self.sets)) if s not in cached.values()),
                            key=self._released.__getitem__))  # the longest written back first
        self.visits += 1
        self.last_visit = VisitCounts()
        reads: dict[int, tuple] = {}  # position in the order -> (set, read futures)
        upcoming = 0  # the next position that may need a read

        def prefetch(last: int) -> None:
            nonlocal upcoming
            while upcoming <= min(last, len(order) - 1) and (upcoming in cached or free):
                sub, names = order[upcoming], self.extra  # a set found holding the state reads the extras only
                if upcoming in cached:
                    set_index = cached[upcoming]
                else:
                    set_index, names = free[0], (*STATE, *self.extra)
                    self._wait(set_index)
                    free.popleft()
                    self.holds[set_index] = None
                    self._count(reads=1)
                views = self._views(set_index, sub, names)  # an extra is never written back: no write reads it
                reads[upcoming] = (set_index, [self.swapper.read(self.key(sub, name), into=views[name])
                                               for name in names])
                self._count(bytes_read=sum(v.numel() * v.element_size() for v in views.values()))
                upcoming += 1

        try:
            prefetch(len(self.sets) - 3)
            yield from self._steps(order, cached, reads, prefetch, free, record_upload)
        finally:  # stopped early (an error in the caller's body): no read may still be filling a set
            for _, futures in reads.values():
                for future in futures:
                    future.exception()

    def _steps(self, order, cached, reads, prefetch, free, record_upload) -> Iterator:
        depth = len(self.sets) - 2
        for k, sub in enumerate(order):
            prefetch(k + depth)
            set_index, futures = reads.pop(k)
            if k in cached:
                self._wait(set_index)  # its last write out and its last upload landed: Adam may change it now
                self._count(reads_avoided=1)
            for future in futures:
                future.result()
            self.holds[set_index] = None  # being updated: neither the version on disk nor yet the next
            views = self._views(set_index, sub, (*STATE, *self.extra))
            sub.buffers.update(views)
            try:
                yield sub
            finally:
                for name in views:
                    del sub.buffers[name]
            uploaded = None
            if record_upload:
                uploaded = self.dev.event()
                uploaded.record(self.h2d)  # the set's master may be the source of an upload in flight
            self._release(set_index, sub, self._write_back(set_index, sub), uploaded)
            self._count(subgroups=1)
            free.append(set_index)
