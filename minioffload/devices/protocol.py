"""The device interface: exactly what the engine, the training loop and the chapters use of a device.

Two backends implement it: `SimDevice` (devices/sim.py: a simulated GPU on the CPU) and `CudaDevice`
(devices/cuda.py). Code outside them types its device as `Device` and never asks which kind it holds:
what differs between a GPU and the sim (moving a model, keeping memory alive for a stream, timing compute,
modelled kernel times) is a method or an attribute here.

    dev.place(model)                     # weights on the device, counted in dev.ledger
    s = dev.stream("h2d"); e = dev.event()
    dev.copy(dst, src, s); e.record(s)   # queued; returns at once from pinned memory
    dev.compute_waits_for(e)             # the next forward waits for the copy
    dev.timed("forward", lambda: model(x))

What this is not: an implementation (see the backends) or a promise about timing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from ..ledger import Ledger
from ..trace import Trace


@runtime_checkable
class Event(Protocol):
    def record(self, stream: Stream) -> None:
        """Mark the point in `stream` reached by the work queued on it so far."""

    def query(self) -> bool:
        """Has the marked point been reached?"""

    def synchronize(self, timeout: float | None = ...) -> None:
        """Block the host until the marked point is reached."""

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds between this event and `end` (both reached, both made with `dev.event(timing=True)`)."""


@runtime_checkable
class Stream(Protocol):
    name: str

    def wait(self, event: Event) -> None:
        """Work queued on this stream from now on starts after `event`."""

    def synchronize(self) -> None:
        """Block the host until this stream's queued work has run."""


@runtime_checkable
class Device(Protocol):
    kind: str  # "sim" or "cuda": for display and results, never for branching
    trace: Trace  # every copy and launch, as spans on lanes
    ledger: Ledger  # device memory the runtime allocated, adopted or placed
    memory: Any  # device_common.DeviceMemory: which storages the ledger counts (`forget` stops counting one)
    default_stream: Stream
    adam_rate: float | None  # params/s a device-side Adam is modelled to take (sim); None: measured (cuda)
    torch_device: torch.device  # where its tensors live: cuda:N, or the CPU for the sim
    generator: torch.Generator  # the device's own random generator, apart from the CPU's

    # streams and events
    def stream(self, name: str = ...) -> Stream: ...
    def event(self, timing: bool = ...) -> Event:
        """An event to order work by. `timing=True`: one whose time `elapsed_ms` can read; the default records no
        time (on CUDA a host wait on it then sleeps instead of spinning a core)."""
    def synchronize(self) -> None: ...

    # memory
    def empty(self, shape, dtype: torch.dtype = ..., name: str = ...) -> torch.Tensor: ...
    def host_empty(self, shape, dtype: torch.dtype = ..., pinned: bool = ...) -> torch.Tensor: ...
    def is_device(self, tensor: torch.Tensor) -> bool: ...
    def adopt(self, tensor: torch.Tensor, name: str = ...) -> torch.Tensor: ...
    def place(self, model, name: str = ...) -> Any: ...
    def to_device(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def get_rng_state(self) -> torch.Tensor: ...  # the device generator's state (save it with the CPU's to replay)
    def set_rng_state(self, state: torch.Tensor) -> None: ...
    def keep_alive(self, tensor: torch.Tensor, stream: Stream) -> None: ...
    def free_storage(self, tensor: torch.Tensor) -> None: ...
    def restore_storage(self, tensor: torch.Tensor, name: str = ...) -> None: ...

    # work, ordered against compute (autograd, the forward: the host thread's stream)
    def stream_waits_for_compute(self, stream: Stream) -> None: ...
    def compute_waits_for(self, event: Event) -> None: ...
    def uses(self, what: str, reads=..., writes=...) -> None: ...  # checked by the strict sim; nothing on a GPU
    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream | None = ..., name: str | None = ...
             ) -> None: ...
    def launch(self, stream: Stream | None, fn: Callable, *args, name: str = ..., duration: float | None = ...,
               lane: str = ..., **kwargs) -> None: ...
    def timed(self, name: str, fn: Callable, lane: str = ...) -> Any: ...

    # lifetime
    def close(self) -> None: ...
    def __enter__(self) -> Device: ...
    def __exit__(self, *exc) -> None: ...
