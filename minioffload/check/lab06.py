"""Graders for Lab 6, "Past host memory": aligned block I/O with O_DIRECT (6.1), the crash-safe commit of a new
version (6.2), the three-stage read-update-write pipeline (6.3), and the bytes per tier with the optimizer state on
NVMe (6.4).

Task 6.1 runs on a real file in a temporary folder under the current directory (not /tmp, which may be tmpfs,
where O_DIRECT is refused), opened with O_DIRECT where the filesystem allows it. It also logs every positioned
read and write, so that a call O_DIRECT refuses with EINVAL, or would refuse, is named with the rule it breaks.

Task 6.2 simulates a power cut at every step of the learner's commit. os.fsync, os.replace and the version writer
are wrapped; at each step in turn the grader stops the function and rebuilds what a drive would hold by POSIX
rules: a file's bytes as of its last fsync (bytes written since are torn, half new and half old), a name as of
its directory's last fsync. A reader that trusts index.json must find the old or the new version whole, and the
new one after the function has returned. The real fsync is not called: the model stands in for the drive.

Task 6.3 runs the learner's pipeline against a fake drive on a thread pool whose stages sleep. Every call and
every future's completion moves a buffer through free -> reading -> read -> updated -> writing -> free, and a call
out of turn fails at once with the rule it breaks. A slow read and a slow write make a missing wait collide with
a future still in flight whatever the scheduling; a balanced run then checks that the stages overlap.
Verdicts carry counts and sizes, never timings, so they are the same on every run.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import random
import shutil
import stat
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

from ..memory import MODELS, PRECISIONS, TIERS, footprint, format_bytes
from ..pinned import ALIGNMENT, aligned_empty
from . import grader


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _direct_works(directory: Path) -> bool:
    """Whether this filesystem accepts an O_DIRECT write of one aligned page (tmpfs and some others refuse)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.pwritev(fd, [memoryview(aligned_empty(ALIGNMENT, pin=False).numpy())], 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


@contextmanager
def _scratch() -> Iterator[tuple[Path, bool]]:
    """A temporary folder on the current directory's filesystem (the system's if O_DIRECT works only there),
    removed afterwards, and whether O_DIRECT works in it."""
    folder, direct = None, False
    for parent in (os.getcwd(), tempfile.gettempdir()):
        try:
            candidate = Path(tempfile.mkdtemp(prefix=".lab06-", dir=parent))
        except OSError:
            continue
        if _direct_works(candidate):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            folder, direct = candidate, True
            break
        if folder is None:
            folder = candidate  # the first writable one, in case no filesystem here takes O_DIRECT
        else:
            shutil.rmtree(candidate, ignore_errors=True)
    assert folder is not None, "the check needs a writable folder: run it from a folder you can write in"
    try:
        yield folder, direct
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def _patched(replacements: dict[str, Callable]) -> Iterator[dict[str, Callable]]:
    """Replace os functions for calls from this thread only; other threads get the real ones."""
    real = {name: getattr(os, name) for name in replacements}
    owner = threading.get_ident()

    def route(name: str) -> Callable:
        def call(*args, **kwargs):
            spy = replacements[name] if threading.get_ident() == owner else real[name]
            return spy(*args, **kwargs)
        return call

    try:
        for name in replacements:
            setattr(os, name, route(name))
        yield real
    finally:
        for name, fn in real.items():
            setattr(os, name, fn)


def _first_difference(a: bytes, b: bytes) -> int:
    same = np.frombuffer(a[:len(b)], np.uint8) == np.frombuffer(b[:len(a)], np.uint8)
    return int(np.argmin(same)) if not same.all() else min(len(a), len(b))


# ---------------------------------------------------------------------------------------------
# Task 6.1: aligned block I/O

BLOCK_CASES = (  # (block_size, nbytes): four multiples of 4096, the rest with a partial last page
    (16384, 1), (16384, 1000), (16384, 4096), (16384, 4097), (16384, 16384), (16384, 16384 + 5000),
    (16384, 3 * 16384), (16384, 5 * 16384 + 123), (4096, 12345), (65536, 3 * 65536), (65536, 200_000),
)
POSITIONED = ("pwritev", "preadv", "pwrite", "pread")


@dataclass
class _Call:
    name: str
    offset: int | None
    buffers: list[tuple[int | None, int]]  # (address or None if unknown, length) per buffer

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.buffers)


def _buffer(buffer) -> tuple[int | None, int]:
    try:
        view = memoryview(buffer)
    except TypeError:
        return None, 0
    if not view.c_contiguous:
        return None, view.nbytes
    if view.nbytes == 0:
        return 0, 0
    return int(np.frombuffer(view.cast("B") if view.ndim != 1 or view.format != "B" else view,
                             np.uint8).ctypes.data), view.nbytes


