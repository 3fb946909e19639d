"""Multi-path NVMe: one swapper's interface over several directories (drives, or a drive and a slower "remote" path),
each subgroup's state on one of them, in proportion to each path's bandwidth (MLP-Offload's multi-path offload).

    fast, slow = Swapper("/mnt/nvme0/run"), Swapper("/mnt/nfs/run", max_bandwidth=0.5e9)  # a throttled "remote"
    with MultiPathSwapper([fast, slow]) as swap:                        # bandwidths measured once, then recorded
        opt = OffloadAdam(params, dev, swapper=swap)

Placement: every key "subgroupN/..." goes to the path of subgroup N, so a subgroup's files stay together. Subgroup N's
path depends on N and the paths' bandwidths only, never on how many subgroups there are or on the order of requests:
Tijdeman's chairman assignment (largest remainder, restricted to the paths that are owed at least 1/(2k-2) of a
subgroup), which keeps every prefix 0..N-1 within 1 - 1/(2k-2) subgroups of each path's exact share for k paths. Plain
largest remainder can drift past one subgroup with four or more paths. Other keys go where the xxHash of their first
"/"-part falls in the same shares. The same paths and bandwidths give the same placement in every process, so a
restarted run finds its files.

Bandwidths: given (any unit: only the ratios count), or, when None, measured once through each path's own swapper
with nvme_tune.measure on a small file (`measure_bytes`): the harmonic mean of its write and read GB/s, the rate at
which a step that writes and reads the same bytes moves them. Either way they are recorded in each directory
(multipath.json); a later MultiPathSwapper over the same directories with bandwidths=None reuses them instead of
measuring again (a new measurement would move subgroups), and one given other bandwidths while files are stored
is refused.

Concurrency: at most `in_flight` requests (reads and writes) are started on each path; further ones wait in that
path's queue, in order, and start as earlier ones finish, so the caller never blocks when it issues one.

What this is not: striping (a subgroup's bytes are never split across paths), or a cache.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch
import xxhash

from ..pinned import aligned_empty
from .swapper import Swapper
from .tune import measure

RECORD = "multipath.json"
_SUBGROUP_KEY = re.compile(r"subgroup(\d+)/")


def chairman_assignment(shares: Sequence[float], count: int) -> list[int]:
    """The path of each of the first `count` subgroups for paths with these `shares` (positive, summing to 1)."""
    k = len(shares)
    owed_enough = 1 / (2 * k - 2) if k > 1 else 0.0
    counts, placed = [0] * k, []
    for n in range(1, count + 1):
        owed = [shares[p] * n - counts[p] for p in range(k)]
        candidates = [p for p in range(k) if owed[p] >= owed_enough - 1e-12] or list(range(k))
        path = min(candidates, key=lambda p: ((counts[p] + 1 - owed_enough) / shares[p], p))
        counts[path] += 1
        placed.append(path)
    return placed


class _Gate:
    """At most `limit` requests started on one path; the others wait here, first in, first out."""

    def __init__(self, limit: int):
        self.limit, self.running, self.peak = limit, 0, 0
        self._waiting: deque[tuple[Callable[[], Future], Future]] = deque()
        self._idle = threading.Condition()

    def submit(self, start: Callable[[], Future]) -> Future:
        with self._idle:
            if self.running >= self.limit:
                outer = Future()
                self._waiting.append((start, outer))
                return outer
            self._take()
        try:
            inner = start()  # started at once: its errors reach the caller directly
        except BaseException:
            self._finished(None)
            raise
        inner.add_done_callback(self._finished)
        return inner

    def _take(self) -> None:
        self.running += 1
        self.peak = max(self.peak, self.running)

    def _finished(self, _) -> None:
        with self._idle:
            if not self._waiting:
                self.running -= 1
                self._idle.notify_all()
                return
            start, outer = self._waiting.popleft()  # takes over the finished request's place
        try:
            inner = start()
        except BaseException as err:  # noqa: BLE001 - handed to the caller through its future
            outer.set_exception(err)
            self._finished(None)
            return
        inner.add_done_callback(lambda done: _copy(done, outer))
        inner.add_done_callback(self._finished)

    def wait_idle(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self.running == 0)


def _copy(done: Future, outer: Future) -> None:
    if done.exception() is not None:
        outer.set_exception(done.exception())
    else:
        outer.set_result(done.result())


class MultiPathSwapper:
    """The Swapper's interface (write, read, keys, current_file, index, trace, close, a context manager) over
    several paths. `paths`: Swappers (a throttled one models a slower path) or directories (Swappers are made with
    `swapper_options`); `bandwidths`: one positive number per path, or None to measure (see the module docstring);
    `in_flight`: requests started at once per path. Closing it closes every path's swapper."""

    def __init__(self, paths: Sequence, bandwidths: Sequence[float] | None = None, in_flight: int = 4,
                 measure_bytes: int = 16 << 20, **swapper_options):
        if isinstance(paths, (str, os.PathLike)) or not isinstance(paths, Sequence) or not paths:
            raise ValueError(f"paths must be a non-empty list of Swappers or directories, got {paths!r}")
        if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 1:
            raise ValueError(f"in_flight must be an int >= 1 (requests started at once per path), got {in_flight!r}")
        self.paths = [self._swapper(path, swapper_options) for path in paths]
        directories = [getattr(path, "directory", None) for path in self.paths]
        known = [Path(d).resolve() for d in directories if d is not None]
        if len(set(known)) != len(known):
            raise ValueError(f"the same directory is given twice in {[str(d) for d in directories]}: give each path "
                             "once")
        self.bandwidths = self._bandwidths(bandwidths, measure_bytes)
        total = sum(self.bandwidths)
        self.shares = [b / total for b in self.bandwidths]
        self._gates = [_Gate(in_flight) for _ in self.paths]
        self._placed: list[int] = []
        self._lock = threading.Lock()
        self._writing: dict[str, int] = {}  # keys with a write issued and not yet done: a read of them may follow

    @staticmethod
    def _swapper(path, options: dict):
        if hasattr(path, "write") and hasattr(path, "read"):
            return path
        if isinstance(path, (str, os.PathLike)):
            return Swapper(path, **options)
        raise TypeError(f"each path must be a Swapper or a directory, got {type(path).__name__}")

    # placement -------------------------------------------------------------------------------------------
    def path_of(self, key: str) -> int:
        """The index of the path that stores `key` (the same in every process for the same bandwidths)."""
        match = _SUBGROUP_KEY.match(key)
        if match:
            subgroup = int(match[1])
            with self._lock:
                if len(self._placed) <= subgroup:
                    self._placed = chairman_assignment(self.shares, max(subgroup + 1, 2 * len(self._placed)))
                return self._placed[subgroup]
        spot = xxhash.xxh3_64_intdigest(key.split("/")[0].encode()) / 2 ** 64
        edges = [sum(self.shares[:p + 1]) for p in range(len(self.shares))]
        return next((p for p, edge in enumerate(edges) if spot < edge), len(edges) - 1)

    def assignment(self, subgroups: int) -> list[int]:
        """The path of each of subgroups 0 .. subgroups-1."""
        return [self.path_of(f"subgroup{n}/") for n in range(subgroups)]

    # the Swapper's interface ----------------------------------------------------------------------------
    def write(self, key: str, tensor: torch.Tensor, durable: bool = True) -> Future:
        """Store `tensor` under `key` on its path (see Swapper.write); queued if that path is busy."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty string, got {key!r}")
        path = self.path_of(key)
        with self._lock:
            self._writing[key] = self._writing.get(key, 0) + 1
        scratch = {} if durable else {"durable": False}  # the keyword only where it is asked for
        try:
            future = self._gates[path].submit(lambda: self.paths[path].write(key, tensor, **scratch))
        except BaseException:
            self._written(key)
            raise
        future.add_done_callback(lambda _: self._written(key))
        return future

    def _written(self, key: str) -> None:
        with self._lock:
            self._writing[key] -= 1
            if not self._writing[key]:
                del self._writing[key]

    def read(self, key: str, into: torch.Tensor) -> Future:
        """Read `key` from its path into `into` (see Swapper.read); queued if that path is busy."""
        path = self.path_of(key)
        with self._lock:
            pending = key in self._writing
        if not pending and key not in self.paths[path].index:
            elsewhere = [p for p, swapper in enumerate(self.paths) if key in swapper.index]
            hint = (f"; it is stored on path {elsewhere[0]} ({self._name(elsewhere[0])}): the paths or bandwidths "
                    "differ from the run that wrote it" if elsewhere else "")
            raise KeyError(f"no tensor stored under {key!r} on path {path} ({self._name(path)}){hint}")
        return self._gates[path].submit(lambda: self.paths[path].read(key, into=into))

    def keys(self) -> list[str]:
        return sorted(key for swapper in self.paths for key in swapper.keys())

    @property
    def index(self) -> dict[str, dict]:
        """Every path's index entries, merged (a copy)."""
        return {key: entry for swapper in self.paths for key, entry in dict(swapper.index).items()}

    def current_file(self, key: str) -> Path:
        return self.paths[self.path_of(key)].current_file(key)

    @property
    def trace(self):
        return self.paths[0].trace

    @trace.setter
    def trace(self, trace) -> None:
        for swapper in self.paths:
            swapper.trace = trace

    @property
    def peak_in_flight(self) -> list[int]:
        """The most requests that were ever started at once, per path."""
        return [gate.peak for gate in self._gates]

    def close(self) -> None:
        """Wait for every queued request, then close every path's swapper."""
        for gate in self._gates:
            gate.wait_idle()
        for swapper in self.paths:
            swapper.close()

    def __enter__(self) -> MultiPathSwapper:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # bandwidths -------------------------------------------------------------------------------------------
    def _name(self, path: int) -> str:
        return str(getattr(self.paths[path], "directory", f"path {path}"))

    def _bandwidths(self, given: Sequence[float] | None, measure_bytes: int) -> list[float]:
        if given is not None:
            given = list(given)
            if len(given) != len(self.paths) or not all(
                    isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b < math.inf for b in given):
                raise ValueError(f"bandwidths must be one positive number per path ({len(self.paths)}), got {given!r}")
        recorded = self._recorded()
        if given is None and recorded is not None:
            return recorded
        if given is not None and recorded is not None and recorded != given and any(p.keys() for p in self.paths):
            raise ValueError(f"these paths hold files placed with bandwidths {recorded}; other bandwidths ({given}) "
                             "would look for subgroups on other paths. Pass bandwidths=None (or the recorded ones) "
                             "to find them, or start from empty directories")
        bandwidths = given if given is not None else [self._measure(p, measure_bytes) for p in self.paths]
        if bandwidths != recorded:
            self._record(bandwidths)
        return bandwidths

    def _recorded(self) -> list[float] | None:
        """The bandwidths recorded in the paths' directories, if any (every record must fit these paths)."""
        records = {}
        for position, swapper in enumerate(self.paths):
            file = Path(getattr(swapper, "directory", "")) / RECORD
            if getattr(swapper, "directory", None) is not None and file.exists():
                try:
                    records[position] = json.loads(file.read_text())
                except (OSError, ValueError) as err:
                    raise ValueError(f"cannot read {file} ({err}): delete it, and give the bandwidths of the run "
                                     "that wrote these paths (or let them be measured again)") from err
        if not records:
            return None
        bandwidths = next(iter(records.values())).get("bandwidths")
        for position, record in records.items():
            if record != {"paths": len(self.paths), "position": position, "bandwidths": bandwidths}:
                raise ValueError(f"{Path(self._name(position)) / RECORD} was written for other paths (or another "
                                 f"order): {record}; give the paths of that run in its order, or empty directories")
        return bandwidths

    def _record(self, bandwidths: list[float]) -> None:
        for position, swapper in enumerate(self.paths):
            directory = getattr(swapper, "directory", None)
            if directory is None:
                continue
            temporary = Path(directory) / f".{RECORD}.tmp"
            temporary.write_text(json.dumps({"paths": len(self.paths), "position": position,
                                             "bandwidths": bandwidths}))
            os.replace(temporary, Path(directory) / RECORD)

    @staticmethod
    def _measure(swapper, nbytes: int) -> float:
        """Bytes/s through this path's own settings (its throttle included), in a scratch directory inside it."""
        directory = getattr(swapper, "directory", None)
        if directory is None:
            raise ValueError(f"cannot measure a path without a directory ({type(swapper).__name__}): give bandwidths")
        scratch = Path(directory) / ".minioffload-measure"
        scratch.mkdir(exist_ok=True)
        data, back = aligned_empty(nbytes, pin=False), aligned_empty(nbytes, pin=False)
        data.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))  # not zeros: some disks compress
        try:
            got = measure(scratch, data, back, block_size=swapper.block_size, workers=swapper.workers,
                          direct=swapper.direct, max_bandwidth=swapper.max_bandwidth)
        finally:
            for file in scratch.iterdir():
                file.unlink()
            scratch.rmdir()
        return 2e9 / (1 / got["write_GBps"] + 1 / got["read_GBps"])
