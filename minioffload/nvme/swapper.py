"""The NVMe swapper: tensors to files and back, asynchronously, with O_DIRECT, checksums and crash-safe commits.

    swap = Swapper("/mnt/nvme/run1", block_size=1 << 20, workers=4)
    swap.write("sub0/master", tensor).result()     # durable once the future is done
    swap.read("sub0/master", into=tensor).result()  # verified against its checksum

How it moves bytes: a worker pool issues `os.pwritev`/`os.preadv` on page-aligned memory (the pinned pool's
buffers are), block by block, each worker on its own range of the file, with O_DIRECT so the page cache
neither copies the data nor evicts everything else. Where O_DIRECT is refused (tmpfs, some filesystems) it
falls back to buffered I/O and warns once. A tensor whose size is not a multiple of the 4 KiB alignment is
stored padded; its true size is recorded, and its last partial block goes through a small aligned bounce
buffer.

Why it does not lose state: every key has two slot files. A new version goes into the slot the index does
not point to, is fsync'ed, and only then does the index (index.json: write a temporary file, fsync, rename,
fsync the directory) point to it. A crash at any moment leaves the previous version readable. The index is
committed once for every write whose data is durable by then (a group commit), not once per write: with many small
writes in flight its rewrite would otherwise serialise them. Scratch that no crash need preserve (a step's
gradients) is written with `durable=False`: no fsync, indexed in memory only. Each stored
tensor carries an xxHash (XXH3-64) of its bytes, checked on every read unless `verify=False`: it runs at
many GB/s on one core, so it costs little next to the disk, where a CRC32 from zlib (~1 GB/s) would be
the bottleneck; a cryptographic hash would buy nothing against disk corruption.

Hard links: a checkpoint may hard-link a key's current slot file instead of copying it. A write never rewrites
a file that has another link: it unlinks its own name first and writes a new file, so the linked copy keeps its bytes.

A slower path on one drive: `max_bandwidth` (bytes/s) throttles a swapper in software. Each read and write then
takes at least nbytes / max_bandwidth, reads and writes sharing one link as they would share a remote tier's wire;
the wait is a sleep, which releases the GIL. This is how the course models a second, slower path (multi-path NVMe,
nvme/multipath.py) on a machine with one drive.

What this is not: a cache (every read goes to the file), or a file format for sharing checkpoints.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch

from ..kernels.checksum import bytes_of, checksum
from ..pinned import ALIGNMENT, aligned_empty
from . import index as index_file
from .index import DTYPES as _DTYPES
from .index import INDEX, SwapIOError, fsync_path  # noqa: F401 - the swapper's names for them
from .index import padded as _padded

_warned_buffered: set[str] = set()


class _ShortRead(Exception):
    """A read that got fewer bytes than the index says the file holds."""


class Swapper:
    """Asynchronous, durable tensor storage in one directory. `block_size`: bytes per system call (a multiple
    of 4096); `workers`: threads issuing them; `direct`: try O_DIRECT; `verify`: check checksums on read;
    `max_bandwidth`: bytes/s (None: unthrottled), a software throttle: each read or write takes at least
    nbytes / max_bandwidth (see the module docstring)."""

    def __init__(self, directory: str | Path, block_size: int = 1 << 20, workers: int = 4, direct: bool = True,
                 verify: bool = True, max_bandwidth: float | None = None):
        if block_size < ALIGNMENT or block_size % ALIGNMENT:
            raise ValueError(f"block_size must be a positive multiple of {ALIGNMENT} bytes, got {block_size}")
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be an int >= 1, got {workers!r}")
        if max_bandwidth is not None and (isinstance(max_bandwidth, bool) or not isinstance(max_bandwidth, (int, float))
                                          or not 0 < max_bandwidth < float("inf")):
            raise ValueError(f"max_bandwidth must be a positive number of bytes/s, or None for no throttle; got "
                             f"{max_bandwidth!r}")
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise FileNotFoundError(f"swap directory {self.directory} does not exist: create it first "
                                    f"(mkdir -p {self.directory}), on the NVMe drive you mean to use")
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise PermissionError(f"swap directory {self.directory} is not writable by this user: choose another "
                                  "or change its permissions")
        self.block_size, self.workers, self.verify, self.max_bandwidth = block_size, workers, verify, max_bandwidth
        self._link_free = 0.0  # throttled: when the modelled link finishes the operations already started
        self.direct = direct and self._direct_works()
        self._pool = ThreadPoolExecutor(workers, "swap-io")
        # after the blocks: a write's checksum and fsync (sync), then its index entry, committed with every other entry
        # ready by then (one commit thread); a read's checksum apart, so that a read never waits behind an fsync
        self._syncs, self._commits = ThreadPoolExecutor(2, "swap-sync"), ThreadPoolExecutor(1, "swap-commit")
        self._checks = ThreadPoolExecutor(1, "swap-check")
        self._pending: list[tuple[str, dict, object]] = []  # published writes waiting for the next index commit
        self._lock = threading.Lock()
        self._commit_lock = threading.Lock()  # one index commit at a time (they build on each other's index)
        self._key_busy: dict[str, Future] = {}  # the last operation queued on each key: the next one waits
        self._bounce = threading.local()
        self.index: dict[str, dict] = index_file.load(self.directory, self._file)
        self.trace = None  # a minioffload Trace: reads and writes become spans on nvme_read / nvme_write

    # setup -----------------------------------------------------------------------------------
    def _direct_works(self) -> bool:
        probe = self.directory / ".o_direct_probe"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o600)
            try:
                os.pwritev(fd, [memoryview(aligned_empty(ALIGNMENT, pin=False).numpy())], 0)
            finally:
                os.close(fd)
            return hasattr(os, "O_DIRECT")
        except OSError as err:
            if str(self.directory) not in _warned_buffered:
                _warned_buffered.add(str(self.directory))
                warnings.warn(f"O_DIRECT refused in {self.directory} ({err.strerror}; tmpfs and some filesystems "
                              "do this): using buffered I/O, which goes through the page cache", stacklevel=3)
            return False
        finally:
            probe.unlink(missing_ok=True)

    # checks (before any I/O) -------------------------------------------------------------------
    def _check_buffer(self, tensor: torch.Tensor, what: str) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            raise ValueError(f"{what} must be a CPU tensor (pinned host memory), got "
                             f"{getattr(tensor, 'device', type(tensor).__name__)}")
        if not tensor.is_contiguous():
            raise ValueError(f"{what} is not contiguous; copy it into a contiguous buffer first")
        if tensor.data_ptr() % ALIGNMENT:
            raise ValueError(f"{what} starts at an address that is not {ALIGNMENT}-byte aligned, which O_DIRECT "
                             "needs: take it from the pinned pool or minioffload.pinned.aligned_empty")
        if str(tensor.dtype) not in _DTYPES:
            raise ValueError(f"{what} has dtype {tensor.dtype}, which the swapper does not store")

    def _file(self, key: str, slot: int) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else f"%{ord(c):02x}" for c in key)
        return self.directory / f"{safe}.{slot}"

    # writes ----------------------------------------------------------------------------------
    def write(self, key: str, tensor: torch.Tensor, durable: bool = True) -> Future:
        """Store `tensor` under `key`; the future is done once the new version is durable and indexed. The
        tensor must not change until then. A failure leaves the previous version of `key` in place.

        `durable=False` (scratch that no crash need preserve: a step's gradients): the future is done once the
        bytes are written and indexed in memory, with no fsync and no index commit of its own; a read gets them
        back (checksummed) as usual, a later commit writes its entry with the others'."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty string, got {key!r}")
        self._check_buffer(tensor, f"the tensor for {key!r}")
        with self._lock:
            before = self._key_busy.get(key)
        nbytes = tensor.numel() * tensor.element_size()
        result = Future()

        def start() -> None:
            with self._lock:  # the slot the index does not point to (decided once earlier writes are in)
                slot = 1 - self.index[key]["slot"] if key in self.index else 0
            path = self._file(key, slot)
            started = time.perf_counter()
            try:
                if path.exists() and path.stat().st_nlink > 1:  # a checkpoint links it: leave that copy alone
                    path.unlink()
                fd = self._open(path, os.O_WRONLY | os.O_CREAT)
            except OSError as err:
                result.set_exception(self._error("open for writing", path, key, err))
                return
            try:
                self._size_file(fd, _padded(nbytes))
            except OSError as err:
                os.close(fd)
                self._release(key, slot)
                result.set_exception(self._error("allocate", path, key, err))
                return
            done_at = self._reserve(nbytes)
            jobs = [self._pool.submit(self._write_range, fd, tensor, nbytes, lo, hi)
                    for lo, hi in self._ranges(nbytes)]

            def sync() -> None:  # on a sync thread: the blocks out, the data durable; then the index, with others
                try:
                    try:
                        digest = checksum(tensor)  # while the blocks go out: the tensor does not change meanwhile
                        wait(jobs)  # every range, even after one failed: none may touch the fd once it is closed
                        for job in jobs:
                            job.result()
                        if durable:
                            os.fsync(fd)
                    finally:
                        os.close(fd)
                except BaseException as err:  # noqa: BLE001 - handed to the caller through the future
                    finish(err)
                    return
                entry = {"slot": slot, "nbytes": nbytes, "dtype": str(tensor.dtype), "shape": list(tensor.shape),
                         "checksum": digest}
                if durable:
                    self._publish(key, entry, finish)
                    return
                with self._lock:
                    self.index = {**self.index, key: entry}
                finish(None)

            def finish(err: BaseException | None) -> None:  # the index points at the new version, or it failed
                if err is None:
                    self._hold_until(done_at)
                    self._span("nvme_write", key, started, nbytes)
                    result.set_result(None)
                    return
                result.set_exception(self._error("write", path, key, err) if isinstance(err, OSError) else err)
                self._release(key, slot)

            self._syncs.submit(sync)

        self._after(before, start, result, key)
        return result

    @staticmethod
    def _size_file(fd: int, size: int) -> None:
        """Give the slot file exactly `size` bytes, allocated. Not O_TRUNC: rewriting blocks a file already holds
        is much faster than having the filesystem allocate them again during the write (ext4: ~1.6x here)."""
        current = os.fstat(fd).st_size
        if current > size:
            os.ftruncate(fd, size)
        elif current < size:
            os.posix_fallocate(fd, current, size - current)  # a full disk fails here, before any data moves

    def _write_range(self, fd: int, tensor: torch.Tensor, nbytes: int, lo: int, hi: int) -> None:
        data = bytes_of(tensor.reshape(-1))
        for offset in range(lo, hi, self.block_size):
            end = min(offset + self.block_size, hi)
            chunk = data[offset:end]
            if end == nbytes and (end - offset) % ALIGNMENT:  # the partial last block: pad it in a bounce buffer
                bounce = self._bounce_buffer()
                bounce[:] = 0
                bounce[:end - offset] = np.frombuffer(chunk, np.uint8)
                chunk = memoryview(bounce)[:_padded(end - offset)]
            written = os.pwritev(fd, [chunk], offset)
            if written != len(chunk):
                raise OSError(errno.EIO, f"short write: {written} of {len(chunk)} bytes at offset {offset}")

    def _publish(self, key: str, entry: dict, finish) -> None:
        """A write's data is durable: its entry joins the next index commit, and `finish(error or None)` runs then."""
        with self._lock:
            self._pending.append((key, entry, finish))
        self._commits.submit(self._flush)

    def _flush(self) -> None:
        """On the commit thread: every entry published since the last flush, committed in one index write (a group
        commit: the index is rewritten once for all of them, not once per write)."""
        with self._lock:
            batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            self._commit({key: entry for key, entry, _ in batch})
        except BaseException as err:  # noqa: BLE001 - each write's future gets it
            for _, _, finish in batch:
                finish(err)
            return
        for _, _, finish in batch:
            finish(None)

    def _commit(self, entries: dict[str, dict]) -> None:
        """Point the index at the new versions (index_file.replace: a temporary file, fsync, rename, fsync the
        directory); a failure changes nothing. The file work holds only the commit lock: every read and write takes
        `_lock` to start, and must not wait behind an fsync."""
        with self._commit_lock:
            with self._lock:
                index = {**self.index, **entries}
            index_file.replace(self.directory, index)
            with self._lock:  # merged: entries indexed in memory meanwhile (durable=False) stay
                self.index = {**self.index, **entries}

    def _release(self, key: str, slot: int) -> None:
        """After a failed write: remove its slot file, which the index does not point to (it held a version two
        writes old at most), so that a full disk gets the space back."""
        with self._lock:
            if self.index.get(key, {}).get("slot") == slot:
                return  # committed after all (the rename happened): the file is the key's current version
        self._file(key, slot).unlink(missing_ok=True)

    # reads -----------------------------------------------------------------------------------
    def read(self, key: str, into: torch.Tensor) -> Future:
        """Read `key`'s latest durable version into `into` (same size and dtype as written); the future is done
        when the bytes are in place and (with verify) checked."""
        with self._lock:
            entry = self.index.get(key)
            before = self._key_busy.get(key)
        if entry is None and before is None:
            known = ", ".join(sorted(self.index)[:5]) or "none"
            raise KeyError(f"no tensor stored under {key!r} in {self.directory} (keys: {known}"
                           f"{', ...' if len(self.index) > 5 else ''})")
        self._check_buffer(into, f"the buffer to read {key!r} into")
        if entry is not None:
            nbytes = into.numel() * into.element_size()
            if nbytes != entry["nbytes"] or str(into.dtype) != entry["dtype"]:
                raise ValueError(f"{key!r} holds {entry['nbytes']} bytes of {entry['dtype']}, the buffer "
                                 f"{nbytes} bytes of {into.dtype}: read it into a buffer like the one written")
        result = Future()

        def start() -> None:
            with self._lock:
                entry = self.index[key]
            path, nbytes = self._file(key, entry["slot"]), entry["nbytes"]
            started = time.perf_counter()
            try:
                fd = self._open(path, os.O_RDONLY)
            except OSError as err:
                result.set_exception(self._error("open for reading", path, key, err))
                return
            done_at = self._reserve(nbytes)
            jobs = [self._pool.submit(self._read_range, fd, into, nbytes, lo, hi) for lo, hi in self._ranges(nbytes)]

            def finish() -> None:
                try:
                    wait(jobs)  # every range, even after one failed: none may touch the fd once it is closed
                    for job in jobs:
                        job.result()
                    if self.verify and checksum(into) != entry["checksum"]:
                        raise SwapIOError(f"checksum mismatch reading {key!r} from {path}: the file is corrupt "
                                          "(the buffer holds what was read; do not use it)", path, key)
                    self._hold_until(done_at)
                    self._span("nvme_read", key, started, nbytes)
                    result.set_result(into)
                except SwapIOError as err:
                    result.set_exception(err)
                except _ShortRead as err:
                    result.set_exception(SwapIOError(
                        f"short read of {key!r} from {path} ({err}): the file is shorter than the index says "
                        "(truncated); the stored version is lost", path, key, err))
                except OSError as err:
                    result.set_exception(self._error("read", path, key, err))
                except BaseException as err:  # noqa: BLE001
                    result.set_exception(err)
                finally:
                    os.close(fd)

            self._checks.submit(finish)

        self._after(before, start, result, key)
        return result

    def _read_range(self, fd: int, into: torch.Tensor, nbytes: int, lo: int, hi: int) -> None:
        data = bytes_of(into.reshape(-1))
        for offset in range(lo, hi, self.block_size):
            end = min(offset + self.block_size, hi)
            partial = end == nbytes and (end - offset) % ALIGNMENT
            target = memoryview(self._bounce_buffer())[:_padded(end - offset)] if partial else data[offset:end]
            got = os.preadv(fd, [target], offset)
            if got < end - offset:
                raise _ShortRead(f"got {got} of {end - offset} bytes at offset {offset}")
            if partial:
                data[offset:end] = target[:end - offset]

    # the throttle ----------------------------------------------------------------------------
    def _reserve(self, nbytes: int) -> float | None:
        """Throttled: book `nbytes` on the modelled link, after what it already carries; when they are through."""
        if self.max_bandwidth is None:
            return None
        with self._lock:
            self._link_free = max(time.perf_counter(), self._link_free) + nbytes / self.max_bandwidth
            return self._link_free

    @staticmethod
    def _hold_until(done_at: float | None) -> None:
        while done_at is not None and (left := done_at - time.perf_counter()) > 0:
            time.sleep(left)  # releases the GIL

    # plumbing --------------------------------------------------------------------------------
    def _open(self, path: Path, flags: int) -> int:
        return os.open(path, flags | (os.O_DIRECT if self.direct else 0), 0o600)

    def _ranges(self, nbytes: int) -> list[tuple[int, int]]:
        """Split [0, nbytes) into at most `workers` ranges of whole blocks."""
        blocks = max(1, -(-nbytes // self.block_size))
        per = -(-blocks // self.workers) * self.block_size
        return [(lo, min(lo + per, nbytes)) for lo in range(0, max(nbytes, 1), per)] if nbytes else []

    def _bounce_buffer(self) -> np.ndarray:
        if getattr(self._bounce, "buffer", None) is None or len(self._bounce.buffer) < self.block_size:
            self._bounce.buffer = aligned_empty(self.block_size, pin=False).numpy()
        return self._bounce.buffer

    def _after(self, before: Future | None, start, result: Future, key: str) -> None:
        """Run `start` once the previous operation on the same key is done (in order, per key)."""
        def guarded() -> None:
            try:
                start()
            except BaseException as err:  # noqa: BLE001 - never leave the future pending
                if not result.done():
                    result.set_exception(err)

        with self._lock:
            self._key_busy[key] = result
        if before is None or before.done():
            guarded()
        else:
            before.add_done_callback(lambda _: guarded())
        # the callback is handed the future: capturing `result` would make a cycle (the future -> its callback -> the
        # future) that keeps a read's buffer, the future's result, alive until the garbage collector runs
        result.add_done_callback(lambda done: self._done(key, done))

    def _done(self, key: str, result: Future) -> None:
        with self._lock:
            if self._key_busy.get(key) is result:
                del self._key_busy[key]

    def _error(self, action: str, path: Path, key: str, err: OSError) -> SwapIOError:
        hint = {errno.ENOSPC: "the disk is full: free space or use another directory",
                errno.EFBIG: "the file size limit was reached (ulimit -f)",
                errno.EACCES: "permission denied", errno.EROFS: "the filesystem is read-only",
                errno.EIO: "an I/O error from the device"}.get(err.errno, err.strerror or str(err))
        if err.errno == errno.EIO and err.strerror and err.strerror != os.strerror(errno.EIO):
            hint = err.strerror  # our own EIO (a short write), which says what happened
        if not self.directory.is_dir():
            return SwapIOError(f"could not {action} {key!r}: the swap directory {self.directory} is gone (removed or "
                               "unmounted while the run used it); restore it, or resume from the last checkpoint",
                               path, key, err)
        return SwapIOError(f"could not {action} {key!r} ({path}): {hint}; the previous version is intact",
                           path, key, err)

    def _span(self, lane: str, key: str, started: float, nbytes: int) -> None:
        if self.trace is not None:
            origin = self.trace.origin
            self.trace.record(lane, key, started - origin, time.perf_counter() - origin, nbytes)

    def drain(self) -> None:
        """Wait until every operation queued so far is done (its errors stay with its future)."""
        while True:
            with self._lock:
                busy = [future for future in self._key_busy.values() if not future.done()]
            if not busy:
                return
            wait(busy)

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self.index)

    def current_file(self, key: str) -> Path:
        """The slot file the index points to for `key`: its latest durable version (a checkpoint may link it)."""
        with self._lock:
            entry = self.index.get(key)
        if entry is None:
            raise KeyError(f"no tensor stored under {key!r} in {self.directory}")
        return self._file(key, entry["slot"])

    def close(self) -> None:
        """Wait for every queued operation, then stop the workers."""
        self._syncs.shutdown(wait=True)
        self._commits.shutdown(wait=True)
        self._checks.shutdown(wait=True)
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Swapper:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
