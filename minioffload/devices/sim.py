"""A simulated GPU on the CPU that behaves, for timing and ordering, like a GPU on a PCIe link.

- Device memory is ordinary CPU memory counted against a capacity in `ledger` (tier "device");
  allocating past it raises chapter 1's OutOfMemoryError and changes nothing.
- A stream is an in-order queue run by its own worker thread. Work on different streams runs
  concurrently; work on one stream never reorders.
- An event marks a point in a stream; the host (`event.synchronize()`) or another stream
  (`stream.wait(event)`) can wait for it. Waiting on an event never recorded is an error, not a hang.
- A host<->device copy is a real copy whose duration follows a `Link` model (latency + bytes /
  bandwidth), one copy engine per direction, so two H2D copies queue behind each other while an H2D
  and a D2H overlap, as on a GPU. A copy from pageable host memory is slower and blocks the host.
- With `strict` (the test suite), a hazard checker raises at any work a GPU could run in the wrong order, holding
  the runtime to a GPU that runs behind the host (`lags`: devices/hazards.py), and empty() hands out NaN.
- The device has its own random generator (`generator`, `get_rng_state`), apart from the CPU's, as a GPU does: code
  that saves only the CPU's state to replay a kernel's random draws replays them wrong here too.
- `jitter` delays each stream op by a random 0..jitter seconds: a missing wait then shows up as a
  wrong result within a few trials instead of passing by luck. (A hazard that needs one stage to be
  slower than another shows up reliably only when a slow link or a long kernel makes it so.)

Model time (time.perf_counter seconds; spans are recorded relative to the trace origin): every op has
a modelled start (when its stream, its copy engine and the events it waits
on allow) and a modelled end (start + its modelled duration). A worker sleeps until that end, so the
wall clock follows the model, but a thread that wakes a little late does not push the model back:
as on a GPU, a copy engine starts the moment its dependency is met. Spans in `trace` are model times.

Why a short GIL switch interval: stream workers are Python threads. With the default 5 ms switch
interval, a worker that releases the GIL (a torch op, a sleep) waits up to 5 ms to win it back, and
"overlapped" work runs slower than serial work. The device sets 0.1 ms while open and restores the
previous value on `close()`.

What this is not: a performance model of a GPU's compute. `launch` runs the function for real on the
CPU; `duration=` pads it to a modelled kernel time when the chapter wants copy and compute balanced.
"""

from __future__ import annotations

import math
import os
import random
import sys
import threading
import time
from collections.abc import Callable

import torch

from ..kernels.checksum import checksum
from ..pinned import aligned_empty, is_pinned
from ..trace import Trace
from ..units import GiB
from .common import DeviceMemory, Link, check_copy, lane_of, parameters_of
from .hazards import Checker, HazardError, tensors_in
from .sim_streams import SimEvent, SimStream
from .sim_streams import sleep_until as _sleep_until

SLOW_LINK = Link(bandwidth=2e9, latency=10e-6)  # a small GPU on a slow link: MiB-sized copies take ms
_open_devices = 0  # how many SimDevices hold the short switch interval
_switch_lock = threading.Lock()
_saved_switch_interval = sys.getswitchinterval()