def _record(name: str, args: tuple, kwargs: dict) -> _Call:
    if name in ("pwritev", "preadv"):
        buffers = args[1] if len(args) > 1 else kwargs.get("buffers", [])
        offset = args[2] if len(args) > 2 else None
        return _Call(name, offset, [_buffer(b) for b in buffers])
    if name == "pwrite":
        return _Call(name, args[2] if len(args) > 2 else None, [_buffer(args[1])])
    return _Call(name, args[2] if len(args) > 2 else None, [(None, args[1] if len(args) > 1 else 0)])  # pread


def _broken_rule(call: _Call, block_size: int, nbytes: int) -> str | None:
    """Which O_DIRECT rule (or block rule) a call breaks, said so that a learner can fix it; None if none."""
    where = f"os.{call.name} at offset {call.offset}"
    if call.name == "pread":
        return (f"{where}: os.pread returns a new bytes object, which is not page-aligned memory: read with "
                "os.preadv into the buffer (or into an aligned bounce buffer)")
    if any(address is None or address % ALIGNMENT for address, _ in call.buffers):
        return (f"{where} was given memory at an address that is not a multiple of {ALIGNMENT}: O_DIRECT moves "
                "whole pages from aligned memory. A bytes object, a bytearray or a slice that starts inside a page "
                "is not aligned; use a slice of the buffer at a block offset, or an aligned bounce buffer "
                "(aligned_empty)")
    if call.nbytes % ALIGNMENT:
        action = ("padded with zeros" if call.name.startswith("pwrite") else
                  "then copy only the bytes that belong to the data out of it")
        return (f"{where} moved {call.nbytes} bytes, not a multiple of {ALIGNMENT}: the partial last block must "
                f"go through an aligned bounce buffer of padded(length) bytes, {action}")
    if call.offset is None or call.offset % ALIGNMENT:
        return f"{where}: file offsets must be multiples of {ALIGNMENT}: blocks start at 0, block_size, ..."
    if call.nbytes > block_size:
        return (f"{where} moved {call.nbytes} bytes in one call: move one block per call, at most block_size "
                f"({block_size}) bytes")
    if call.offset + call.nbytes > _padded(nbytes):
        return f"{where} moved {call.nbytes} bytes, past the padded end of the data ({_padded(nbytes)} bytes)"
    return None


def _run_blocks(fn: Callable, write: bool, path: Path, direct: bool, buffer: memoryview, nbytes: int,
                block_size: int, what: str) -> list[_Call]:
    """Run one write or read on an fd the grader opens (with O_DIRECT if it can); return the positioned calls."""
    calls: list[_Call] = []

    def spy(name: str) -> Callable:
        def call(*args, **kwargs):
            calls.append(_record(name, args, kwargs))
            return real[name](*args, **kwargs)
        return call

    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if write else os.O_RDONLY
    fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o600)
    try:
        with _patched({name: spy(name) for name in POSITIONED}) as real:
            fn(write, fd, buffer, nbytes, block_size)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        broken = next((rule for c in calls if (rule := _broken_rule(c, block_size, nbytes))), None)
        raise AssertionError(f"{what}: O_DIRECT refused a call with EINVAL (invalid argument). "
                             + (broken or f"Every buffer address, length and file offset must be a multiple of "
                                f"{ALIGNMENT}; read and write with os.preadv/os.pwritev on aligned memory")) from None
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    for c in calls:
        rule = _broken_rule(c, block_size, nbytes)
        assert rule is None, f"{what}: {rule}"
    return calls


def _require_calls(calls: list[_Call], write: bool, what: str) -> None:
    wanted = "os.pwritev(fd, [chunk], offset)" if write else "os.preadv(fd, [chunk], offset)"
    assert calls, f"{what}: no positioned read or write was seen: use {wanted}, called through the os module"


def _aligned(nbytes: int, fill: int | bytes) -> np.ndarray:
    array = aligned_empty(_padded(nbytes), pin=False).numpy()
    if isinstance(fill, int):
        array[:] = fill
    else:
        array[:nbytes] = np.frombuffer(fill, np.uint8)
    return array


