"""Grader for Lab 11, Task 11.2: the newest complete checkpoint of a folder (see lab11.py for the lab's other tasks).

The grader builds folders of step directories, `step{N:08d}`, each in a state it knows: complete (a MANIFEST.json
whose files all exist with their recorded sizes), or one of the ways a checkpoint is found after a crash: no
manifest yet, only the manifest's temporary file, a torn manifest (not valid JSON), a listed file missing, a listed
file cut short. Beside them: names that are not step directories, and steps past 99,999,999, whose names have more
digits than the padding and so sort before smaller steps as strings. The learner's answer must be the complete
checkpoint with the highest step, or None. Hand-made folders come first, each with the reason a learner needs when it
fails, then seeded random ones.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .grading import grader
from .lab11 import MANIFEST, TEMPORARY, checkpoint_files, scratch, write_tree

RANDOM_FOLDERS = 60
STATES = ("complete", "no manifest", "temporary only", "torn", "missing file", "short file")
WHY = {  # a state -> what a learner who took such a checkpoint needs to know
    "no manifest": f"a step directory without {MANIFEST} is a checkpoint still being written (or never finished): "
                   "skip it",
    "temporary only": f"a step directory with only {TEMPORARY} was cut off before its commit: skip it",
    "torn": f"a {MANIFEST} that is not valid JSON (torn by a crash) makes its checkpoint incomplete: catch the "
            "ValueError json raises and skip that step",
    "missing file": f"a file that {MANIFEST} lists but that does not exist makes the checkpoint incomplete: check "
                    "every listed file",
    "short file": f"a listed file whose size differs from the one {MANIFEST} records (cut short by a crash) makes the "
                  "checkpoint incomplete: compare each file's size (os.path.getsize or Path.stat().st_size)",
}


def step_name(step: int) -> str:
    return f"step{step:08d}"


def make_step(folder: Path, step: int, state: str, seed: int) -> None:
    """A step directory in the given state."""
    path = folder / step_name(step)
    files = checkpoint_files(seed)
    write_tree(path, files)
    manifest = json.dumps({"step": step, "format": 1, "files": {n: len(d) for n, d in files.items()}})
    if state == "temporary only":
        (path / TEMPORARY).write_text(manifest)
    elif state == "torn":
        (path / MANIFEST).write_text(manifest[:len(manifest) // 2])
    elif state != "no manifest":
        (path / MANIFEST).write_text(manifest)
    if state == "missing file":
        (path / "subgroup1" / "empty").unlink()
    elif state == "short file":
        name = next(n for n in sorted(files) if n.startswith("subgroup0/"))
        (path / name).write_bytes(files[name][:len(files[name]) // 2])


@dataclass(frozen=True)
class Folder:
    what: str
    steps: tuple[tuple[int, str], ...]  # (step, state), created in this order
    why: str = ""  # the reason shown when the answer is wrong
    others: bool = False  # add entries that are not step directories
    exists: bool = True

    def expected(self) -> int | None:
        complete = [step for step, state in self.steps if state == "complete"]
        return max(complete) if complete else None


HAND = (
    Folder("a folder with one complete checkpoint", ((10, "complete"),),
           "return the step directory's path, directory / its name"),
    Folder("a folder with three complete checkpoints, written as step 30, then 10, then 20",
           ((30, "complete"), (10, "complete"), (20, "complete")),
           "the newest checkpoint is the one with the highest step (not the last one modified)"),
    Folder("an empty folder", (), "a folder without a complete checkpoint gives None"),
    Folder("a folder that does not exist", (), "a folder that does not exist holds no checkpoint: None", exists=False),
    Folder("a folder whose newest checkpoint has no MANIFEST.json yet", ((1000, "complete"), (2000, "no manifest")),
           WHY["no manifest"]),
    Folder("a folder whose newest checkpoint has only MANIFEST.json.tmp",
           ((1000, "complete"), (2000, "temporary only")), WHY["temporary only"]),
    Folder("a folder whose newest checkpoint's MANIFEST.json is torn", ((1000, "complete"), (2000, "torn")),
           WHY["torn"]),
    Folder("a folder whose newest checkpoint lacks a listed file", ((1000, "complete"), (2000, "missing file")),
           WHY["missing file"]),
    Folder("a folder whose newest checkpoint has a file cut short", ((1000, "complete"), (2000, "short file")),
           WHY["short file"]),
    Folder("a folder with step99999999 and step100000000, both complete",
           ((99_999_999, "complete"), (100_000_000, "complete")),
           "step 100,000,000 has 9 digits, more than the padding, so its name sorts before step99999999 as a string: "
           "compare the step numbers, int(name[4:]), not the names"),
    Folder("a folder with step00000005 complete beside entries that are not step directories: step00000009.old "
           "and latest (complete checkpoints, renamed), stepping/, notes.txt, a file step00000011",
           ((5, "complete"),),
           "only names that are 'step' followed by digits are step directories (re.fullmatch(r'step(\\d+)', name)); "
           "skip everything else, files included", others=True),
    Folder("a folder whose checkpoints are all unfinished or torn",
           ((1, "no manifest"), (2, "torn"), (3, "short file")), "when no checkpoint is complete, return None"),
)


def random_folder(rng: random.Random) -> Folder:
    count = rng.randint(1, 6)
    steps = rng.sample(range(1, 300), count) if rng.random() < 0.6 else \
        rng.sample([9, 10, 99, 100, 99_999_999, 100_000_000, 123_456_789, 1_000_000_000], count)
    states = [rng.choice(STATES) for _ in steps]
    return Folder(f"a folder holding {', '.join(f'{step_name(s)} ({t})' for s, t in zip(steps, states, strict=True))}",
                  tuple(zip(steps, states, strict=True)))


def folders() -> list[Folder]:
    rng = random.Random(112)
    return list(HAND) + [random_folder(rng) for _ in range(RANDOM_FOLDERS)]


def build(root: Path, folder: Folder, seed: int) -> Path:
    where = root / f"ckpt{seed}"
    if not folder.exists:
        return where
    where.mkdir()
    for number, (step, state) in enumerate(folder.steps):
        make_step(where, step, state, seed * 10 + number)
        written = 1.7e9 + number * 60.0  # a minute apart, in the order written, whatever the clock's resolution
        os.utime(where / step_name(step), (written, written))
    if folder.others:
        for name in ("step00000009.old", "latest"):
            make_step(where, 9, "complete", seed)
            (where / step_name(9)).rename(where / name)
        (where / "stepping").mkdir()
        (where / "notes.txt").write_text("resume from the newest complete checkpoint\n")
        (where / step_name(11)).write_text("a file, not a step directory\n")
    return where


def _hint(folder: Folder, got: Path | None, where: Path) -> str:
    if folder.why:
        return folder.why
    states = {step_name(step): state for step, state in folder.steps}
    if got is not None and got.parent == where and states.get(got.name, "complete") != "complete":
        return WHY[states[got.name]]
    complete = [step for step, state in folder.steps if state == "complete"]
    if got is not None and complete and got.name == max(map(step_name, complete)):
        return "compare the step numbers, int(name[4:]), not the names: a name with more digits sorts wrongly"
    return "the answer is the complete checkpoint with the highest step, or None when none is complete"


def _shown(got: object, where: Path) -> str:
    if isinstance(got, (str, os.PathLike)) and Path(got).parent == where:
        return f"{Path(got).name}"
    return repr(got) if not isinstance(got, (str, os.PathLike)) else f"{os.fspath(got)!r}"


@grader("11.2", rebuilds=(
    "minioffload.train.checkpoint_async.complete",
    "minioffload.train.checkpoint_async.load_latest",
))
def latest_complete(fn: Callable) -> str:
    """fn(directory) -> the path of the newest complete step directory, or None."""
    cases = folders()
    with scratch() as root:
        for seed, folder in enumerate(cases):
            where = build(root, folder, seed)
            want = None if folder.expected() is None else where / step_name(folder.expected())
            try:
                got = fn(where)
            except NotImplementedError:
                raise
            except Exception as err:  # which folder broke it, and why, is what the learner needs
                raise AssertionError(f"in {folder.what}, your function raised {type(err).__name__}: {err}; "
                                     f"{_hint(folder, None, where)}") from None
            if got is not None and not isinstance(got, (str, os.PathLike)):
                raise AssertionError(f"in {folder.what}, your function returned {got!r:.60}; expected a Path (or None)")
            if (got is None) != (want is None) or (got is not None and Path(got) != want):
                if got is not None and want is not None and Path(got).name == want.name:
                    reason = "return the step directory's path, directory / name, not its name alone"
                else:
                    reason = _hint(folder, None if got is None else Path(got), where)
                expected = "None" if want is None else want.name
                raise AssertionError(f"in {folder.what}, your function returned {_shown(got, where)}; expected "
                                     f"{expected}: {reason}")
    states = sum(len(f.steps) for f in cases)
    return (f"{len(cases)} folders ({len(HAND)} by hand, {RANDOM_FOLDERS} random; {states} step directories, complete, "
            "unfinished, torn, a file missing or cut short, steps past the padding, other names beside them): the "
            "newest complete checkpoint found in each, or None where there is none")
