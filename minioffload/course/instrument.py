"""Where one training iteration spends device memory and link bytes, phase by phase (chapter 5's observations).

    windows = {"forward": (t0, t1), "backward": (t1, t2), "update": (t2, t3)}   # trace seconds
    link_bytes_by_phase(trace, windows)       # {"forward": {"h2d": ..., "d2h": ...}, ...}
    device_memory_series(dev)                 # (seconds on the trace's clock, bytes in use) from the ledger
    utilisation_by_phase(dev, windows)        # mean and peak share of device capacity in use per phase

A copy that straddles two phases is split between them in proportion to its time in each. Memory comes
from the device's ledger (what the runtime holds and adopts), not from the allocator: on CUDA, activations
that autograd saves are not in it unless adopted (chapter 5 adopts them with saved-tensor hooks).

What this is not: a profiler; it reads what the trace and the ledger already recorded.
"""

from __future__ import annotations

import numpy as np

from ..trace import Trace
from .viz.memory_plot import usage_series


def link_bytes_by_phase(trace: Trace, windows: dict[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
    """Bytes over each link direction (h2d, d2h) during each phase window (trace seconds)."""
    for phase, (start, end) in windows.items():
        if not end >= start:
            raise ValueError(f"phase {phase!r} needs start <= end, got ({start}, {end})")
    moved = {phase: {"h2d": 0.0, "d2h": 0.0} for phase in windows}
    for lane in ("h2d", "d2h"):
        for span in trace.on(lane):
            for phase, (start, end) in windows.items():
                inside = max(0.0, min(span.end, end) - max(span.start, start))
                if span.duration > 0:
                    moved[phase][lane] += span.nbytes * inside / span.duration
                elif start <= span.start < end:
                    moved[phase][lane] += span.nbytes
    return moved


def device_memory_series(dev) -> tuple[np.ndarray, np.ndarray]:
    """Device bytes in use after each ledger event, with times on `dev.trace`'s clock (seconds)."""
    history = dev.ledger.history
    seconds, used = usage_series(dev.ledger, "device")
    if not history:
        return seconds, used
    # usage_series counts from the ledger's first event; the ledger and the trace both read perf_counter
    return seconds + (history[0].time - dev.trace.origin), used


def utilisation_by_phase(dev, windows: dict[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
    """Mean (time-weighted) and peak share of the device's capacity in use during each phase."""
    capacity = dev.ledger.capacity("device")
    seconds, used = device_memory_series(dev)
    result = {}
    for phase, (start, end) in windows.items():
        # the level in force at `start` is the last event at or before it
        before = np.searchsorted(seconds, start, side="right") - 1
        times = np.concatenate([[start], seconds[(seconds > start) & (seconds < end)], [end]])
        levels = np.concatenate([[used[max(before, 0)]], used[(seconds > start) & (seconds < end)]])
        span = end - start
        mean = float(np.sum(levels * np.diff(times)) / span) if span > 0 else float(levels[0])
        result[phase] = {"mean": mean / capacity, "peak": float(levels.max()) / capacity}
    return result
