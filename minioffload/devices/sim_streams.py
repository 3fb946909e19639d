"""The simulated GPU's streams and events (devices/sim.py holds the device that makes them).

A `SimStream` is an in-order queue of ops run by one worker thread; an op gets the model time its stream allows
and returns the model time it ended. A `SimEvent` marks a point in a stream; the host or another stream waits for
it. Both report their ordering to the device's hazard checker when it is strict (devices/hazards.py).

What this is not: a device (memory, copies, launches: device_sim.SimDevice).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch


def sleep_until(at: float) -> None:
    """Sleep until model time `at` (time.perf_counter seconds)."""
    remaining = at - time.perf_counter()
    if remaining > 0:
        time.sleep(remaining)


class SimEvent:
    """A marker in a stream. Re-recording moves the marker; a wait sees the record made before it."""

    def __init__(self, dev, timing: bool = False):
        self._dev, self.timing = dev, timing  # timing: elapsed_ms may read it (as on CUDA, where it costs)
        self._cond = threading.Condition()
        self._recorded = 0  # records requested by the host
        self._fired = 0  # records a stream has reached
        self._times: dict[int, float] = {}  # record generation -> model time (perf_counter s) it was reached
        self.time: float | None = None  # trace time when the latest record was reached

    def record(self, stream: SimStream) -> None:
        with self._cond:
            self._recorded += 1
            generation = self._recorded
        if self._dev.hazards:
            self._dev.hazards.record(self, stream)
        stream._enqueue(lambda floor: self._fire(generation, floor))

    def _fire(self, generation: int, at: float) -> float:
        with self._cond:
            self._fired = max(self._fired, generation)
            self._times[generation] = at
            self.time = at - self._dev.trace.origin
            self._cond.notify_all()
        return at

    def _time_of(self, generation: int) -> float:
        with self._cond:
            return self._times[generation]

    def _target(self, waiter: str) -> int:
        with self._cond:
            if not self._recorded:
                raise RuntimeError(f"{waiter} waits on an event that was never recorded, so it would wait for "
                                   "nothing (CUDA silently would); call event.record(stream) first")
            return self._recorded

    def _wait_for(self, generation: int, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._fired >= generation, timeout)

    def query(self) -> bool:
        """True when the latest record has been reached (False if never recorded)."""
        with self._cond:
            return bool(self._recorded) and self._fired >= self._recorded

    def synchronize(self, timeout: float | None = 60.0) -> None:
        """Block the host until the latest record is reached."""
        if not self._wait_for(self._target("the host"), timeout):
            raise TimeoutError(f"event not reached within {timeout} s: is its stream waiting on something that "
                               "never happens?")
        if self._dev.hazards:
            self._dev.hazards.host_waits(getattr(self, "_clock", {}))
        self._dev._raise_stream_error()

    def elapsed_ms(self, end: SimEvent) -> float:
        """Milliseconds from this event to `end` (both reached, both made with `dev.event(timing=True)`)."""
        if not (self.timing and end.timing):
            raise RuntimeError("elapsed_ms needs two timing events: make both with dev.event(timing=True) (an "
                               "event from dev.event() orders work and records no time)")
        if self.time is None or end.time is None:
            raise RuntimeError("elapsed_ms needs both events recorded and reached; synchronize first")
        return (end.time - self.time) * 1e3


class SimStream:
    """An in-order queue of work run by one worker thread."""

    def __init__(self, dev, name: str):
        self.name, self._dev = name, dev
        self._agent = f"{name} #{len(dev._streams)}"  # unique: the hazard checker's name for this stream
        self._queue: queue.Queue[tuple[Callable[[float], float], float] | None] = queue.Queue()
        self._model_time = 0.0  # model time (time.perf_counter seconds) at which this stream's last op ended
        self._thread = threading.Thread(target=self._run, name=f"sim-stream-{name}", daemon=True)
        self._thread.start()

    def _enqueue(self, op: Callable[[float], float]) -> None:
        """Queue `op(floor) -> end`: floor is the earliest model time it may start, end its model end."""
        if self._dev.closed:
            raise RuntimeError("this sim device is closed; create a new one")
        self._queue.put((op, time.perf_counter()))

    def _run(self) -> None:
        # A GPU's copy engines and kernels do not take the host's cores from its compute; here they must take some.
        # One thread each: with torch's default (all cores) every stream's copy would start its own OpenMP team, the
        # host's compute team would wait at its barriers for a core, and compute on a 2-core machine ran up to twice
        # as long beside a stream of copies (bench/plan_accuracy.py).
        torch.set_num_threads(1)
        while (item := self._queue.get()) is not None:
            op, enqueued = item
            try:
                # an op starts no earlier than the previous op on this stream ended, nor before it was enqueued
                floor = max(self._model_time, enqueued)
                if self._dev.jitter:
                    floor += self._dev._random_delay()
                    sleep_until(floor)
                self._model_time = max(self._model_time, op(floor))
            except BaseException as err:  # reported to the host at its next synchronize
                self._dev._stream_failed(self.name, err)
            finally:
                item = op = None  # drop the op's tensors now, not when the next op arrives
                self._queue.task_done()
        self._queue.task_done()

    def wait(self, event: SimEvent) -> None:
        """Work enqueued on this stream after this call starts only once `event` is reached."""
        generation = event._target(f"stream {self.name!r}")
        if self._dev.hazards:
            self._dev.hazards.stream_waits(self, event)

        def wait_op(floor: float) -> float:
            event._wait_for(generation, None)
            return max(floor, event._time_of(generation))

        self._enqueue(wait_op)

    def synchronize(self) -> None:
        self._queue.join()
        if self._dev.hazards:
            self._dev.hazards.host_waits(getattr(self, "_clock", {}))
        self._dev._raise_stream_error()

    def __repr__(self) -> str:
        return f"SimStream({self.name!r})"
