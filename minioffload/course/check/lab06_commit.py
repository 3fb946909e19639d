"""Grader for Lab 6, Task 6.2: the crash-safe commit of a new version, under a simulated power cut at every step
(see lab06.py for the lab's other tasks and the model of the drive).

Task 6.2 simulates a power cut at every step of the learner's commit. os.fsync, os.replace and the version writer
are wrapped; at each step in turn the grader stops the function and rebuilds what a drive would hold by POSIX
rules: a file's bytes as of its last fsync (bytes written since are torn, half new and half old), a name as of
its directory's last fsync. A reader that trusts index.json must find the old or the new version whole, and the
new one after the function has returned. The real fsync is not called: the model stands in for the drive.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from .grading import grader
from .lab06 import _patched, _scratch

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


@grader("6.2", rebuilds=("minioffload.nvme.swapper.Swapper._commit", "minioffload.nvme.index.replace"))
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

