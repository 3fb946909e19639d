"""Graders for Lab 11, "Saving and spreading state": the crash-safe commit of a checkpoint's manifest (11.1).

Task 11.2 (the newest complete checkpoint of a folder) is graded in lab11_latest.py, Tasks 11.3 (subgroups spread
over storage paths by bandwidth) and 11.4 (the alternating visit order and the reads it saves) in lab11_paths.py;
the package's __init__ imports all three modules, which registers all four.

Task 11.1 is graded as Task 6.2 is (lab06_commit.py), with the same model of the drive: os.fsync, os.replace and
os.rename are wrapped, the learner's function is stopped at each of those calls in turn as if the power went out, and
the grader rebuilds what a drive would hold by POSIX rules (a file's bytes as of its last fsync, torn if written
since; the folder's names as of the folder's last fsync). A reader must then find the old MANIFEST.json (or none, if
there was none) or the new one whole, never a torn one, and the new one once the function has returned. The manifest
written is checked against the files the grader put in the checkpoint: every file below the directory, by its path
relative to it, with its size. The real fsync is not called: the model stands in for the drive.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .grading import grader
from .lab06 import _patched
from .lab06_commit import _Crash, _Disk

MANIFEST = "MANIFEST.json"
TEMPORARY = MANIFEST + ".tmp"


@contextmanager
def scratch() -> Iterator[Path]:
    """A temporary folder for one check, removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="lab11-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def checkpoint_files(seed: int) -> dict[str, bytes]:
    """The files of a small checkpoint, as the lazy checkpoint writes them: {path relative to its folder: bytes}."""
    rng = random.Random(seed)
    files = {"meta.pt": rng.randbytes(rng.randint(200, 900)), "index.json": rng.randbytes(rng.randint(80, 200))}
    for sub in range(2):
        for name in ("master", "exp_avg", "exp_avg_sq"):
            files[f"subgroup{sub}/{name}.{rng.randint(0, 1)}"] = rng.randbytes(4096 * rng.randint(1, 3))
    files["subgroup1/empty"] = b""  # a file of 0 bytes is a file too
    return files


