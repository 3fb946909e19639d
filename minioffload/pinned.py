"""Page-aligned, pinned host buffers, and a bounded pool that hands them out and takes them back.

Why pinned: a GPU's copy engine can only DMA from page-locked memory. A copy from ordinary
(pageable) memory is staged through a driver buffer and blocks the host; a copy from pinned memory
runs on a copy stream while the host goes on. Why aligned: O_DIRECT file I/O (chapter 6) needs
buffers aligned to the disk's block size; one page (4096 bytes) serves both.

Pinning costs: page-locked memory cannot be swapped and is slow to allocate, so the pool allocates
once, up front, and reuses. With CUDA, a pinned buffer is our own NumPy memory, page-locked with
`cudaHostRegister` for exactly its size and unlocked (`cudaHostUnregister`) and freed when its last tensor
dies; torch's pinned allocator (`pin_memory=True`) would round each request up to a power of two and keep
the memory cached for the rest of the process. On a machine without CUDA, buffers are aligned but not
page-locked; the simulated device treats them as pinned (see `is_pinned`).

A host budget (`HostBudget`) bounds the pinned bytes a block of code adds, by any thread, while it is in force: a
pinned buffer that would pass it is refused before any memory is taken, and the budget records the most the block held
pinned at once (its `peak`, measured from the buffers themselves, not counted from a plan).

What this is not: a general allocator. Slots have one size; ask for more and you get a clear error.
"""

from __future__ import annotations

import gc
import threading
import warnings
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .units import format_bytes

ALIGNMENT = 4096  # one page; also a valid O_DIRECT alignment on common filesystems

# Start address -> length, of buffers this module handed out as pinned. Copy-on-write: a published dict never
# changes, a change publishes a new one. `_unregister` runs from a weakref finalizer, which a garbage collection can
# start on this thread at any allocation, even inside CPython 3.11's `dict.copy()` of this very dict (the copy then
# holds the old entries under the new count: "dictionary keys changed during iteration"). Readers take the current
# dict and read it without a lock.
_registered: dict[int, int] = {}
# Reentrant: the finalizer can start inside a section that already holds the lock on the same thread; a plain Lock
# would deadlock there.
_registry_lock = threading.RLock()


def _publish(add: tuple[int, int] | None = None, remove: int | None = None) -> None:
    global _registered
    with _registry_lock:
        while True:
            current = _registered
            updated = {start: length for start, length in current.items() if start != remove}
            if add is not None:
                updated[add[0]] = add[1]
            if _registered is current:  # else a finalizer published while we copied: build on its registry
                _registered = updated
                return


def _cuda() -> bool:
    return torch.cuda.is_available()