@grader("6.1")
def block_io(fn: Callable) -> str:
    """fn(write, fd, buffer, nbytes, block_size): write_blocks(fd, buffer, block_size) if write, else
    read_blocks(fd, buffer, nbytes, block_size); buffer is a memoryview of nbytes aligned bytes."""
    rng = random.Random(61)
    with _scratch() as (folder, direct):
        for number, (block_size, nbytes) in enumerate(BLOCK_CASES):
            data = rng.randbytes(nbytes)
            path = folder / f"case{number}"
            what = f"write_blocks({nbytes} bytes, block_size={block_size})"
            source = _aligned(nbytes, data)
            calls = _run_blocks(fn, True, path, direct, memoryview(source)[:nbytes], nbytes, block_size, what)
            stored = path.read_bytes()
            assert len(stored) == _padded(nbytes), (
                f"{what} left a file of {len(stored)} bytes; expected {_padded(nbytes)}, the data padded to a "
                f"multiple of {ALIGNMENT}" + (": the partial last block goes through an aligned bounce buffer, "
                                              "written whole" if len(stored) < _padded(nbytes) else ""))
            if stored[:nbytes] != data:
                at = _first_difference(stored[:nbytes], data)
                raise AssertionError(f"{what}: the file differs from the data from byte {at} on (the block at "
                                     f"offset {at // block_size * block_size})")
            assert not any(stored[nbytes:]), (
                f"{what}: the padding after the data is not zeros: zero the bounce buffer before copying the "
                "partial block in (aligned_empty's memory is not cleared), or stale bytes end up on the drive")
            _require_calls(calls, True, what)

            what = f"read_blocks({nbytes} bytes, block_size={block_size})"
            path.write_bytes(data + b"\xee" * (_padded(nbytes) - nbytes))  # padding that must not come back
            into = _aligned(nbytes, 0xAB)
            calls = _run_blocks(fn, False, path, direct, memoryview(into)[:nbytes], nbytes, block_size, what)
            got = into[:nbytes].tobytes()
            if got != data:
                at = _first_difference(got, data)
                last = (nbytes - 1) // block_size * block_size
                hint = (": the partial last block is read padded into a bounce buffer, then its first "
                        "nbytes - offset bytes are copied into the buffer" if at >= last and nbytes % ALIGNMENT else
                        ": read every block, at offsets 0, block_size, 2 * block_size, ...")
                raise AssertionError(f"{what}: the buffer differs from the file from byte {at} on{hint}")
            _require_calls(calls, False, what)
    multiples = sum(1 for _, n in BLOCK_CASES if n % ALIGNMENT == 0)
    sizes = [n for _, n in BLOCK_CASES]
    blocks = sorted({b for b, _ in BLOCK_CASES})
    return (f"{len(BLOCK_CASES)} sizes from {min(sizes)} B to {max(sizes) // 1024} KiB ({multiples} of them "
            f"multiples of {ALIGNMENT}), blocks of {blocks[0] // 1024}-{blocks[-1] // 1024} KiB: files bit-exact and "
            f"padded with zeros to whole pages, reads bit-exact, every call's address, length and offset a multiple "
            f"of {ALIGNMENT} (the file opened with O_DIRECT where the filesystem allows it)")


# ---------------------------------------------------------------------------------------------
# Task 6.2: the commit protocol, under simulated crashes

INDEX = "index.json"
VERSION_BYTES = 6000


def _version(seed: int) -> bytes:
    return random.Random(seed).randbytes(VERSION_BYTES)


def _entry(slot: int, data: bytes) -> dict:
    return {"slot": slot, "nbytes": len(data), "checksum": xxhash.xxh3_64_hexdigest(data)}


@dataclass(frozen=True)
class _Scenario:
    what: str
    files: dict[str, bytes]  # on disk before the commit (the index is added)
    index: dict[str, dict]
    key: str
    new: bytes

    def old(self, key: str) -> bytes | None:
        entry = self.index.get(key)
        return None if entry is None else self.files[f"{key}.{entry['slot']}"]


def _scenarios() -> list[_Scenario]:
    a_older, a_old, a_new, b_old, b_older, c_new = (_version(seed) for seed in range(6))
    return [
        _Scenario("into a new slot file", {"a.0": a_old, "b.1": b_old, "b.0": b_older},
                  {"a": _entry(0, a_old), "b": _entry(1, b_old)}, "a", a_new),
        _Scenario("over a stale slot file", {"a.0": a_older, "a.1": a_old, "b.1": b_old},
                  {"a": _entry(1, a_old), "b": _entry(1, b_old)}, "a", a_new),
        _Scenario("of a new key", {"a.0": a_old}, {"a": _entry(0, a_old)}, "c", c_new),
    ]


