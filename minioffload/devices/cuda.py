"""The CUDA backend: torch streams and events, non-blocking copies, spans timed by CUDA events.

Same interface as `SimDevice`, so chapters and the runtime run unchanged on a GPU. Each op records a
start and an end CUDA event on its stream; `synchronize()` turns them into spans in `trace`, placed
on the host clock through a reference event recorded when the device was made (and, past a few thousand
spans, the completed ones are folded in without a synchronize, so the list stays bounded).

Events from `dev.event()` order work and record no time: a host wait on one sleeps (a blocking event)
instead of spinning a core beside the CPU Adam's threads; `dev.event(timing=True)` makes one `elapsed_ms`
can read. Pinned host buffers are the project's own page-locked memory (`pinned.aligned_empty`), not torch's
caching host allocator, so nothing holds them once they are dropped: a copy keeps its host tensor alive
until the copy has run.

What this is not: a wrapper of all of CUDA. Copies are `Tensor.copy_(non_blocking=True)`; work is
whatever torch calls the launched function makes on the current stream.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from ..ledger import OutOfMemoryError
from ..pinned import aligned_empty
from ..trace import Trace
from .common import DeviceMemory, check_copy, lane_of, parameters_of

PENDING_LIMIT = 4096  # spans held before the completed ones are folded into the trace without a synchronize()


class CudaEvent:
    """A CUDA event. For ordering (the default) it records no time, and a host wait on it sleeps (blocking=True)
    rather than spins; `timing=True` records timestamps, for `elapsed_ms`."""

    def __init__(self, timing: bool = False) -> None:
        self.timing = timing
        self.event = torch.cuda.Event(enable_timing=timing, blocking=True)
        self._recorded = False

    def record(self, stream: CudaStream) -> None:
        self.event.record(stream.stream)
        self._recorded = True

    def _check(self, waiter: str) -> None:
        if not self._recorded:
            raise RuntimeError(f"{waiter} waits on an event that was never recorded, so it would wait for "
                               "nothing (CUDA silently would); call event.record(stream) first")

    def query(self) -> bool:
        return self._recorded and self.event.query()

    def synchronize(self, timeout: float | None = None) -> None:  # CUDA has no timeout here
        self._check("the host")
        self.event.synchronize()

    def elapsed_ms(self, end: CudaEvent) -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("elapsed_ms needs two timing events: make both with dev.event(timing=True) (an "
                               "event from dev.event() orders work and records no time)")
        return self.event.elapsed_time(end.event)


class PendingSpans:
    """Spans whose CUDA events have not been read yet, and the host tensors of copies still in flight.

    `add` may be called from any thread (backward's hooks, the speculative worker, a checkpoint writer). `fold()`
    (at synchronize) moves every span whose end event has completed into `trace` and keeps the others; past `limit`
    spans, `add` folds too, so the list stays bounded when nobody synchronizes. A copy's host tensor is held until
    its end event has completed: our pinned memory is freed (and unlocked) when its last tensor dies, and a DMA
    must not read or write it after that.
    """

    def __init__(self, trace: Trace, ref, ref_time: float, limit: int = PENDING_LIMIT):
        self._trace, self._ref, self._ref_time = trace, ref, ref_time  # ref completed at ref_time (perf_counter s)
        self.limit = limit
        self._fold_at = limit
        self._lock = threading.Lock()
        self._spans: list[tuple] = []  # (lane, name, start event, end event, nbytes)
        self._held: deque[tuple] = deque()  # (end event, host tensor), in the order the copies were queued

    def __len__(self) -> int:
        with self._lock:
            return len(self._spans)

    def add(self, lane: str, name: str, start, end, nbytes: int, keep: torch.Tensor | None = None) -> None:
        with self._lock:
            while self._held and self._held[0][0].query():  # in queue order, as torch's pinned allocator does
                self._held.popleft()
            if keep is not None:
                self._held.append((end, keep))
            self._spans.append((lane, name, start, end, nbytes))
            if len(self._spans) > self._fold_at:
                self._fold()
                # the GPU runs far behind: fold again once as many more have come, so that adding stays cheap
                self._fold_at = max(self.limit, 2 * len(self._spans))

    def fold(self) -> None:
        """Move the completed spans into the trace (and drop the host tensors of completed copies)."""
        with self._lock:
            self._fold()
            while self._held and self._held[0][0].query():
                self._held.popleft()

    def _fold(self) -> None:
        ref = self._ref_time - self._trace.origin  # the reference on the trace's current clock
        waiting = []
        for span in self._spans:
            lane, name, start, end, nbytes = span
            if not end.query():  # queued after the last synchronize (e.g. by another thread), or still running
                waiting.append(span)
                continue
            t0 = ref + self._ref.elapsed_time(start) / 1e3
            t1 = ref + self._ref.elapsed_time(end) / 1e3
            self._trace.record(lane, name, t0, max(t0, t1), nbytes)
        self._spans = waiting


class CudaStream:
    def __init__(self, name: str, stream: torch.cuda.Stream):
        self.name, self.stream = name, stream

    def wait(self, event: CudaEvent) -> None:
        event._check(f"stream {self.name!r}")
        self.stream.wait_event(event.event)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def __repr__(self) -> str:
        return f"CudaStream({self.name!r})"


class CudaDevice:
    kind = "cuda"
    adam_rate = None  # device work is measured, not modelled

    def __init__(self, index: int = 0, trace: Trace | None = None):
        self.torch_device = torch.device("cuda", index)
        torch.cuda.set_device(self.torch_device)
        self.memory = DeviceMemory(torch.cuda.get_device_properties(index).total_memory)
        self.ledger = self.memory.ledger
        self.trace = trace or Trace()
        self.default_stream = CudaStream("default", torch.cuda.current_stream(self.torch_device))
        # A reference point on both clocks: `_ref_time` (time.perf_counter seconds, not trace time: the trace's
        # origin moves when it is cleared) is when event `_ref` completed.
        self._ref = torch.cuda.Event(enable_timing=True, blocking=True)
        self._ref.record(self.default_stream.stream)
        self._ref.synchronize()
        self._ref_time = time.perf_counter()
        self._pending = PendingSpans(self.trace, self._ref, self._ref_time)
        self.closed = False

    def stream(self, name: str = "stream") -> CudaStream:
        return CudaStream(name, torch.cuda.Stream(self.torch_device))

    def event(self, timing: bool = False) -> CudaEvent:
        """An event to order work by (a host wait on it sleeps); `timing=True`: one that `elapsed_ms` can read."""
        return CudaEvent(timing)

    def empty(self, shape, dtype: torch.dtype = torch.float32, name: str = "tensor") -> torch.Tensor:
        shape, key = self.memory.reserve(shape, dtype, name)
        try:
            tensor = torch.empty(shape, dtype=dtype, device=self.torch_device)
        except torch.OutOfMemoryError as err:  # the ledger allowed it, but the GPU holds other things too
            requested = self.ledger.allocations[key].nbytes
            self.ledger.free(key)
            free, total = torch.cuda.mem_get_info(self.torch_device)
            raise OutOfMemoryError("device", key, requested, free, total, "") from err
        return self.memory.track(tensor, key)

    def host_empty(self, shape, dtype: torch.dtype = torch.float32, pinned: bool = True) -> torch.Tensor:
        """Host memory: pinned, our own page-aligned memory page-locked for exactly its size and unlocked and freed
        with its last tensor (pinned.aligned_empty; torch's pinned allocator would round it up to a power of two
        and keep it); or ordinary pageable memory."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not pinned:
            return torch.empty(shape, dtype=dtype)
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        return aligned_empty(max(nbytes, 1))[:nbytes].view(dtype).view(shape)

    def is_device(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def adopt(self, tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
        """Count an existing CUDA tensor in `ledger` (it stays where it is)."""
        if tensor.device.type != "cuda":
            raise ValueError(f"{name} is on {tensor.device}; move it with .to('cuda') before adopting it")
        return self.memory.adopt(tensor, name)

    def place(self, model, name: str = "param"):
        """Move a model (or an iterable of parameters, in place) to the GPU and count it in `ledger`; returns
        the module, or the tensors as a list."""
        if isinstance(model, torch.nn.Module):
            model.to(self.torch_device)
        tensors = parameters_of(model)
        for t in tensors:
            if t.device.type != "cuda":
                t.data = t.data.to(self.torch_device)
            self.adopt(t, name)
        return model if isinstance(model, torch.nn.Module) else tensors

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` on the GPU (a batch of inputs), made on torch's current stream."""
        return tensor.to(self.torch_device)

    @property
    def generator(self) -> torch.Generator:
        """The GPU's default random generator (dropout draws on it, not on the CPU's)."""
        return torch.cuda.default_generators[self.torch_device.index]

    def get_rng_state(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.torch_device)

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.cuda.set_rng_state(state, self.torch_device)

    def keep_alive(self, tensor: torch.Tensor, stream: CudaStream) -> None:
        """Keep the caching allocator from handing `tensor`'s memory out again before the work queued on
        `stream` so far has run (it only tracks the stream the tensor was made on)."""
        tensor.record_stream(stream.stream)

    def free_storage(self, tensor: torch.Tensor) -> None:
        """Free a tensor's memory but keep the tensor (and every view of it, autograd's saved ones too): its
        storage shrinks to nothing until `restore_storage`. The caching allocator hands the memory out again only
        to work queued after this on torch's current stream. A host tensor becomes a CUDA tensor with no memory."""
        if tensor.device.type != "cuda":
            placeholder = torch.empty(tensor.shape, dtype=tensor.dtype, device=self.torch_device)  # one tensor's
            placeholder.untyped_storage().resize_(0)  # worth of memory, for a moment
            tensor.data = placeholder
            return
        self.memory.forget(tensor)
        tensor.untyped_storage().resize_(0)

    def restore_storage(self, tensor: torch.Tensor, name: str = "tensor") -> None:
        """Give a freed tensor its memory back (uninitialised: copy into it before computing with it), from torch's
        current stream, counted in `ledger`."""
        if tensor.untyped_storage().nbytes():
            raise ValueError(f"{name} still has its memory: free_storage it first")
        _, key = self.memory.reserve(tuple(tensor.shape), tensor.dtype, name)
        try:
            tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        except torch.OutOfMemoryError as err:
            requested = self.ledger.allocations[key].nbytes
            self.ledger.free(key)
            free, total = torch.cuda.mem_get_info(self.torch_device)
            raise OutOfMemoryError("device", key, requested, free, total, "") from err
        self.memory.track(tensor, key)

    def timed(self, name: str, fn: Callable, lane: str = "compute"):
        """Run fn() on torch's current stream, timed by CUDA events (recorded into the trace at synchronize());
        returns its result."""
        out = []
        self.launch(self.default_stream, lambda: out.append(fn()), name=name, lane=lane)
        return out[0]

    def stream_waits_for_compute(self, stream: CudaStream) -> None:
        """Make `stream` wait for the work already queued on torch's current stream (e.g. backward)."""
        stream.stream.wait_stream(torch.cuda.current_stream(self.torch_device))

    def compute_waits_for(self, event: CudaEvent) -> None:
        """Make work queued next on torch's current stream (e.g. the forward) wait for `event`."""
        event._check("the compute stream")
        torch.cuda.current_stream(self.torch_device).wait_event(event.event)

    def uses(self, what: str, reads=(), writes=()) -> None:
        """Compute reads or writes these tensors now: a check on the simulator only (its hazard checker)."""

    def _timed(self, stream: CudaStream, lane: str, name: str, nbytes: int, work: Callable[[], None],
               keep: torch.Tensor | None = None) -> None:
        # timing events, not blocking: only their times are read, after they completed
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream.stream):
            start.record()
            work()
            end.record()
        self._pending.add(lane, name, start, end, nbytes, keep)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: CudaStream | None = None,
             name: str | None = None) -> None:
        check_copy(dst, src)
        to_device, from_device = self.is_device(dst), self.is_device(src)
        if not to_device and not from_device:
            raise ValueError("both tensors are host tensors; for a host copy use dst.copy_(src)")
        direction = "d2d" if to_device and from_device else "h2d" if to_device else "d2h"
        nbytes = src.numel() * src.element_size()
        host = src if direction == "h2d" else dst if direction == "d2h" else None  # held until the copy has run
        self._timed(stream or self.default_stream, lane_of(direction), name or direction, nbytes,
                    lambda: dst.copy_(src, non_blocking=True), keep=host)

    def launch(self, stream: CudaStream | None, fn: Callable, *args, name: str = "compute",
               duration: float | None = None, lane: str = "compute", **kwargs) -> None:
        if not callable(fn):
            raise TypeError(f"launch needs a function, got {type(fn).__name__}")
        self._timed(stream or self.default_stream, lane, name, 0, lambda: fn(*args, **kwargs))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.torch_device)
        self._pending.fold()

    def close(self) -> None:
        if not self.closed:
            self.synchronize()
            self.closed = True

    def __enter__(self) -> CudaDevice:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CudaDevice({torch.cuda.get_device_name(self.torch_device)!r})"