def aligned_empty(nbytes: int, alignment: int = ALIGNMENT, pin: bool = True) -> torch.Tensor:
    """A (nbytes,) uint8 host tensor whose address is a multiple of `alignment`, carved from a slightly larger
    NumPy allocation.

    pin=True: with CUDA the memory is page-locked (`cudaHostRegister` of exactly `nbytes`), and unlocked when the
    last view of it dies, just before NumPy frees it; without CUDA it is only recorded as pinned (`is_pinned`).
    """
    if nbytes <= 0:
        raise ValueError(f"nbytes must be positive, got {nbytes}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    if not pin:
        return _carve(nbytes, alignment)[1]
    with _registry_lock:  # the budget's check and the buffer's registration at once: two threads cannot both pass
        _within_budgets(nbytes)
        raw, buffer = _carve(nbytes, alignment)
        buffer.zero_()  # page-locked memory is resident: touch every page now, not during a timed copy
        address, locked = buffer.data_ptr(), _cuda()
        if locked:
            _page_lock(address, nbytes)
        _publish(add=(address, nbytes))
        # unregister (and unlock) when the last view of the memory dies, before NumPy frees it (an array's weakref
        # callbacks run before its memory goes); not at interpreter exit, when the CUDA runtime may be gone
        weakref.finalize(raw, _unregister, address, locked).atexit = False
        _record_peaks()
    return buffer


def _carve(nbytes: int, alignment: int) -> tuple[np.ndarray, torch.Tensor]:
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    offset = (-raw.ctypes.data) % alignment
    return raw, torch.from_numpy(raw[offset:offset + nbytes])  # the view keeps `raw` alive


def held_bytes() -> int:
    """Bytes of pinned host buffers alive in this process (those `aligned_empty` handed out as pinned)."""
    return sum(_registered.values())


class OutOfHostBudget(MemoryError):
    """A pinned buffer that would pass a `HostBudget`; nothing was allocated."""

    def __init__(self, requested: int, held: int, budget: int):
        self.requested, self.held, self.budget = requested, held, budget
        super().__init__(f"cannot pin {format_bytes(requested)}: {format_bytes(held)} of the {format_bytes(budget)} "
                         "host budget is pinned already (nothing was allocated). Raise the budget, or pin less: the "
                         "optimizer's state on NVMe, smaller subgroups (fewer bytes per working set), or activations "
                         "recomputed instead of offloaded")


_budgets: list[HostBudget] = []  # the budgets in force, outermost first: a pinned buffer must fit every one


class HostBudget:
    """`with HostBudget(nbytes) as budget:` at most `nbytes` more pinned host memory alive in this process, by any
    thread, than when the block began (what was pinned before it is not the block's). A pinned allocation that would
    pass it raises OutOfHostBudget before taking any memory. `budget.peak`: the most bytes the block held pinned at
    once, measured from the buffers alive. `nbytes=None` bounds nothing and measures the peak."""

    def __init__(self, nbytes: int | None):
        if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1):
            raise ValueError(f"a host budget is a positive int of bytes (or None), got {nbytes!r}")
        self.nbytes, self.peak, self.start = nbytes, 0, 0

    def __enter__(self) -> HostBudget:
        gc.collect()  # buffers no one holds any more, waiting in reference cycles, are not the block's to count
        with _registry_lock:
            self.start, self.peak = held_bytes(), 0
            _budgets.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _registry_lock:
            _budgets.remove(self)

    @property
    def held(self) -> int:
        """Bytes the block holds pinned now (negative when it freed more than it pinned)."""
        return held_bytes() - self.start


def _within_budgets(nbytes: int) -> None:
    with _registry_lock:
        for budget in _budgets:
            if budget.nbytes is not None and budget.held + nbytes > budget.nbytes:
                raise OutOfHostBudget(nbytes, max(0, budget.held), budget.nbytes)


def _record_peaks() -> None:
    with _registry_lock:
        for budget in _budgets:
            budget.peak = max(budget.peak, budget.held)


def _page_lock(address: int, nbytes: int) -> None:
    code = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0))  # 0: cudaHostRegisterDefault
    if code != 0:
        held = sum(_registered.values())
        raise RuntimeError(f"could not page-lock {nbytes} bytes of host memory (cudaHostRegister: {_error_name(code)}) "
                           f"with {held} bytes already pinned here: check the locked-memory limit (`ulimit -l`; "
                           "`minioffload doctor` reports it) and free host memory, or pin less (smaller pools, "
                           "pinned=False for buffers that need not be pinned)")


def _error_name(code: int) -> str:
    try:
        cudart = torch.cuda.cudart()
        return f"{cudart.cudaGetErrorString(cudart.cudaError(code))} ({code})"
    except Exception:  # a runtime without the names: the number still identifies it
        return f"cudaError {code}"


def _unregister(address: int, locked: bool) -> None:
    _publish(remove=address)
    if locked:
        code = int(torch.cuda.cudart().cudaHostUnregister(address))
        if code != 0:  # a finalizer cannot raise to anyone: say it, the memory stays locked until the process ends
            warnings.warn(f"cudaHostUnregister of a pinned buffer at {address:#x} failed ({_error_name(code)}): its "
                          "memory stays page-locked", RuntimeWarning, stacklevel=1)


def is_pinned(tensor: torch.Tensor) -> bool:
    """True for host memory this module handed out as pinned (page-locked with CUDA), or other page-locked CUDA host
    memory (torch's `pin_memory`)."""
    if tensor.device.type != "cpu":
        return False
    address = tensor.data_ptr()
    if any(start <= address < start + length for start, length in _registered.items()):
        return True
    return _cuda() and tensor.is_pinned()


class PoolExhausted(RuntimeError):
    """Every slot of a PinnedPool is in use and the caller chose not to wait (or waited too long)."""


@dataclass
class PoolStats:
    slots: int
    slot_bytes: int
    in_use: int
    peak_in_use: int
    acquires: int
    waits: int  # acquires that had to wait for a release

    @property
    def total_bytes(self) -> int:
        return self.slots * self.slot_bytes


