"""Spans of work on lanes, and what they add up to.

Every stream op of a device records a `Span` (lane, name, start, end, bytes) into a `Trace`. From
the spans: busy time per lane (overlapping spans on one lane count once), the overlap fraction
(how much of the time two or more lanes were busy at once), achieved bandwidth per lane, and an
export to Chrome/Perfetto trace-event JSON (open it in ui.perfetto.dev or chrome://tracing).

What this is not: a profiler. It records what the runtime tells it, nothing else. Times are seconds
from the trace's origin.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# The order lanes are drawn in, in every chapter; lanes not listed follow in order of appearance.
LANE_ORDER = ("host", "h2d", "compute", "d2h", "cpu", "nvme_read", "nvme_write")


@dataclass(frozen=True)
class Span:
    lane: str
    name: str
    start: float  # seconds from the trace origin
    end: float
    nbytes: int = 0

    @property
    def duration(self) -> float:
        return self.end - self.start

    def overlaps(self, other: Span) -> bool:
        """Do the two spans share some time (touching ends do not count)?"""
        return self.start < other.end and other.start < self.end


def _refuse(lane: str, name: str, start: float, end: float, nbytes: int) -> None:
    """Why a span cannot be recorded (raises ValueError)."""
    if not start <= end:  # also refuses NaN
        raise ValueError(f"span {name!r} on {lane!r} needs finite start <= end, got {start} and {end}")
    raise ValueError(f"span {name!r} on {lane!r} cannot move {nbytes} bytes")


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by a set of intervals (overlaps counted once)."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        elif end > current_end:  # max(current_end, end), without the call
            current_end = end
    if current_end is not None:
        total += current_end - current_start
    return total


@dataclass
class Trace:
    """A thread-safe list of spans with summaries. Times are `time.perf_counter()` seconds minus `origin`."""

    spans: list[Span] = field(default_factory=list)
    origin: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def record(self, lane: str, name: str, start: float, end: float, nbytes: int = 0) -> Span:
        if not start <= end or nbytes < 0:  # also refuses NaN
            _refuse(lane, name, start, end, nbytes)
        span = Span(lane, name, start, end, int(nbytes))
        with self._lock:
            self.spans.append(span)
        return span

    def record_many(self, spans: Iterable[tuple[str, str, float, float, int]]) -> None:
        """`record` each (lane, name, start, end, nbytes) of `spans`, in order, under one lock (a predicted step
        records thousands); if one is refused, none is recorded."""
        checked = []
        for lane, name, start, end, nbytes in spans:
            if not start <= end or nbytes < 0:
                _refuse(lane, name, start, end, nbytes)
            checked.append(Span(lane, name, start, end, int(nbytes)))
        with self._lock:
            self.spans.extend(checked)

    @contextmanager
    def span(self, lane: str, name: str, nbytes: int = 0) -> Iterator[None]:
        """Record the time the `with` body takes as one span."""
        start = self.now()
        try:
            yield
        finally:
            self.record(lane, name, start, self.now(), nbytes)

    def clear(self) -> None:
        with self._lock:
            self.spans.clear()
            self.origin = time.perf_counter()

    # summaries -------------------------------------------------------------------------------
    def lanes(self) -> list[str]:
        seen = list(dict.fromkeys(s.lane for s in self.spans))
        return [lane for lane in LANE_ORDER if lane in seen] + [lane for lane in seen
                                                                if lane not in LANE_ORDER]

    def on(self, lane: str) -> list[Span]:
        return [s for s in self.spans if s.lane == lane]

    def busy(self, lane: str) -> float:
        """Seconds `lane` was doing something (overlapping spans on the lane count once)."""
        return union_length((s.start, s.end) for s in self.on(lane))

    def makespan(self) -> float:
        """From the first span's start to the last span's end."""
        if not self.spans:
            return 0.0
        return max(s.end for s in self.spans) - min(s.start for s in self.spans)

    def busiest_lane(self) -> tuple[str, float]:
        return max(((lane, self.busy(lane)) for lane in self.lanes()), key=lambda x: x[1], default=("", 0.0))

    def overlap_fraction(self) -> float:
        """Of the time any lane was busy, the fraction in which two or more lanes were busy at once."""
        # Sweep the span edges in time order, counting the spans open on each lane: O(n log n).
        points = sorted((t, step, s.lane) for s in self.spans if s.end > s.start
                        for t, step in ((s.start, 1), (s.end, -1)))
        open_on: Counter[str] = Counter()  # lane -> spans open on it now
        any_busy = both_busy = 0.0
        previous = points[0][0] if points else 0.0
        for t, step, lane in points:
            if len(open_on) >= 1:
                any_busy += t - previous
            if len(open_on) >= 2:
                both_busy += t - previous
            open_on[lane] += step
            if not open_on[lane]:
                del open_on[lane]
            previous = t
        return both_busy / any_busy if any_busy else 0.0

    def bandwidth(self, lane: str) -> float:
        """Bytes per second achieved on `lane`: its bytes over its busy time (0 if idle)."""
        busy = self.busy(lane)
        return sum(s.nbytes for s in self.on(lane)) / busy if busy else 0.0

    def summary(self) -> str:
        lines = [f"{'lane':<11}{'spans':>6}{'busy ms':>10}{'GB/s':>8}"]
        for lane in self.lanes():
            bw = self.bandwidth(lane)
            lines.append(f"{lane:<11}{len(self.on(lane)):>6}{self.busy(lane) * 1e3:>10.2f}"
                         f"{(f'{bw / 1e9:.2f}' if bw else '-'):>8}")
        lines.append(f"makespan {self.makespan() * 1e3:.2f} ms, overlap {self.overlap_fraction():.0%}")
        return "\n".join(lines)

    # export ----------------------------------------------------------------------------------
    def to_chrome(self) -> dict:
        """Chrome trace-event format: one complete ("X") event per span, one thread per lane."""
        lanes = self.lanes()
        events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0,
                               "args": {"name": "minioffload"}}]
        for tid, lane in enumerate(lanes, 1):
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": tid,
                           "args": {"sort_index": tid}})
        for s in sorted(self.spans, key=lambda s: s.start):
            events.append({"name": s.name, "cat": s.lane, "ph": "X", "pid": 1, "tid": lanes.index(s.lane) + 1,
                           "ts": s.start * 1e6, "dur": s.duration * 1e6, "args": {"bytes": s.nbytes}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def save(self, path: str | Path) -> Path:
        """Write the Chrome/Perfetto JSON to `path` and return it."""
        path = Path(path)
        path.write_text(json.dumps(self.to_chrome()))
        return path