def write_tree(folder: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


@dataclass(frozen=True)
class _Scenario:
    what: str
    files: dict[str, bytes]  # the checkpoint's files
    manifest: dict  # what the caller passes
    before: dict[str, bytes] = field(default_factory=dict)  # MANIFEST.json and its temporary file, if there

    def expected(self) -> dict:
        return {**self.manifest, "files": {name: len(data) for name, data in self.files.items()}}


def _scenarios() -> list[_Scenario]:
    fresh, stale, again = (checkpoint_files(seed) for seed in (111, 112, 113))
    older = {"step": 400, "format": 1, "files": {name: len(data) for name, data in again.items()}, "writer": "first"}
    return [
        _Scenario("a new checkpoint", fresh, {"step": 300, "format": 1}),
        _Scenario("a checkpoint whose folder holds a MANIFEST.json.tmp left by a crash", stale,
                  {"step": 200, "format": 1}, {TEMPORARY: b'{"step": 200, "format": 1, "fil'}),
        _Scenario("a checkpoint committed a second time, over its MANIFEST.json", again,
                  {"step": 400, "format": 1, "writer": "second"}, {MANIFEST: json.dumps(older).encode()}),
    ]


@dataclass
class _Step:
    kind: str  # "fsync", "replace" or "rename"
    target: str  # a file's name, "the folder", "another folder", or "src -> dst"
    ino: int | None = None
    src: str = ""
    dst: str = ""
    src_ino: int | None = None
    src_durable: bool = False  # at a rename: the file renamed had its bytes on the drive


@dataclass
class _Run:
    steps: list[_Step] = field(default_factory=list)
    image: dict[str, bytes] | None = None  # the folder's top level after the power cut
    returned: object = None
    given_changed: bool = False
    on_disk: object = None  # MANIFEST.json as the function left it, parsed (None if absent or not JSON)


def _describe(step: _Step) -> str:
    if step.kind == "fsync":
        return f"just before os.fsync of {step.target}"
    return f"just before os.{step.kind}({step.src} -> {step.dst})"


def _commit_run(fn: Callable, folder: Path, scenario: _Scenario, crash_at: int | None) -> _Run:
    """Run fn on a fresh copy of the scenario; stop it at step `crash_at` (None: let it return)."""
    folder.mkdir()
    write_tree(folder, {**scenario.files, **scenario.before})
    disk, run = _Disk(folder), _Run()
    given = json.loads(json.dumps(scenario.manifest))

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
            src_ino = Path(src).stat().st_ino if Path(src).exists() else None
            step(_Step(kind, f"{Path(src).name} -> {Path(dst).name}", src=Path(src).name, dst=Path(dst).name,
                       src_ino=src_ino, src_durable=disk.durable(src_ino)))
            return real[kind](src, dst, *args, **kwargs)
        return call

    with _patched({"fsync": fsync, "fdatasync": fsync, "replace": rename("replace"),
                   "rename": rename("rename")}) as real:
        try:
            run.returned = fn(folder, given)
        except _Crash:
            pass
    if run.image is None:  # it returned: a power cut right now
        run.image = disk.after_crash()
        try:
            run.on_disk = json.loads((folder / MANIFEST).read_text())
        except (ValueError, OSError):  # gone, or not JSON
            run.on_disk = None
    run.given_changed = given != scenario.manifest
    return run


def _found(image: dict[str, bytes], scenario: _Scenario, new: dict) -> str:
    """What a reader finds in the folder after a power cut: "none", "old", "new", or what is wrong."""
    if MANIFEST not in image:
        return "none"
    data = image[MANIFEST]
    if data == scenario.before.get(MANIFEST):
        return "old"
    try:
        manifest = json.loads(data)
    except ValueError:
        return "a torn MANIFEST.json (not valid JSON: half written)"
    return "new" if manifest == new else "a MANIFEST.json that is neither the old one nor the new one (torn)"


def _protocol_hint(steps: list[_Step]) -> str:
    """From the steps of an uninterrupted run: the first rule of the protocol it breaks."""
    renames = [i for i, s in enumerate(steps) if s.kind in ("replace", "rename") and s.dst == MANIFEST]
    if not renames:
        return (f"write the manifest into {TEMPORARY} and os.replace it over {MANIFEST}: a file rewritten in place "
                "can be half old, half new after a crash")
    at = steps[renames[0]]
    if not at.src_durable:
        synced = any(s.kind == "fsync" and s.ino == at.src_ino for s in steps[:renames[0]])
        return ("flush the temporary file (f.flush()) before os.fsync(f.fileno()): fsync only reaches the bytes "
                "Python has handed to the OS" if synced else
                f"fsync the temporary file ({at.src}) before os.replace: the rename can reach the drive before the "
                "file's bytes")
    if not any(s.kind == "fsync" and s.target == "the folder" for s in steps[renames[0] + 1:]):
        return ("fsync the directory after os.replace (fd = os.open(directory, os.O_RDONLY); os.fsync(fd); "
                "os.close(fd)): until then the rename itself may not be on the drive")
    return f"temporary file, flush, fsync, os.replace over {MANIFEST}, then fsync the directory"


def _content_problem(run: _Run, scenario: _Scenario) -> str:
    """What is wrong with the manifest an uninterrupted run wrote and returned, or ""."""
    want = scenario.expected()
    if run.given_changed:
        return ("the manifest dict you were given changed: build a new one ({**manifest, 'files': ...}) and return "
                "it; the caller's dict is the caller's")
    if not isinstance(run.returned, dict):
        return f"commit_manifest returned {run.returned!r:.60}; expected the manifest it wrote, a dict"
    if run.on_disk is None:
        return f"after commit_manifest returned, {MANIFEST} is missing or not valid JSON"
    if run.on_disk != run.returned:
        return f"the dict commit_manifest returned differs from {MANIFEST} on disk: return the dict you wrote there"
    lost = {k: v for k, v in scenario.manifest.items() if run.returned.get(k) != v}
    if lost:
        return f"the manifest written lost or changed the caller's fields {lost}: keep them all and add 'files'"
    files = run.returned.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) and type(v) is int for k, v in files.items()):
        return (f"the manifest's 'files' is {files!r:.80}; expected a dict of {{path relative to the directory: "
                "size in bytes (an int)}}, e.g. {'meta.pt': 612, 'subgroup0/master.1': 8192}")
    missing, extra = sorted(want["files"].keys() - files.keys()), sorted(files.keys() - want["files"].keys())
    if extra and set(extra) & {MANIFEST, TEMPORARY}:
        named = " and ".join(sorted(set(extra) & {MANIFEST, TEMPORARY}))
        return (f"'files' lists {named}: the manifest and its temporary file are not part of the checkpoint; list "
                f"every other file")
    if missing and all("/" in name for name in missing):
        return (f"'files' misses the files in subfolders ({', '.join(missing[:3])}...): walk the whole tree "
                "(Path.rglob('*') or os.walk), and name each file by its path relative to the directory")
    if missing or extra:
        return (f"'files' lists {sorted(files)[:4]}...; expected every file below the directory by its path "
                f"relative to it ({sorted(want['files'])[:4]}...): missing {missing[:3]}, not files there {extra[:3]}")
    wrong = [name for name in files if files[name] != want["files"][name]]
    if wrong:
        name = wrong[0]
        return f"'files' gives {name} {files[name]} bytes; the file holds {want['files'][name]}"
    return ""


@grader("11.1", rebuilds=("minioffload.train.checkpoint_async._commit_manifest",))
def commit_manifest(fn: Callable) -> str:
    """fn(directory, manifest) -> the manifest with 'files' added, committed crash-safely as MANIFEST.json."""
    scenarios, cuts = _scenarios(), 0
    with scratch() as folder:
        runs = iter(range(1_000_000))
        for scenario in scenarios:
            clean = _commit_run(fn, folder / f"run{next(runs)}", scenario, None)
            problem = _content_problem(clean, scenario)
            if problem:
                raise AssertionError(f"{scenario.what}: {problem}")
            new, hint = clean.returned, _protocol_hint(clean.steps)
            trials = [(crash_at, _commit_run(fn, folder / f"run{next(runs)}", scenario, crash_at))
                      for crash_at in range(len(clean.steps))] + [(None, clean)]
            for crash_at, run in trials:
                cuts += 1
                when = "right after commit_manifest returned" if crash_at is None else _describe(clean.steps[crash_at])
                found = _found(run.image, scenario, new)
                if crash_at is None and found != "new":
                    what = {"none": "no MANIFEST.json", "old": "the old MANIFEST.json"}.get(found, found)
                    raise AssertionError(f"{scenario.what}: commit_manifest returned, but a power cut right after it "
                                         f"leaves {what}: {hint}")
                if found not in ("none", "old", "new"):
                    raise AssertionError(f"{scenario.what}: after a power cut {when}, the folder holds {found}: {hint}")
                if found == "none" and MANIFEST in scenario.before:
                    raise AssertionError(f"{scenario.what}: after a power cut {when}, the old {MANIFEST} is gone: "
                                         f"{hint}")
    return (f"{cuts} simulated power cuts in {len(scenarios)} commits ({'; '.join(s.what for s in scenarios)}): after "
            f"each, the folder held the old {MANIFEST} (or none) or the new one whole, never a torn one, and the new "
            "one once commit_manifest had returned; 'files' named every file below the directory with its size")