class PinnedBuffer:
    """One slot lent by a PinnedPool. Use `.view(shape, dtype)`; give it back with `.release()` or `with`."""

    def __init__(self, pool: PinnedPool, index: int, nbytes: int):
        self._pool, self.index, self.nbytes = pool, index, nbytes
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def view(self, shape: tuple[int, ...] | int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The slot's memory as a tensor of `shape` and `dtype` (must fit in the slot)."""
        if self._released:
            raise RuntimeError(f"buffer {self.index} of {self._pool.name!r} was used after release(); "
                               "acquire a new one")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
        if nbytes > self._pool.slot_bytes:
            raise ValueError(f"a {shape} {dtype} view needs {nbytes} bytes; slots of {self._pool.name!r} "
                             f"hold {self._pool.slot_bytes}")
        return self._pool._slot(self.index)[:nbytes].view(dtype).view(shape)

    def release(self) -> None:
        if self._released:
            raise RuntimeError(f"buffer {self.index} of {self._pool.name!r} was released twice")
        self._released = True
        self._pool._give_back(self.index)

    def __enter__(self) -> PinnedBuffer:
        return self

    def __exit__(self, *exc) -> None:
        if not self._released:
            self.release()


class PinnedPool:
    """`slots` buffers of `slot_bytes` each, in one aligned (pinned when CUDA exists) allocation.

    >>> pool = PinnedPool(slot_bytes=1 << 20, slots=4)
    >>> with pool.acquire() as buf:
    ...     x = buf.view((256, 1024), torch.float32)

    Thread-safe. `acquire(block=True)` waits for a release (up to `timeout` seconds, then
    PoolExhausted); `block=False` raises PoolExhausted at once.
    """

    def __init__(self, slot_bytes: int, slots: int, name: str = "pinned", alignment: int = ALIGNMENT):
        if not isinstance(slots, int) or slots <= 0:
            raise ValueError(f"slots must be a positive integer, got {slots!r}")
        if not isinstance(slot_bytes, int) or slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be a positive integer, got {slot_bytes!r}")
        self.name = name
        self.slot_bytes = slot_bytes
        self._stride = -(-slot_bytes // alignment) * alignment  # each slot starts aligned
        self._memory = aligned_empty(self._stride * slots, alignment)  # (slots * stride,) uint8
        self._free = list(range(slots - 1, -1, -1))  # a stack: the most recently released is reused first
        self._cond = threading.Condition()
        self._stats = PoolStats(slots, slot_bytes, 0, 0, 0, 0)

    def _slot(self, index: int) -> torch.Tensor:
        return self._memory[index * self._stride: index * self._stride + self.slot_bytes]

    def acquire(self, nbytes: int | None = None, block: bool = True, timeout: float | None = None) -> PinnedBuffer:
        """Lend one free slot. `nbytes` (default: a whole slot) must not exceed `slot_bytes`."""
        nbytes = self.slot_bytes if nbytes is None else nbytes
        if not 0 < nbytes <= self.slot_bytes:
            raise ValueError(f"asked {self.name!r} for {nbytes} bytes; its slots hold 1..{self.slot_bytes} "
                             f"bytes (make a pool with larger slots, or split the request)")
        with self._cond:
            if not self._free:
                if not block:
                    raise PoolExhausted(f"all {self._stats.slots} slots of {self.name!r} are in use; release one "
                                        "first, acquire with block=True, or make the pool larger")
                self._stats.waits += 1
                if not self._cond.wait_for(lambda: bool(self._free), timeout=timeout):
                    raise PoolExhausted(f"no slot of {self.name!r} was released within {timeout} s; is a "
                                        "buffer never released? (use `with pool.acquire() as buf:`)")
            index = self._free.pop()
            self._stats.in_use += 1
            self._stats.acquires += 1
            self._stats.peak_in_use = max(self._stats.peak_in_use, self._stats.in_use)
            return PinnedBuffer(self, index, nbytes)

    def _give_back(self, index: int) -> None:
        with self._cond:
            assert index not in self._free, "slot released twice"  # PinnedBuffer.release guards this
            self._free.append(index)
            self._stats.in_use -= 1
            self._cond.notify()

    def stats(self) -> PoolStats:
        with self._cond:
            return PoolStats(**vars(self._stats))

    @property
    def total_bytes(self) -> int:
        return self._memory.numel()
