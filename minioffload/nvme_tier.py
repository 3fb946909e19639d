"""The NVMe tier of OffloadAdam: subgroups' fp32 state (master, exp_avg, exp_avg_sq) in files, streamed through
a few pinned working sets while the CPU updates.

    for sub in tier.visit(subgroups):   # sub.buffers holds its state while the loop body runs
        update(sub); upload(sub)        # then its state is written back, and the set is reused

The pipeline with three sets: read subgroup k+1 into one while subgroup k is updated in another and subgroup
k-1 is written from the third. A set is refilled only when its write is durable and the upload that read
its master weights has landed (an event on the H2D stream). With more sets, reads run further ahead.
Gradients and staging stay in pinned host memory (the host needs 4 B/param of gradient plus staging;
the 12 B/param of state go to the disk).

What this is not: a cache; every step reads and writes every subgroup it updates.
"""

from __future__ import annotations

from collections.abc import Iterator

from .layout import STATE


class NvmeTier:
    def __init__(self, swapper, dev, h2d_stream, subgroups: list, buffers: int = 3):  # buffers >= 3: options.py
        self.swapper, self.dev, self.h2d = swapper, dev, h2d_stream
        if swapper.trace is None:
            swapper.trace = dev.trace  # reads and writes show on the nvme_read / nvme_write lanes
        largest = max(sub.numel for sub in subgroups)
        self.sets = [{name: dev.host_empty(largest) for name in STATE} for _ in range(buffers)]
        self._busy: list[tuple | None] = [None] * buffers  # per set: (write futures, upload event) in flight
        self._index = {id(sub): i for i, sub in enumerate(subgroups)}

    def key(self, sub, name: str) -> str:
        return f"subgroup{self._index[id(sub)]}/{name}"

    def _views(self, set_index: int, sub) -> dict:
        return {name: self.sets[set_index][name][:sub.numel] for name in STATE}

    def _wait(self, set_index: int) -> None:
        """The set's previous write is durable and the upload that read it has landed."""
        busy, self._busy[set_index] = self._busy[set_index], None
        if busy is not None:
            writes, uploaded = busy
            for future in writes:
                future.result()
            if uploaded is not None:
                uploaded.synchronize()

    def drain(self) -> None:
        for i in range(len(self.sets)):
            self._wait(i)

    def store(self, sub, fill) -> None:
        """Write a subgroup's whole state: `fill(views)` sets the values in a working set first."""
        self._wait(0)
        views = self._views(0, sub)
        fill(views)
        for future in [self.swapper.write(self.key(sub, name), views[name]) for name in STATE]:
            future.result()

    def visit(self, subgroups: list, record_upload: bool = True) -> Iterator:
        """Yield each subgroup with its state bound in `sub.buffers`; write it back after the caller's body."""
        n, depth = len(self.sets), len(self.sets) - 2
        reads: dict[int, list] = {}

        def prefetch(j: int) -> None:
            if j < len(subgroups):
                self._wait(j % n)
                views = self._views(j % n, subgroups[j])
                reads[j] = [self.swapper.read(self.key(subgroups[j], name), into=views[name]) for name in STATE]

        try:
            for j in range(depth):
                prefetch(j)
            yield from self._steps(subgroups, reads, prefetch, depth, record_upload)
        finally:  # stopped early (an error in the caller's body): no read may still be filling a set
            for futures in reads.values():
                for future in futures:
                    future.exception()

    def _steps(self, subgroups, reads, prefetch, depth, record_upload) -> Iterator:
        n = len(self.sets)
        for k, sub in enumerate(subgroups):
            prefetch(k + depth)
            for future in reads.pop(k):
                future.result()
            views = self._views(k % n, sub)
            sub.buffers.update(views)
            try:
                yield sub
            finally:
                for name in STATE:
                    del sub.buffers[name]
            uploaded = None
            if record_upload:
                uploaded = self.dev.event()
                uploaded.record(self.h2d)  # the set's master may be the source of an upload in flight
            writes = [self.swapper.write(self.key(sub, name), views[name]) for name in STATE]
            self._busy[k % n] = (writes, uploaded)