class SimDevice:
    """A simulated GPU. Defaults model a small GPU on a slow link, so that copies of a few MiB take
    milliseconds: 4 GiB of memory, 2 GB/s each way (pinned), pageable copies 2x slower. `adam_rate`: how many
    params/s a device-side Adam updates (chapter 5's hybrid update launches it with that modelled duration)."""

    kind = "sim"
    DEFAULT_MEMORY = 4 * GiB
    torch_device = torch.device("cpu")  # where its tensors are: host memory plays the device's

    def __init__(self, memory_bytes: int = DEFAULT_MEMORY, h2d: Link = SLOW_LINK, d2h: Link = SLOW_LINK,
                 pageable_slowdown: float = 2.0, jitter: float = 0.0, seed: int | None = None,
                 trace: Trace | None = None, switch_interval: float = 1e-4, adam_rate: float = 1e9,
                 strict: bool | None = None, lags: bool | None = None):
        if pageable_slowdown < 1 or jitter < 0:
            raise ValueError(f"need pageable_slowdown >= 1 and jitter >= 0, got {pageable_slowdown}, {jitter}")
        if not 0 < adam_rate < math.inf:
            raise ValueError(f"adam_rate (params/s of a device-side Adam) must be positive and finite, got {adam_rate}")
        self.adam_rate = adam_rate  # a device-side Adam of n params is modelled to take n / adam_rate seconds
        # strict: behave as a GPU punishes mistakes; empty() hands out NaN-filled memory, as uninitialised device
        # memory may hold anything. Default: on when MINIOFFLOAD_SIM_STRICT=1 (the test suite sets it).
        self.strict = os.environ.get("MINIOFFLOAD_SIM_STRICT") == "1" if strict is None else strict
        self.memory = DeviceMemory(memory_bytes)
        # lags (with strict; on by default): the checker holds the runtime to a GPU that runs behind the host
        self.lags = self.strict if lags is None else lags
        if self.lags and not self.strict:
            raise ValueError("lags=True is a rule of the strict hazard checker: pass strict=True too")
        # devices/hazards.py: missing waits raise
        self.hazards = Checker(self._describe, self.lags, self.is_device) if self.strict else None
        if self.hazards:
            self.memory.on_release = self.hazards.released
        self.ledger = self.memory.ledger
        self.trace = trace or Trace()
        self.links = {"h2d": h2d, "d2h": d2h}
        self.pageable_slowdown, self.jitter = pageable_slowdown, jitter
        self._rng = random.Random(seed)
        # the device's own random generator, apart from the CPU's (as a GPU's is): kernels that draw on the device
        # take it (`generator=dev.generator`), and `get_rng_state` saves it
        self.generator = torch.Generator().manual_seed(torch.initial_seed() if seed is None else seed)
        self._rng_lock = threading.Lock()
        self._engines = {"h2d": threading.Lock(), "d2h": threading.Lock()}  # one copy engine per direction
        self._engine_free = {"h2d": 0.0, "d2h": 0.0}  # model time each engine finishes its last copy
        self._streams: list[SimStream] = []
        self._error: tuple[str, BaseException] | None = None
        self.closed = False
        global _open_devices, _saved_switch_interval
        with _switch_lock:
            if _open_devices == 0:
                _saved_switch_interval = sys.getswitchinterval()
            _open_devices += 1
            sys.setswitchinterval(switch_interval)
        self.default_stream = self.stream("default")

    # streams and events -----------------------------------------------------------------------
    def stream(self, name: str = "stream") -> SimStream:
        s = SimStream(self, name)
        self._streams.append(s)
        return s

    def event(self, timing: bool = False) -> SimEvent:
        """An event to order work by; `timing=True`: one whose time `elapsed_ms` can read (as on CUDA)."""
        return SimEvent(self, timing)

    def synchronize(self) -> None:
        """Wait for all work on all streams; raise the first error any of it hit."""
        for s in self._streams:
            s._queue.join()
        if self.hazards:
            for s in self._streams:
                self.hazards.host_waits(getattr(s, "_clock", {}))
            self.hazards.host_waits_for_compute()
        self._raise_stream_error()

    def _random_delay(self) -> float:
        with self._rng_lock:
            return self._rng.uniform(0, self.jitter)

    def _stream_failed(self, stream: str, err: BaseException) -> None:
        if self._error is None:
            self._error = (stream, err)

    def _raise_stream_error(self) -> None:
        if self._error is not None:
            stream, err = self._error
            self._error = None
            raise RuntimeError(f"work on stream {stream!r} failed: {type(err).__name__}: {err}") from err

    def get_rng_state(self) -> torch.Tensor:
        """The device random generator's state (a CPU tensor), as torch.cuda.get_rng_state gives a GPU's."""
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)

    # memory -----------------------------------------------------------------------------------
    def empty(self, shape: tuple[int, ...] | int, dtype: torch.dtype = torch.float32,
              name: str = "tensor") -> torch.Tensor:
        """A device tensor, counted in `ledger` until it is garbage collected. Zero-filled (resident memory), or
        NaN-filled with `strict`: a GPU's empty() is uninitialised, so code must write before it reads."""
        shape, key = self.memory.reserve(shape, dtype, name)
        if self.strict and dtype.is_floating_point:
            return self._allocated(self.memory.track(torch.full(shape, float("nan"), dtype=dtype), key))
        return self._allocated(self.memory.track(torch.zeros(shape, dtype=dtype), key))

    def _allocated(self, tensor: torch.Tensor, by_runtime: bool = True) -> torch.Tensor:
        if self.hazards:
            self.hazards.allocated(tensor, by_runtime)
        return tensor

    def host_empty(self, shape: tuple[int, ...] | int, dtype: torch.dtype = torch.float32,
                   pinned: bool = True) -> torch.Tensor:
        """A host tensor: pinned (page-aligned, treated as page-locked) or ordinary pageable memory."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not pinned:
            tensor = torch.empty(shape, dtype=dtype)
        else:
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            tensor = aligned_empty(nbytes).view(dtype).view(shape)
        if self.hazards:
            self.hazards.fresh(tensor)  # its addresses may have been a freed device tensor's
        return tensor

    def _describe(self, tensor: torch.Tensor) -> str:
        key = self.memory._held.get(tensor.untyped_storage().data_ptr())
        where = f"device tensor {key!r}" if key else "pinned host buffer" if is_pinned(tensor) else "host tensor"
        return f"{where} ({tuple(tensor.shape)} {tensor.dtype})"

    def is_device(self, tensor: torch.Tensor) -> bool:
        return self.memory.holds(tensor)

    def adopt(self, tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
        """Count an existing CPU tensor as device memory (a model "moved to" the sim device, a tensor autograd made)."""
        if self.memory.holds(tensor):
            return tensor
        return self._allocated(self.memory.adopt(tensor, name), by_runtime=False)

    def place(self, model, name: str = "param"):
        """Put a model (or an iterable of parameters) on the device, and count it there; returns what it put:
        the module, or the tensors as a list. On the sim its memory stays where it is (host memory plays the
        device's), so placing is counting."""
        tensors = parameters_of(model)
        for t in tensors:
            self.adopt(t, name)
        return model if isinstance(model, torch.nn.Module) else tensors

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor the device's compute can read (a batch of inputs): on the sim, the tensor itself."""
        return tensor

    def keep_alive(self, tensor: torch.Tensor, stream: SimStream) -> None:
        """Keep `tensor`'s memory from being reused until the work queued on `stream` so far has run. On the
        sim the queued work holds a reference to it, which is enough; the hazard checker learns that memory
        allocated later at the same address is not that work's."""
        if self.hazards:
            self.hazards.kept_alive(tensor, stream)

    def free_storage(self, tensor: torch.Tensor) -> None:
        """Free a tensor's memory but keep the tensor (shape, dtype, and every view of it, autograd's saved ones
        too): its storage shrinks to nothing until `restore_storage`. Work queued before may still have read it
        on a GPU; here compute has already run."""
        self.memory.forget(tensor)
        tensor.untyped_storage().resize_(0)

    def restore_storage(self, tensor: torch.Tensor, name: str = "tensor") -> None:
        """Give a freed tensor its memory back, counted in `ledger` (OutOfMemoryError, nothing changed, if it does
        not fit). Uninitialised, as on a GPU (NaN with `strict`): copy into it before computing with it."""
        if tensor.untyped_storage().nbytes():
            raise ValueError(f"{name} still has its memory: free_storage it first")
        _, key = self.memory.reserve(tuple(tensor.shape), tensor.dtype, name)
        tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        if self.strict and tensor.dtype.is_floating_point:
            tensor.data.fill_(float("nan"))
        self._allocated(self.memory.track(tensor, key))

    def timed(self, name: str, fn: Callable, lane: str = "compute"):
        """Run fn() as compute (the host thread is the sim's compute stream), recorded as a span on `lane`;
        returns its result."""
        with self.trace.span(lane, name):
            return fn()

    # the host thread is the sim's compute stream: autograd and the forward run there -------------
    def stream_waits_for_compute(self, stream: SimStream) -> None:
        """Make `stream` wait for the compute issued so far. On the sim, compute has already run."""
        if self.hazards:
            self.hazards.stream_waits_for_host(stream)

    def compute_waits_for(self, event: SimEvent) -> None:
        """Make the next compute wait for `event`: on the sim, the host blocks until it is reached (compute runs on
        it). With `lags` the checker still takes it as compute's wait, not the host's, as on a GPU."""
        if not self.hazards:
            event.synchronize()
            return
        if not event._wait_for(event._target("the compute stream"), 60.0):
            raise TimeoutError("event not reached within 60 s: is its stream waiting on something that never happens?")
        self.hazards.compute_waits(event)
        self._raise_stream_error()

    def uses(self, what: str, reads=(), writes=()) -> None:
        """Compute (`what`: a block's forward, a backward hook) reads or writes these tensors now; for host memory,
        the host itself does. With `strict`, raises HazardError if a stream's work on them is not ordered before
        (devices/hazards.py); otherwise nothing."""
        if self.hazards:
            self.hazards.uses(list(reads), list(writes), what, self.is_device)

    # work -------------------------------------------------------------------------------------
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: SimStream | None = None,
             name: str | None = None) -> None:
        """Copy src into dst on `stream`. From pinned memory it returns at once; from pageable memory the
        host waits for the copy, as CUDA does."""
        check_copy(dst, src)
        to_device, from_device = self.is_device(dst), self.is_device(src)
        if not to_device and not from_device:
            raise ValueError("both tensors are host tensors; for a host copy use dst.copy_(src)")
        direction = "d2d" if to_device and from_device else "h2d" if to_device else "d2h"
        host_side = src if direction == "h2d" else dst
        pinned = direction == "d2d" or is_pinned(host_side)
        nbytes = src.numel() * src.element_size()
        seconds = 0.0 if direction == "d2d" else self.links[direction].seconds(nbytes)
        if not pinned:
            seconds *= self.pageable_slowdown
        engine = self._engines.get(direction)
        stream = stream or self.default_stream
        label = name or direction
        watch_source = poison = False
        if self.hazards:
            clock = self.hazards.issue(stream)
            self.hazards.access(stream, clock, [src], [dst], f"the {direction} copy {label!r}")
            watch_source = direction == "h2d" and pinned  # the host must not write it while the copy runs
            poison = direction == "d2h" and pinned and dst.dtype.is_floating_point  # nor read it before it lands

        def op(floor: float) -> float:
            if engine:
                engine.acquire()
            try:
                start = max(floor, self._engine_free.get(direction, 0.0))
                _sleep_until(start)
                if poison:  # NaN while the copy runs, the bytes at its end: a host read before it syncs sees NaN
                    dst.fill_(float("nan"))
                    _sleep_until(start + seconds)
                dst.copy_(src)
                read = checksum(src) if watch_source else None
                end = max(start + seconds, time.perf_counter())  # later only if the real copy was slower
                _sleep_until(end)
                if read is not None and checksum(src) != read:  # a GPU's DMA reads the source until `end`
                    raise HazardError(f"the h2d copy {label!r} on stream {stream.name!r}: the host wrote its pinned "
                                      "source while the copy was in flight. Wait for the copy (an event after it, "
                                      "then event.synchronize()) before writing the buffer again")
                if engine:
                    self._engine_free[direction] = end
                origin = self.trace.origin
                self.trace.record(lane_of(direction), label, start - origin, end - origin, nbytes)
                return end
            finally:
                if engine:
                    engine.release()

        if pinned:
            stream._enqueue(op)
            return
        done = self.event()  # pageable: the host blocks until the copy is done, like cudaMemcpy
        start = self.trace.now()
        stream._enqueue(op)
        done.record(stream)
        done.synchronize(timeout=None)
        self.trace.record("host", f"blocked: pageable {label}", start, self.trace.now())

    def launch(self, stream: SimStream | None, fn: Callable, *args, name: str = "compute",
               duration: float | None = None, lane: str = "compute", **kwargs) -> None:
        """Run fn(*args, **kwargs) on `stream`; `duration` pads it to a modelled kernel time (s)."""
        if not callable(fn):
            raise TypeError(f"launch needs a function, got {type(fn).__name__}")
        if self.hazards:  # its tensor arguments count as read and written
            target = stream or self.default_stream
            self.hazards.access(target, self.hazards.issue(target), [],
                                tensors_in([*args, *kwargs.values()]),
                                f"the launch {name!r} (its tensor arguments count as read and written)")

        def op(floor: float) -> float:
            _sleep_until(floor)
            # modelled kernels start when their stream allows; unmodelled ones when the thread gets there
            start = floor if duration is not None else time.perf_counter()
            fn(*args, **kwargs)
            end = max(start + (duration or 0.0), time.perf_counter())  # the real work may take longer
            _sleep_until(end)
            self.trace.record(lane, name, start - self.trace.origin, end - self.trace.origin)
            return end

        (stream or self.default_stream)._enqueue(op)

    # lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish all work, stop the stream threads, restore the GIL switch interval."""
        if self.closed:
            return
        try:
            self.synchronize()
        finally:
            self.closed = True
            for s in self._streams:
                s._queue.put(None)
            global _open_devices
            with _switch_lock:
                _open_devices -= 1
                if _open_devices == 0:
                    sys.setswitchinterval(_saved_switch_interval)

    def __enter__(self) -> SimDevice:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        link = self.links["h2d"]
        return (f"SimDevice(memory={self.ledger.capacity('device') / GiB:.1f} GiB, "
                f"link={link.bandwidth / 1e9:.1f} GB/s, jitter={self.jitter})")