class _Disk:
    """What a power cut would leave in one folder, by POSIX rules: a file's bytes as of its last fsync, the
    folder's names as of the folder's last fsync. Files are known by inode, as the filesystem knows them."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.names = self.listing()
        self.data = {ino: (folder / name).read_bytes() for name, ino in self.names.items()}

    def listing(self) -> dict[str, int]:
        with os.scandir(self.folder) as entries:
            return {e.name: e.inode() for e in entries if e.is_file(follow_symlinks=False)}

    def name_of(self, ino: int) -> str | None:
        return next((name for name, i in self.listing().items() if i == ino), None)

    def current(self, ino: int) -> bytes | None:
        name = self.name_of(ino)
        return None if name is None else (self.folder / name).read_bytes()

    def durable(self, ino: int | None) -> bool:
        if ino is None:
            return False
        now = self.current(ino)
        return now is None or now == self.data.get(ino)

    def describe(self, fd: int) -> tuple[str, int | None]:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return ("the folder" if os.path.samestat(st, os.stat(self.folder)) else "another folder"), None
        return (self.name_of(st.st_ino) or "a file outside the folder"), st.st_ino

    def fsync(self, fd: int) -> None:
        st = os.fstat(fd)  # EBADF for a bad fd, as the real fsync
        if stat.S_ISDIR(st.st_mode):
            if os.path.samestat(st, os.stat(self.folder)):
                self.names = self.listing()
            return
        now = self.current(st.st_ino)
        if now is None:
            try:
                now = Path(f"/proc/self/fd/{fd}").read_bytes()
            except OSError:
                return
        self.data[st.st_ino] = now

    def after_crash(self) -> dict[str, bytes]:
        image = {}
        for name, ino in self.names.items():
            durable = self.data.get(ino, b"")
            now = self.current(ino)
            if now is None or now == durable:
                image[name] = durable
            else:  # written since its last fsync: torn, the first half new and the rest as it was
                half = len(now) // 2
                tail = durable[half:len(now)]
                image[name] = now[:half] + tail + bytes(len(now) - half - len(tail))
        return image


class _Crash(BaseException):  # the simulated power cut: a BaseException, so `except Exception` lets it pass
    pass


@dataclass
class _Step:
    kind: str  # "write_version", "fsync", "replace"
    target: str  # file name, "the folder", or "src -> dst" for a replace
    ino: int | None = None
    src_ino: int | None = None
    dst: str = ""
    src: str = ""
    version_durable: bool = False  # at a replace: the new version's file
    src_durable: bool = False  # at a replace: the file renamed


@dataclass
class _Run:
    steps: list[_Step] = field(default_factory=list)
    image: dict[str, bytes] | None = None
    returned: dict | None = None
    index_changed: bool = False
    version_ino: int | None = None
    on_disk: object = None  # index.json after the function returned


def _describe(step: _Step) -> str:
    if step.kind == "write_version":
        return f"while write_version was writing {step.target}"
    if step.kind == "fsync":
        return f"just before os.fsync of {step.target}"
    return f"just before os.{step.kind}({step.src} -> {step.dst})"


def _commit_run(fn: Callable, folder: Path, scenario: _Scenario, crash_at: int | None) -> _Run:
    """Run fn on a fresh copy of the scenario; stop it at step `crash_at` (None: let it return)."""
    folder.mkdir()
    for name, data in scenario.files.items():
        (folder / name).write_bytes(data)
    (folder / INDEX).write_text(json.dumps(scenario.index))
    disk, run = _Disk(folder), _Run()
    given = json.loads(json.dumps(scenario.index))

    def step(s: _Step) -> None:
        run.steps.append(s)
        if crash_at is not None and len(run.steps) - 1 == crash_at:
            run.image = disk.after_crash()
            raise _Crash

    def fsync(fd) -> None:
        fd = fd if isinstance(fd, int) else fd.fileno()  # os.fsync takes a file object too
        name, ino = disk.describe(fd)
        step(_Step("fsync", name, ino))
        disk.fsync(fd)

    def rename(kind: str) -> Callable:
        def call(src, dst, *args, **kwargs):
            src_ino = os.stat(src).st_ino if os.path.exists(src) else None
            s = _Step(kind, f"{Path(src).name} -> {Path(dst).name}", src_ino=src_ino, src=Path(src).name,
                      dst=Path(dst).name, version_durable=disk.durable(run.version_ino),
                      src_durable=disk.durable(src_ino))
            step(s)
            return real[kind](src, dst, *args, **kwargs)
        return call

    def write_version(fd: int) -> dict:
        if isinstance(fd, bool) or not isinstance(fd, int):
            raise AssertionError(f"write_version was given a {type(fd).__name__}; it takes the file descriptor "
                                 "you opened, fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)")
        name, ino = disk.describe(fd)
        run.version_ino = ino
        half = len(scenario.new) // 2
        os.write(fd, scenario.new[:half])
        step(_Step("write_version", name, ino))  # a crash here leaves the first half written
        os.write(fd, scenario.new[half:])
        return {"nbytes": len(scenario.new), "checksum": xxhash.xxh3_64_hexdigest(scenario.new)}

    with _patched({"fsync": fsync, "fdatasync": fsync, "replace": rename("replace"),
                   "rename": rename("rename")}) as real:
        try:
            run.returned = fn(folder, scenario.key, write_version, given)
        except _Crash:
            pass
    if run.image is None:  # it returned: a power cut right now
        run.image = disk.after_crash()
        try:
            run.on_disk = json.loads((folder / INDEX).read_text())
        except (OSError, ValueError):
            run.on_disk = None
    run.index_changed = given != scenario.index
    return run


def _read_image(image: dict[str, bytes], scenario: _Scenario) -> dict[str, str] | str:
    """What a reader that trusts index.json finds: {key: "old" | "new" | "absent"}, or what stops it."""
    if INDEX not in image:
        return "there is no index.json"
    try:
        index = json.loads(image[INDEX])
    except ValueError:
        return "index.json is not valid JSON (half written)"
    if not isinstance(index, dict):
        return f"index.json holds {type(index).__name__}, not a dict of keys"
    found = {}
    for key in {*scenario.index, scenario.key}:
        entry = index.get(key)
        if entry is None:
            found[key] = "absent"
            continue
        if not isinstance(entry, dict) or not {"slot", "nbytes", "checksum"} <= entry.keys():
            return (f"the index entry of {key!r} is {entry!r:.80}; expected {{'slot': ..., 'nbytes': ..., "
                    "'checksum': ...}: the slot, plus what write_version returned")
        name = f"{key}.{entry['slot']}"
        if name not in image:
            return f"the index points {key!r} at {name}, which is not on the drive"
        data = image[name][:entry["nbytes"]]
        if xxhash.xxh3_64_hexdigest(data) != entry["checksum"]:
            return (f"the index points {key!r} at {name}, whose bytes do not match the checksum it records (a torn "
                    "or half-written version)")
        found[key] = "new" if key == scenario.key and data == scenario.new else (
            "old" if data == scenario.old(key) else "unknown")
    return found


def _protocol_hint(steps: list[_Step], scenario: _Scenario) -> str:
    """From the steps of an uninterrupted run: the first rule of the protocol it breaks."""
    writes = [s for s in steps if s.kind == "write_version"]
    old = scenario.index.get(scenario.key)
    if writes and old is not None and writes[0].target == f"{scenario.key}.{old['slot']}":
        return (f"you wrote the new version into {writes[0].target}, the slot the index points to: write it into "
                "the other slot, 1 - index[key]['slot'] (slot 0 for a new key)")
    renames = [i for i, s in enumerate(steps) if s.kind in ("replace", "rename") and s.dst == INDEX]
    if not renames:
        return (f"write the new index into a temporary file and os.replace it over {INDEX}: a file rewritten in "
                "place can be half old, half new after a crash")
    at = steps[renames[0]]
    if not at.version_durable:
        return ("fsync the new version's file (os.fsync(fd) after write_version) before the index points to it: "
                "otherwise the index can reach the drive before the data")
    if not at.src_durable:
        synced = any(s.kind == "fsync" and s.ino == at.src_ino for s in steps[:renames[0]])
        return ("flush the temporary index (f.flush()) before os.fsync(f.fileno()): fsync only reaches the bytes "
                "Python has handed to the OS" if synced else
                f"fsync the temporary index ({at.src}) before os.replace: the rename can reach the drive before the "
                "file's bytes")
    if not any(s.kind == "fsync" and s.target == "the folder" for s in steps[renames[0] + 1:]):
        return ("fsync the folder after os.replace (fd = os.open(directory, os.O_RDONLY); os.fsync(fd); "
                "os.close(fd)): until then the rename itself may not be on the drive")
    return "write the version, fsync it, then the index: temporary file, fsync, os.replace, fsync the folder"


@grader("6.2")
def commit(fn: Callable) -> str:
    """fn(directory, key, write_version, index) -> the new index, on disk by the protocol."""
    scenarios, crashes = _scenarios(), 0
    with _scratch() as (folder, _):
        runs = itertools.count()
        for scenario in scenarios:
            what = (f"a commit of {scenario.key!r} {scenario.what}" if scenario.key in scenario.index else
                    f"the first commit of a new key, {scenario.key!r}")
            old = scenario.index.get(scenario.key)
            clean = _commit_run(fn, folder / f"run{next(runs)}", scenario, None)
            assert isinstance(clean.returned, dict), (
                f"{what}: commit returned {clean.returned!r:.60}; expected the new index, a dict")
            hint = _protocol_hint(clean.steps, scenario)
            trials = [(crash_at, _commit_run(fn, folder / f"run{next(runs)}", scenario, crash_at))
                      for crash_at in range(len(clean.steps))] + [(None, clean)]
            for crash_at, run in trials:
                crashes += 1
                when = "right after commit returned" if crash_at is None else _describe(clean.steps[crash_at])
                found = _read_image(run.image, scenario)
                if isinstance(found, str):
                    raise AssertionError(f"{what}: after a power cut {when}, {found}: {hint}")
                for key, version in sorted(found.items()):
                    if key != scenario.key:
                        assert version == "old", (
                            f"{what}: after a power cut {when}, the reader finds {key!r} {version}, not as it was: "
                            "a commit of one key copies every other entry of the index unchanged")
                    elif crash_at is None:
                        assert version == "new", (
                            f"{what}: commit returned, but a power cut right after it brings back "
                            f"{'the previous version' if version == 'old' else 'no version'}: {hint}")
                    elif version == "unknown" or (version == "absent" and old is not None):
                        raise AssertionError(f"{what}: after a power cut {when}, the reader finds "
                                             f"{'no version' if version == 'absent' else 'neither version'} of "
                                             f"{key!r}: {hint}")
                if crash_at is not None and run.index_changed:
                    raise AssertionError(f"{what}: a power cut {when} left the index dict you were given changed: "
                                         "build a new one ({**index, key: entry}) and return it; the caller keeps "
                                         "the old one until the commit is done")
            assert clean.on_disk == clean.returned, (
                f"{what}: the index commit returned differs from {INDEX} on disk: return the dict you wrote there")
            entry = clean.returned.get(scenario.key)
            assert isinstance(entry, dict) and entry.get("slot") in (0, 1), (
                f"{what}: the index commit returned has no entry with a slot 0 or 1 for {scenario.key!r}")
            assert old is None or entry["slot"] != old["slot"], (
                f"{what}: the new index points {scenario.key!r} at the slot the old one pointed to: {hint}")
    return (f"{crashes} simulated power cuts in {len(scenarios)} commits ({', '.join(s.what for s in scenarios)}): "
            "after each, the index on the drive led to a complete version, the old one or the new one, never a "
            "mix, and to the new one once commit had returned")


# ---------------------------------------------------------------------------------------------
# Task 6.3: the three-stage pipeline

BUFFERS = 3
BUFFER_FLOATS = 1024
# (name, n, read, update, write seconds): a slow stage makes a missing wait meet a future still in flight.
PIPELINE_SCENARIOS = (
    ("no subgroups", 0, 0.001, 0.001, 0.001),
    ("one subgroup", 1, 0.005, 0.001, 0.005),
    ("two subgroups", 2, 0.005, 0.001, 0.005),
    ("a slow read", 6, 0.060, 0.005, 0.005),
    ("a slow write", 8, 0.005, 0.005, 0.080),
)
BALANCED = ("three stages of 20 ms", 12, 0.020, 0.020, 0.020)
SERIAL_SHARE = 0.75  # the balanced run must take less than this share of n * (read + update + write)
ATTEMPTS = 3  # the best of: a loaded machine can slow one run


class _Violation(AssertionError):
    pass


class _FakeDrive:
    """read/update/write for the learner, on a thread pool, tracking each buffer's state under one lock."""

    def __init__(self, pool: ThreadPoolExecutor, buffers: list, n: int, stages: tuple[float, float, float]):
        self.pool, self.buffers, self.n = pool, buffers, n
        self.read_s, self.update_s, self.write_s = stages
        self.number = {id(b): i for i, b in enumerate(buffers)}
        self.state: dict[int, tuple[str, int | None]] = {i: ("free", None) for i in range(len(buffers))}
        self.lock = threading.Lock()
        self.counts: dict[str, Counter] = {"read": Counter(), "update": Counter(), "write": Counter()}
        self.stored: dict[int, bool] = {}
        self.problems: list[str] = []
        self.log: list[tuple[float, str, int]] = []  # (time, "read"/"update"/"read done"/"write done"..., k)

    def _buffer(self, call: str, k: int, buf) -> int:
        if id(buf) not in self.number:
            raise _Violation(f"{call}({k}, buf) was given a buffer that is not one of `buffers`: allocate none, "
                             "reuse the ones given (host memory holds only those)")
        if not isinstance(k, int) or not 0 <= k < self.n:
            raise _Violation(f"{call}({k!r}, ...): subgroups are numbered 0 to n - 1 = {self.n - 1}")
        self.counts[call][k] += 1
        if self.counts[call][k] > 1:
            raise _Violation(f"{call}({k}, ...) was called twice: each subgroup is read, updated and written once")
        return self.number[id(buf)]

    def _note(self, what: str, k: int) -> None:
        self.log.append((time.perf_counter(), what, k))

    def read(self, k: int, buf) -> Future:
        with self.lock:
            b = self._buffer("read", k, buf)
            state, j = self.state[b]
            if state == "writing":
                raise _Violation(f"read({k}) started into buffer {b} while write({j}) from it was still in flight: "
                                 f"the drive would write subgroup {k}'s data as subgroup {j}. Wait for a buffer's "
                                 "write future before reading into it again")
            if state != "free":
                raise _Violation(f"read({k}) started into buffer {b}, which still held subgroup {j} ({state}, not "
                                 "written back yet)")
            self.state[b] = ("reading", k)
            self._note("read", k)

        def work() -> None:
            time.sleep(self.read_s)
            buf.fill_(float(k))
            with self.lock:
                self.state[b] = ("read", k)
                self._note("read done", k)
        return self.pool.submit(work)

    def update(self, k: int, buf) -> None:
        with self.lock:
            b = self._buffer("update", k, buf)
            state, j = self.state[b]
            if state == "reading" and j == k:
                raise _Violation(f"update({k}) ran before read({k}) had finished: wait for the read's future "
                                 "(.result()) before updating")
            if (state, j) != ("read", k):
                raise _Violation(f"update({k}) was given buffer {b}, which holds "
                                 + (f"subgroup {j} ({state})" if j is not None else "no subgroup")
                                 + ": update each subgroup in the buffer it was read into")
            self._note("update", k)
        if not bool((buf == float(k)).all()):
            raise _Violation(f"update({k}): buffer {b} does not hold subgroup {k}'s data (it changed after the read)")
        time.sleep(self.update_s)
        buf.add_(0.5)
        with self.lock:
            self.state[b] = ("updated", k)
            self._note("update done", k)

    def write(self, k: int, buf) -> Future:
        with self.lock:
            b = self._buffer("write", k, buf)
            state, j = self.state[b]
            if (state, j) != ("updated", k):
                raise _Violation(f"write({k}) was given buffer {b}, which holds "
                                 + (f"subgroup {j} ({state})" if j is not None else "no subgroup")
                                 + f": write subgroup {k} back once it is updated, from its buffer")
            self.state[b] = ("writing", k)
            self._note("write", k)

        def work() -> None:
            time.sleep(self.write_s)
            with self.lock:
                if not bool((buf == k + 0.5).all()):
                    self.problems.append(f"buffer {b} changed while write({k}) was still in flight: wait for a "
                                         "buffer's write future before reusing it")
                self.stored[k] = True
                self.state[b] = ("free", None)
                self._note("write done", k)
        return self.pool.submit(work)

    def in_flight(self) -> list[int]:
        with self.lock:
            return sorted(j for state, j in self.state.values() if state == "writing")


