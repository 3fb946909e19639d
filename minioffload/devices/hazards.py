"""The simulated device's hazard checker: the course's compute-sanitizer for stream ordering.

A GPU runs the work of different streams in any order unless an event orders it; the sim, whose threads are
kind, often runs it in the "right" order anyway, so a missing wait passes here and corrupts data on a GPU.
In strict mode (`SimDevice(strict=True)`) every copy and launch is checked when it is issued:

* **streams**: work on one stream that writes bytes another stream's work may still read or write (or reads
  bytes it may still write), with no event wait between them, raises `HazardError` naming both streams, the
  tensor and the wait to add;
* **pinned buffers**: a device-to-host copy fills its pinned destination with NaN while it runs and writes the
  bytes at its end, so a host that reads it while the copy runs reads NaN; a host-to-device copy checks that its
  pinned source did not change while the copy ran (the host wrote it while the DMA could still read it), and
  fails the stream if it did. Neither sees the host act between issue and start: the sim cannot tell that from
  device-side work an event orders before the copy (the vector clocks see that work, not the host's).

* **compute**: the sim's compute is the host thread, so the checker cannot see each torch op. The runtime names
  what compute reads and writes where it matters (`dev.uses(what, reads=, writes=)`: the weights a block's forward
  reads, the gradient backward wrote, the activation backward reads, the staged gradient the CPU Adam reads).
  Such a use is checked like a stream's op, and a use of device memory is remembered as compute's, because on a
  GPU compute is queued work too: a copy stream that writes what compute read, or reads what it wrote, must wait
  for compute first (`dev.stream_waits_for_compute`).

* **a GPU that lags** (`lags`, on with strict): on a GPU the host runs ahead of compute, and the caching allocator
  hands memory compute freed to the next allocation on the compute stream at once, while compute work queued
  before the free may still use it. So device memory the runtime allocates (`dev.empty`, `restore_storage`) while
  compute has work the host has not waited for counts as written by that work: a copy stream that writes it (a
  prefetch) must first wait for compute (`dev.stream_waits_for_compute`, after the allocation). And
  `dev.compute_waits_for(event)` orders compute only: the host must wait itself (`event.synchronize()`) before it
  touches host memory the event's work reads or writes.

How "may still" is decided: vector clocks. Each stream counts its ops, and so does compute; an event carries the
clock of its stream when recorded; `stream.wait(event)` merges it; the host's clock holds what it has waited for
(an event, a stream, the device); an op issued after the host waited for some work is ordered after it, as on a
GPU. Every check is made when the work is issued, from counts alone, so a missing wait raises in every run,
however the threads happen to be scheduled.

What this is not: a checker of every torch op compute runs (only the uses the runtime names), nor of launches'
inner accesses beyond their tensor arguments (taken as read and written). The sim's compute really is done when the
host moves on; the lag is in the rules, which hold every run to what a GPU that runs behind would allow.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

COMPUTE = "compute"  # the checker's name for the compute stream (the sim's host thread)
ALLOCATION = "its allocation on the compute stream"  # what compute did to memory it handed out (with `lags`)


class HazardError(RuntimeError):
    """Work that a GPU could run in the wrong order: the message names the streams, the tensor and the fix."""


def merge(a: dict, b: dict) -> dict:
    return {k: max(a.get(k, 0), b.get(k, 0)) for k in a.keys() | b.keys()}


def ordered_before(stamp: dict, clock: dict) -> bool:
    """Is work stamped `stamp` (one agent's count) known to be done before work with `clock`?"""
    (agent, count), = stamp.items()
    return clock.get(agent, 0) >= count


@dataclass
class _Access:
    lo: int
    hi: int
    agent: str
    stamp: dict  # {agent: count}
    writes: bool
    what: str
    kept: bool = False  # its memory is kept alive for its stream (record_stream): not handed out before it runs
    storage: int = 0  # compute's uses: the device storage's address (forgotten when that memory is freed)
    host: bool = False  # of host memory: once freed, its work has run (the sim's queued ops hold their tensors)


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


def tensors_in(values) -> list[torch.Tensor]:
    """The tensors among launch arguments (in lists, tuples, dict values and objects' tensors, one level)."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            found += tensors_in(value.values())
        elif isinstance(value, (list, tuple)):
            found += tensors_in(value)
    return found


class Checker:
    """Vector clocks of the host and of each stream, and the recent accesses to device and pinned memory."""

    def __init__(self, describe, lags: bool = True, on_device=lambda tensor: True):
        self._describe = describe  # tensor -> a name for messages
        self._on_device = on_device  # tensor -> is it device memory?
        self.lags = lags  # hold the runtime to a GPU that runs behind the host (see the module's docstring)
        self._lock = threading.RLock()  # a tensor that dies while it is held releases its memory here too
        self.host: dict = {}
        self.compute = 0  # how many uses compute has made (its clock's own count)
        self.compute_waited: dict = {}  # what compute waited for (dev.compute_waits_for): not the host, with `lags`
        self._accesses: list[_Access] = []

    # clocks -----------------------------------------------------------------------------------
    def issue(self, stream) -> dict:
        """Count one op on `stream`; returns its clock (the op's own stamp is clock[stream.name])."""
        with self._lock:
            clock = merge(getattr(stream, "_clock", {}), self.host)  # what the host waited for is done
            clock[stream._agent] = clock.get(stream._agent, 0) + 1
            stream._clock = clock
            return dict(clock)

    def record(self, event, stream) -> None:
        with self._lock:
            event._clock = merge(getattr(stream, "_clock", {}), self.host)

    def stream_waits(self, stream, event) -> None:
        with self._lock:
            stream._clock = merge(getattr(stream, "_clock", {}), getattr(event, "_clock", {}))

    def host_waits(self, clock: dict) -> None:
        with self._lock:
            self.host = merge(self.host, clock)
            # work the host has waited for is ordered before everything issued from now on
            self._accesses = [a for a in self._accesses if not ordered_before(a.stamp, self.host)]

    def stream_waits_for_host(self, stream) -> None:
        """`stream` waits for compute issued so far (and for what the host and compute have waited for)."""
        with self._lock:
            stream._clock = merge(getattr(stream, "_clock", {}), self._compute_clock())

    def compute_waits(self, event) -> None:
        """Compute waits for `event` (dev.compute_waits_for). With `lags` only compute does: the host runs on, so host
        memory the event's work touches is not yet safe for the host (it must wait itself: event.synchronize())."""
        if not self.lags:
            self.host_waits(getattr(event, "_clock", {}))
            return
        with self._lock:
            self.compute_waited = merge(self.compute_waited, getattr(event, "_clock", {}))

    def host_waits_for_compute(self) -> None:
        """The host waited for the whole device, compute included."""
        self.host_waits(self._compute_clock())

    def _compute_clock(self) -> dict:
        return merge(merge(self.host, self.compute_waited), {COMPUTE: self.compute})

    # accesses ---------------------------------------------------------------------------------
    def kept_alive(self, tensor: torch.Tensor, stream) -> None:
        """`tensor`'s memory is not handed out again before `stream`'s work so far has run (dev.keep_alive)."""
        lo, hi = _span(tensor)
        with self._lock:
            for old in self._accesses:
                if old.agent == stream._agent and old.lo < hi and lo < old.hi:
                    old.kept = True

    def allocated(self, tensor: torch.Tensor, by_runtime: bool = True) -> None:
        """New device memory: the work its old memory was kept alive for has run (else it would not be free), and so has
        the work that used it as host memory (the sim's queued ops hold their host tensors until they run). Memory
        the runtime allocates (`by_runtime`: dev.empty, restore_storage) is the compute stream's: a caching allocator
        hands it memory compute freed, ordered after compute's uses of the old on that stream. With `lags`, while
        compute has work the host has not waited for, the allocation counts as a write by that work (it may still
        use the memory), which another stream must wait for before touching it. (Memory autograd made, adopted:
        compute's next uses are its own.)"""
        lo, hi = _span(tensor)
        with self._lock:
            self._accesses = [a for a in self._accesses if not (
                (a.kept or a.host or (by_runtime and a.agent == COMPUTE)) and a.lo < hi and lo < a.hi)]
            if self.lags and by_runtime and lo < hi and self.compute > self.host.get(COMPUTE, 0):
                # compute has work the host has not waited for: the memory may be what that work freed
                self._accesses.append(_Access(lo, hi, COMPUTE, {COMPUTE: self.compute}, True, ALLOCATION,
                                              storage=tensor.untyped_storage().data_ptr()))

    def uses(self, reads: list[torch.Tensor], writes: list[torch.Tensor], what: str, on_device) -> None:
        """Compute (or the host itself, for host memory) reads and writes these tensors now: raise HazardError if a
        stream's work on them is not ordered before; remember the device ones as compute's."""
        with self._lock:
            self.compute += 1
            # device memory is compute's to use, ordered by what compute waited for; host memory is the host's
            on_compute, on_host = self._compute_clock(), merge(self.host, {COMPUTE: self.compute})
            new = [(t, False) for t in reads] + [(t, True) for t in writes]
            for tensor, writes_it in new:
                old = self._unordered(tensor, writes_it, on_compute if on_device(tensor) else on_host, COMPUTE)
                if old is not None:
                    raise HazardError(
                        f"{what} {'writes' if writes_it else 'reads'} {self._describe(tensor)}, which "
                        f"{old.what} on stream {old.agent!r} may still {'write' if old.writes else 'read'}: "
                        f"nothing orders that work before this. Record an event on {old.agent!r} after it "
                        f"and wait for it first (dev.compute_waits_for(event), or event.synchronize() on "
                        f"the host)")
            for tensor, writes_it in new:
                lo, hi = _span(tensor)
                if lo < hi and on_device(tensor):
                    self._accesses.append(_Access(lo, hi, COMPUTE, {COMPUTE: self.compute}, writes_it, what,
                                                  storage=tensor.untyped_storage().data_ptr()))

    def fresh(self, tensor: torch.Tensor) -> None:
        """New host memory: whatever work used these addresses before held its memory until it ran (the sim's queued
        ops hold their tensors), so none of it can still touch them."""
        lo, hi = _span(tensor)
        with self._lock:
            self._accesses = [a for a in self._accesses if not (a.lo < hi and lo < a.hi)]

    def released(self, storage: int) -> None:
        """Device memory was freed: compute's uses of it are forgotten. (Memory handed out again is a new tensor;
        whether a side stream may write it before compute is done with the old is for a simulator that lags.)"""
        with self._lock:
            self._accesses = [a for a in self._accesses if not (a.agent == COMPUTE and a.storage == storage)]

    def _unordered(self, tensor: torch.Tensor, writes_it: bool, clock: dict, agent: str) -> _Access | None:
        """An earlier access by another agent that overlaps `tensor`, conflicts (one of the two writes) and is not
        ordered before `clock`; None if there is none. Called with the lock held."""
        lo, hi = _span(tensor)
        if lo == hi:
            return None
        for old in self._accesses:
            if old.agent != agent and old.lo < hi and lo < old.hi and (writes_it or old.writes) \
                    and not ordered_before(old.stamp, clock):
                return old
        return None

    def access(self, stream, clock: dict, reads: list[torch.Tensor], writes: list[torch.Tensor], op: str) -> None:
        """Check an op's reads and writes against earlier unordered ones; raise HazardError, or remember them."""
        stamp = {stream._agent: clock[stream._agent]}
        new = [(t, False) for t in reads] + [(t, True) for t in writes]
        with self._lock:
            for tensor, writes_it in new:
                old = self._unordered(tensor, writes_it, clock, stream._agent)
                if old is not None and old.what == ALLOCATION:
                    raise HazardError(
                        f"{op} on stream {stream.name!r} {'writes' if writes_it else 'reads'} "
                        f"{self._describe(tensor)}, which the compute stream allocated after work this stream has "
                        "not waited for: a caching allocator hands memory compute freed to the next allocation at "
                        "once, and on a GPU compute queued before the free may still be using it. Call "
                        f"dev.stream_waits_for_compute({stream.name!r} stream) after allocating and before this")
                if old is not None:
                    raise HazardError(
                        f"{op} on stream {stream.name!r} {'writes' if writes_it else 'reads'} "
                        f"{self._describe(tensor)}, which {old.what} on stream {old.agent!r} may still "
                        f"{'write' if old.writes else 'read'}: nothing orders that work before this. "
                        + (f"Call dev.stream_waits_for_compute({stream.name!r} stream) before issuing this"
                           if old.agent == COMPUTE else
                           f"Record an event on {old.agent!r} after it and call stream.wait(event) on "
                           f"{stream.name!r} (or wait for it on the host) before issuing this"))
            for tensor, writes_it in new:
                lo, hi = _span(tensor)
                if lo < hi:
                    self._accesses.append(_Access(lo, hi, stream._agent, stamp, writes_it, op,
                                                  host=not self._on_device(tensor)))
