"""One device interface, two backends: a real CUDA GPU and a simulated GPU on the CPU.

    dev = device("auto")                 # cuda when available, else sim; says which
    copy = dev.stream("h2d")             # streams run their work in order, concurrently with each other
    x = dev.empty((1024, 1024))          # device memory (counted in dev.ledger's "device" tier)
    host = dev.host_empty((1024, 1024))  # pinned host memory
    dev.copy(x, host, copy)              # enqueued; returns at once when `host` is pinned
    ready = dev.event(); ready.record(copy)
    compute = dev.stream("compute"); compute.wait(ready)
    dev.launch(compute, torch.mul, x, 2, out=x)   # runs after the copy, never before
    dev.synchronize(); print(dev.trace.summary())

Both backends record every op as a span in `dev.trace` (lanes "h2d", "compute", "d2h") and count
device memory in `dev.ledger`. The simulated device is in `device_sim.py`, the CUDA one in
`device_cuda.py`; this file holds what they share. Not here: multi-GPU, graphs, peer copies.
"""

from __future__ import annotations

import itertools
import math
import warnings
import weakref
from dataclasses import dataclass

import torch

from .memory import Ledger


@dataclass(frozen=True)
class Link:
    """A one-direction host<->device link: a copy of n bytes takes latency + n / bandwidth seconds."""

    bandwidth: float  # bytes/s
    latency: float = 10e-6  # s

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency < 0:
            raise ValueError(f"a link needs bandwidth > 0 and latency >= 0, got {self}")

    def seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth


def check_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Refuse copies the hardware would not do as asked: mismatched shapes or dtypes."""
    if not isinstance(dst, torch.Tensor) or not isinstance(src, torch.Tensor):
        raise TypeError(f"copy takes two tensors, got {type(dst).__name__} and {type(src).__name__}")
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy needs the same shape and dtype on both sides: dst {tuple(dst.shape)} {dst.dtype}, "
                         f"src {tuple(src.shape)} {src.dtype}; reshape or .to(dtype) one side first")
    if not dst.is_contiguous() or not src.is_contiguous():
        raise ValueError("copy needs contiguous tensors (a DMA moves one block of bytes); call .contiguous() "
                         "into a buffer first")


class DeviceMemory:
    """The device tier's books, shared by both backends: a `Ledger` with the device's capacity, and which
    storages (by address) it counts, each freed from the ledger when its tensor is garbage collected."""

    def __init__(self, capacity: int):
        self.ledger = Ledger({"device": capacity})
        self._names = itertools.count()
        self._held: dict[int, str] = {}  # storage address -> ledger key

    def reserve(self, shape, dtype: torch.dtype, name: str) -> tuple[tuple[int, ...], str]:
        """Check an allocation and count it (OutOfMemoryError, nothing changed, if it does not fit).
        Returns the shape as a tuple and the ledger key; `track` the tensor once it exists."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        numel = math.prod(shape)
        if numel <= 0:
            raise ValueError(f"device tensors need at least one element, got shape {shape}")
        key = f"{name}#{next(self._names)}"
        self.ledger.allocate(key, "device", numel * torch.empty(0, dtype=dtype).element_size())
        return shape, key

    def track(self, tensor: torch.Tensor, key: str) -> torch.Tensor:
        address = tensor.untyped_storage().data_ptr()
        self._held[address] = key
        weakref.finalize(tensor, self._release, address, key).atexit = False
        return tensor

    def _release(self, address: int, key: str) -> None:
        self._held.pop(address, None)
        self.ledger.free(key)

    def adopt(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Count an existing tensor (once, however often it is adopted)."""
        if self.holds(tensor):
            return tensor
        _, key = self.reserve(tuple(tensor.shape), tensor.dtype, name)
        return self.track(tensor, key)

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._held


def lane_of(direction: str) -> str:
    return {"h2d": "h2d", "d2h": "d2h", "d2d": "compute"}[direction]


def device(kind: str = "auto", **options):
    """A device: "cuda", "sim", or "auto" (cuda when torch sees a GPU, else sim; prints which).

    Options go to the backend: for sim, see `SimDevice`; for cuda, `index`.
    """
    if kind not in ("auto", "cuda", "sim"):
        raise ValueError(f"unknown device kind {kind!r}; choose 'auto', 'cuda' or 'sim'")
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "sim"
        print(f"minioffload: using the {kind} device"
              + ("" if kind == "cuda" else " (no CUDA GPU found: a simulated GPU on the CPU)"))
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device('cuda') needs a CUDA GPU and a CUDA build of torch; use device('sim') "
                               "to run on the CPU")
        sim_only = {"memory_bytes", "h2d", "d2h", "jitter", "seed", "pageable_slowdown", "switch_interval",
                    "adam_rate", "strict"}
        if sim_only & options.keys():
            warnings.warn(f"options {sorted(sim_only & options.keys())} only apply to the sim device; ignored",
                          stacklevel=2)
            options = {k: v for k, v in options.items() if k not in sim_only}
        from .device_cuda import CudaDevice
        return CudaDevice(**options)
    from .device_sim import SimDevice
    return SimDevice(**options)