def _pipeline_run(fn: Callable, scenario: tuple) -> tuple[float, _FakeDrive]:
    name, n, *stages = scenario
    buffers = [aligned_empty(BUFFER_FLOATS * 4, pin=False).view(torch.float32)
               for _ in range(BUFFERS)]
    with ThreadPoolExecutor(4, thread_name_prefix="fake-drive") as pool:
        drive = _FakeDrive(pool, buffers, n, tuple(stages))
        started = time.perf_counter()
        try:
            fn(n, drive.read, drive.update, drive.write, list(buffers))
        except _Violation as err:
            raise AssertionError(f"{name}: {err}") from None
        elapsed = time.perf_counter() - started
        pending = drive.in_flight()
    assert not pending, (f"{name}: pipelined_update returned while write({pending[0]}) was still in flight: wait for "
                         "every write's future before returning (the caller reuses the buffers)")
    assert not drive.problems, f"{name}: {drive.problems[0]}"
    for call in ("read", "update", "write"):
        missing = [k for k in range(n) if drive.counts[call][k] == 0]
        assert not missing, f"{name}: subgroup {missing[0]} was never {call}{'ed' if call == 'update' else ''}" + (
            "" if call != "write" else " back")
    assert all(drive.stored.get(k) for k in range(n)), f"{name}: not every write finished"
    return elapsed, drive


