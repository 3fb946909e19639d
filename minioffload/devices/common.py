"""What the two device backends share: the link model, the copy checks, and the device tier's books.

Not here: the interface the engine uses (devices/protocol.py), the backends (devices/sim.py, devices/cuda.py),
or the factory that picks one (devices/__init__.py).
"""

from __future__ import annotations

import itertools
import math
import weakref
from dataclasses import dataclass

import torch

from ..ledger import Ledger


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
    storages (by address) it counts, each freed from the ledger when the storage itself is garbage collected.

    The storage, not the tensor: tensors are aliases (`detach()`, views, the tensor autograd saves twice), and a
    count that ended with the first alias to die would un-count memory the others still hold. torch keeps one
    Python object per live storage, so a finalizer on it runs once, when the memory goes."""

    def __init__(self, capacity: int):
        self.ledger = Ledger({"device": capacity})
        self._names = itertools.count()
        self._held: dict[int, str] = {}  # storage address -> ledger key
        self._finalizers: dict[str, weakref.finalize] = {}  # ledger key -> what frees it when its tensor dies
        self.on_release = None  # called with a storage's address when it stops being counted (the sim's checker)

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
        storage = tensor.untyped_storage()
        self._held[storage.data_ptr()] = key
        finalizer = weakref.finalize(storage, self._release, storage.data_ptr(), key)
        finalizer.atexit = False
        self._finalizers[key] = finalizer
        return tensor

    def _release(self, address: int, key: str) -> None:
        if self.on_release is not None:
            self.on_release(address)
        if self._held.get(address) == key:  # not memory handed out again at this address since
            del self._held[address]
        self._finalizers.pop(key, None)
        self.ledger.free(key)

    def forget(self, tensor: torch.Tensor) -> None:
        """Stop counting `tensor` (its storage is about to be freed while the tensor lives on); not held: nothing."""
        key = self._held.get(tensor.untyped_storage().data_ptr())
        if key is not None:
            self._finalizers[key].detach()
            self._release(tensor.untyped_storage().data_ptr(), key)

    def adopt(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Count an existing tensor's memory: its whole storage, once, however often it or another view of the same
        storage is adopted (autograd saves q, k and v as three views of one projection's output: one storage)."""
        if self.holds(tensor):
            return tensor
        storage = tensor.untyped_storage()
        _, key = self.reserve(storage.nbytes(), torch.uint8, name)
        return self.track(tensor, key)

    def holds(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self._held


def lane_of(direction: str) -> str:
    return {"h2d": "h2d", "d2h": "d2h", "d2d": "compute"}[direction]


def parameters_of(model) -> list[torch.Tensor]:
    """The tensors `place` puts on a device: a module's parameters, or the tensors of an iterable."""
    if isinstance(model, torch.nn.Module):
        return list(model.parameters())
    if isinstance(model, torch.Tensor):
        return [model]
    try:
        tensors = list(model)
    except TypeError:
        raise TypeError(f"place takes a torch.nn.Module or an iterable of parameters, got {type(model).__name__}") \
            from None
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError("place takes a torch.nn.Module or an iterable of tensors; the iterable held "
                        f"{sorted({type(t).__name__ for t in tensors if not isinstance(t, torch.Tensor)})}")
    return tensors