def _overlap_problem(drive: _FakeDrive, n: int) -> str | None:
    """From the log of the balanced run: whether update(k) ran while read(k + 1) and write(k - 1) were in flight,
    for most k (the calls' order is the learner's; a 20 ms stage leaves ample slack for the scheduler)."""
    at = {}
    for when, what, k in drive.log:
        at.setdefault((what, k), when)

    def during_update(stage: str, j: int, k: int) -> bool:
        return at[(stage, j)] < at[("update done", k)] and at[(f"{stage} done", j)] > at[("update", k)]

    middle = range(1, n - 1)
    reads = sum(during_update("read", k + 1, k) for k in middle)
    writes = sum(during_update("write", k - 1, k) for k in middle)
    if reads < len(middle) / 2:
        if all(at[("read", k + 1)] > at[("update", k)] for k in middle):
            return "read(k + 1) only started after update(k): start the next read before updating this subgroup"
        return ("read(k + 1) had finished before update(k) started: wait for read(k) alone, then update, while "
                "read(k + 1) goes on")
    if writes < len(middle) / 2:
        return ("each write had finished before the next update started: do not wait for write(k) at once; wait "
                "for it only when you need its buffer again")
    return None


@grader("6.3")
def pipelined_update(fn: Callable) -> str:
    """fn(n, read, update, write, buffers): each subgroup read, updated and written, the three stages overlapped."""
    for scenario in PIPELINE_SCENARIOS:
        _pipeline_run(fn, scenario)
    name, n, read_s, update_s, write_s = BALANCED
    serial = n * (read_s + update_s + write_s)
    best = None
    for _ in range(ATTEMPTS):
        elapsed, drive = _pipeline_run(fn, BALANCED)
        problem = _overlap_problem(drive, n)
        assert problem is None, (f"{name}: the stages did not overlap; a subgroup should be updated while the next "
                                 f"one is read and the previous one written: {problem}")
        best = elapsed if best is None else min(best, elapsed)
        if best < SERIAL_SHARE * serial:
            break
    assert best < SERIAL_SHARE * serial, (
        f"{name}: {n} subgroups took {best / serial:.0%} of the serial time n x (read + update + write) at best of "
        f"{ATTEMPTS} runs, though the stages overlapped; a pipeline takes about n x the slowest stage, "
        f"{(n + 2) / (3 * n):.0%} here (the check asks for under {SERIAL_SHARE:.0%}): wait on futures "
        "(.result()), do not poll them in a loop, and do no other slow work between the calls")
    scenarios = ", ".join(s[0] for s in PIPELINE_SCENARIOS[3:])
    return (f"{len(PIPELINE_SCENARIOS) + 1} runs through {BUFFERS} buffers (0-{n} subgroups; {scenarios}; "
            f"{name}): each subgroup read, updated and written once, in a buffer holding its data, no buffer reused "
            f"before its write finished, every write done on return; with three equal stages, each update ran while "
            f"the next read and the previous write were in flight, in under {SERIAL_SHARE:.0%} of the serial time")


# ---------------------------------------------------------------------------------------------
# Task 6.4: bytes per tier with the optimizer state on NVMe


def _tiers(num_params: float, precision: str, placement: str = "optimizer_nvme") -> dict[str, int]:
    fp = footprint(precision, "adam", placement)
    return {tier: fp.bytes(num_params, tier) for tier in TIERS}


@grader("6.4")
def bytes_per_tier(fn: Callable) -> str:
    """fn(num_params, precision="mixed_bf16") -> {"device": bytes, "host": bytes, "nvme": bytes} with Adam."""
    cases = [(n, None) for n in MODELS.values()] + [(n, p) for n in (1.5e9, 13e9, 175e9) for p in PRECISIONS]
    for num_params, precision in cases:
        call = f"bytes_per_tier({num_params:.3g}" + (")" if precision is None else f", {precision!r})")
        got = fn(num_params) if precision is None else fn(num_params, precision)
        want = _tiers(num_params, precision or "mixed_bf16")
        assert isinstance(got, dict) and set(got) == set(TIERS), (
            f"{call} returned {got!r:.80}; expected a dict with the three tiers {list(TIERS)}, zeros included")
        if got == want:
            continue
        fp = footprint(precision or "mixed_bf16", "adam", "optimizer_nvme")
        if got == fp.by_tier():
            hint = "those are bytes per parameter: Footprint.bytes(num_params, tier) multiplies by the count"
        elif got == _tiers(num_params, precision or "mixed_bf16", "optimizer_cpu"):
            hint = "that is ZeRO-Offload's placement, the state in host memory: use placement='optimizer_nvme'"
        elif precision is None and got == _tiers(num_params, "fp32"):
            hint = "the default precision is 'mixed_bf16'"
        else:
            hint = "use memory.footprint(precision, 'adam', 'optimizer_nvme').bytes(num_params, tier) for each tier"
        raise AssertionError(f"{call} returned {got!r:.100}, expected {want}: {hint}")
    example = fn(MODELS["GPT-3 13B"])
    shown = ", ".join(f"{tier} {format_bytes(example[tier])}" for tier in TIERS)
    return f"{len(cases)} cases match; GPT-3 13B in mixed bf16 with Adam's state on NVMe: {shown}"
