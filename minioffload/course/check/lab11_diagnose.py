"""Grader for Lab 11's diagnosis task (11.5): a resume that went wrong, its cause named from the folder of checkpoints
and the losses, and the checkpoint to resume from.

A small GPT trains on the simulated GPU with its optimizer offloaded; the runtime's AsyncCheckpointer writes a real
checkpoint after every step (the run is made once per process and kept as bytes). After its step 9 the run crashed.
Each case is a folder of some of those checkpoints, in a temporary folder, one or two of them damaged in a way the
grader knows, and the record of a resume from one of them (`chosen`), whose losses the learner sees beside the log of
the run before the crash. Three causes, two cases of each:

    corrupt   the chosen checkpoint's bytes changed after its commit (a block of a state file reads back as zeros):
              its sizes hold, its checksum does not; the resume read the state without checking it
    mixed     the chosen checkpoint's files are each whole and match their own checksums, but one subgroup's files
              (and index entries) are another step's: a state no step had; its losses leave the log at once
    stale     the chosen checkpoint is whole and right, but a newer one is too: the resume redid steps for nothing

The fix is the checkpoint to resume from. It is graded by resuming from it (the runtime's loader, which checks every
checksum, into a fresh model and optimizer) through step 9: the losses and the master weights must equal the run's
bit for bit, and no newer checkpoint of the folder may do so as well. A wrong cause fails with why it does not fit
what the folder and the losses show. Everything is deterministic: the same run, the same bytes, the same verdicts.

What this is not: a test of how a resume finds its checkpoint (Task 11.2), nor of the writer's commit (Task 11.1).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

from ...devices import device
from ...engine.optimizer import OffloadAdam
from ...kernels.checksum import checksum, file_checksum
from ...model.gpt import GPT, CharTokenizer, GPTConfig, batches, load_text
from ...nvme.swapper import Swapper
from ...train import checkpoint_async
from .grading import grader
from .lab11 import scratch

CAUSES = ("corrupt", "mixed", "stale")
CRASH = 9  # the last step the run logged before it crashed
SUBGROUP_NUMEL = 1 << 15  # the tiny GPT's 107k parameters in 4 subgroups


@dataclasses.dataclass(frozen=True)
class Case:
    cause: str
    chosen: int  # the step the resume loaded
    damage: tuple = ()  # (step, "zeros", subgroup, state name) or (step, "mixed", subgroup, the step of its files)
    saved: tuple = (2, 4, 6, 8)  # the checkpoints in the folder
    unfinished: int | None = None  # a step directory cut off before its manifest


CASES = (
    Case("corrupt", 8, ((8, "zeros", 1, "master"),)),
    Case("mixed", 8, ((8, "mixed", 0, 9),)),
    Case("stale", 4),
    Case("corrupt", 6, ((6, "zeros", 2, "exp_avg_sq"), (4, "mixed", 1, 2)), saved=(2, 4, 6), unfinished=8),
    Case("mixed", 6, ((6, "mixed", 3, 5),), saved=(2, 4, 6), unfinished=8),
    Case("stale", 2, ((8, "zeros", 0, "exp_avg"),)),
)

EXAMPLE = Case("mixed", 8, ((8, "mixed", 2, 5),), saved=(3, 5, 8))  # the lab's worked case, not graded


def step_name(step: int) -> str:
    return f"step{step:08d}"


def _data() -> tuple[torch.Tensor, int]:
    text = load_text()
    tokenizer = CharTokenizer(text)
    return torch.tensor(tokenizer.encode(text)), tokenizer.vocab_size


@contextmanager
def _trainer(start_from: Path | None = None, checkpoints: Path | None = None, verify: bool = True):
    """A fresh run on the sim: yields train(steps) -> {step: loss} and the optimizer; resumed from `start_from`."""
    data, vocab_size = _data()
    with device("sim") as dev:
        torch.manual_seed(0)
        model = dev.place(GPT(GPTConfig.preset("tiny", vocab_size, block_size=32)))
        opt = OffloadAdam(model.parameters(), dev, lr=1e-2, subgroup_numel=SUBGROUP_NUMEL)
        start = 0
        if start_from is not None:
            swapper = checkpoint_async.Swapper if verify else functools.partial(Swapper, verify=False)
            with mock.patch.object(checkpoint_async, "Swapper", swapper):
                start = checkpoint_async.load(start_from, model, opt)[0]
        writer = checkpoint_async.AsyncCheckpointer(checkpoints, model, opt, keep=CRASH) if checkpoints else None
        losses = {}

        def train(last: int) -> dict[int, float]:
            for step in range(start, last):
                x, y = batches(data, 32, 4, torch.Generator().manual_seed(step))  # the batch of this step, always
                loss = model(x, y)[1]
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses[step + 1] = loss.item()
                if writer is not None:
                    writer.save(step + 1)
            if writer is not None:
                writer.close()
            return losses
        yield train, opt


@functools.cache
def _run() -> tuple[dict[int, dict[str, bytes]], dict[int, float], tuple[torch.Tensor, ...]]:
    """The run before its crash, made once: every checkpoint's files as bytes, its losses and its final masters."""
    with scratch() as folder, _trainer(checkpoints=folder) as (train, opt):
        log = train(CRASH)
        masters = tuple(m.clone() for m in opt.master_weights())
        files = {step: {p.name: p.read_bytes() for p in (folder / step_name(step)).iterdir()}
                 for step in range(1, CRASH + 1)}
    return files, log, masters


def _index(path: Path) -> dict:
    return json.loads((path / "index.json").read_text())


def _damage(path: Path, kind: str, subgroup: int, what, files: dict) -> None:
    index = _index(path)
    if kind == "zeros":  # a lost block: the drive returns zeros where the file's first 4 KiB were
        name = f"subgroup{subgroup}%2f{what}.{index[f'subgroup{subgroup}/{what}']['slot']}"
        data = bytearray((path / name).read_bytes())
        data[:4096] = bytes(4096)
        (path / name).write_bytes(bytes(data))
        return
    other = json.loads(files[what]["index.json"])  # mixed: this subgroup's files and entries from step `what`
    for key in [k for k in other if k.startswith(f"subgroup{subgroup}/")]:
        (path / f"subgroup{subgroup}%2f{key.split('/')[1]}.0").unlink()
        index[key] = other[key]
        name = f"subgroup{subgroup}%2f{key.split('/')[1]}.{other[key]['slot']}"
        (path / name).write_bytes(files[what][name])
    (path / "index.json").write_text(json.dumps(index))
    manifest = json.loads((path / checkpoint_async.MANIFEST).read_text())
    manifest.pop("files")
    checkpoint_async._commit_manifest(path, manifest)  # recommitted: the sizes hold


def write_case(folder: Path, case: Case) -> Path:
    """The folder of checkpoints a case leaves after the crash."""
    files = _run()[0]
    folder.mkdir(parents=True, exist_ok=True)
    for step in (*case.saved, *([case.unfinished] if case.unfinished else [])):
        path = folder / step_name(step)
        path.mkdir()
        for name, data in files[step].items():
            if step != case.unfinished or name != checkpoint_async.MANIFEST:
                (path / name).write_bytes(data)
    for step, kind, subgroup, what in case.damage:
        _damage(folder / step_name(step), kind, subgroup, what, files)
    return folder


def resume(path: Path, verify: bool = True) -> dict[int, float]:
    """Resume the run from checkpoint directory `path` through step 9: its losses by step (the runtime's loader:
    raises when the checkpoint is not complete or a checksum differs)."""
    with _trainer(start_from=Path(path), verify=verify) as (train, _):
        return dict(train(CRASH))


def _resumed(path: Path) -> tuple[dict[int, float], tuple[torch.Tensor, ...]]:
    with _trainer(start_from=path) as (train, opt):
        return dict(train(CRASH)), tuple(m.clone() for m in opt.master_weights())


def run_of(folder: Path, case: Case) -> dict:
    """What the learner sees of one case: the log before the crash, the resume that was done, and `resume`."""
    log = _run()[1]
    chosen = folder / step_name(case.chosen)
    return {"log": dict(log), "chosen": chosen, "resumed": resume(chosen, verify=False), "resume": resume}


@contextmanager
def example() -> Iterator[tuple[Path, dict]]:
    """The lab's worked case (one the grader does not use): its folder and its run, while the block lasts."""
    with scratch() as root:
        folder = write_case(root / "checkpoints", EXAMPLE)
        yield folder, run_of(folder, EXAMPLE)


def _good(case: Case) -> list[int]:
    damaged = {step for step, *_ in case.damage}
    return [step for step in case.saved if step not in damaged]


def _first_difference(got: dict, log: dict) -> str:
    step = next(s for s in sorted(got) if got[s] != log[s])
    return f"at step {step} its loss is {got[step]!r} where the run logged {log[step]!r}"


def bad_checksums(path: Path) -> list[str]:
    """The files of checkpoint `path` whose bytes differ from the checksum written for them: the state files against
    index.json, meta.pt against the manifest."""
    bad = []
    for key, entry in sorted(_index(path).items()):
        name = path / f"{key.replace('/', '%2f')}.{entry['slot']}"
        data = bytearray(name.read_bytes()[:entry["nbytes"]])
        if checksum(torch.frombuffer(data, dtype=torch.uint8)) != entry["checksum"]:
            bad.append(key)
    written = json.loads((path / checkpoint_async.MANIFEST).read_text())["checksums"]["meta.pt"]
    return bad + (["meta.pt"] if file_checksum(path / "meta.pt") != written else [])


def _why_not(named: str, case: Case, folder: Path, run: dict) -> str:
    """Why `named` is not the cause of this case, from what its folder and its losses show."""
    chosen, log, resumed = step_name(case.chosen), run["log"], run["resumed"]
    if named == "stale":
        return (f"resumed from {chosen}, the run leaves its log: {_first_difference(resumed, log)}; a checkpoint that "
                "is only older than it could be repeats the log bit for bit")
    bad = bad_checksums(folder / chosen)
    if bad:
        return (f"{bad[0]} in {chosen} does not match the checksum written for it: its bytes changed after the "
                "commit; in a mixed checkpoint every file matches its own checksum")
    if named == "corrupt":
        return (f"every file of {chosen} matches its checksum (the state files theirs in index.json, meta.pt the "
                "manifest's): no byte changed after the commit")
    return (f"resumed from {chosen}, the run repeats its log bit for bit at steps {min(resumed)} to {max(resumed)}: "
            f"the checkpoint holds the state of step {case.chosen}, not a mix")


def _grade_fix(fix, case: Case, folder: Path, number: int) -> None:
    names = {p.name for p in folder.iterdir()}
    name = Path(fix).name if isinstance(fix, (str, Path)) else None
    assert name in names and (not isinstance(fix, Path) or fix.parent == folder), (
        f"case {number}: the fix is {fix!r}; return the step directory to resume from, e.g. folder / 'step00000006'")
    log, masters = _run()[1], _run()[2]
    try:
        losses, got = _resumed(folder / name)
    except (OSError, ValueError) as err:
        said = str(err).replace(f"{folder}/", "")  # the names within the folder, the same every run
        raise AssertionError(f"case {number} ({case.cause}, rightly): resuming from {name} fails: {said}") from None
    if any(losses[s] != log[s] for s in losses):
        raise AssertionError(f"case {number} ({case.cause}, rightly): resumed from {name}, the run is not the one "
                             f"that crashed: {_first_difference(losses, log)}")
    assert all(torch.equal(a, b) for a, b in zip(got, masters, strict=True)), (
        f"case {number} ({case.cause}, rightly): resumed from {name}, the run repeats its losses, but its master "
        f"weights after step {CRASH} differ from the run's")
    newer = [step for step in _good(case) if step_name(step) > name]
    assert not newer, (f"case {number} ({case.cause}, rightly): resuming from {name} repeats the run, but so does "
                       f"{step_name(max(newer))}: yours redoes {max(newer) - int(name[4:])} steps it need not")


@grader("11.5", nothing_to_refuse=(
    "no runtime function diagnoses a resume; the fix is graded by resuming from it and comparing with the run"
))
def diagnose(fn: Callable) -> str:
    """fn(folder, run) -> (cause, the step directory to resume from), for each case."""
    with scratch() as root:
        for number, case in enumerate(CASES, 1):
            folder = write_case(root / f"case{number}" / "checkpoints", case)
            run = run_of(folder, case)
            answer = fn(folder, dict(run, log=dict(run["log"]), resumed=dict(run["resumed"])))
            assert isinstance(answer, tuple) and len(answer) == 2, (
                f"case {number}: diagnose_resume returned {answer!r:.80}; return (cause, fix), e.g. "
                "('stale', folder / 'step00000008')")
            cause, fix = answer
            shutil.rmtree(folder)  # graded on the folder as the crash left it, whatever the learner did to it
            write_case(folder, case)
            assert cause in CAUSES, f"case {number}: the cause {cause!r} is not one of {', '.join(map(repr, CAUSES))}"
            if cause != case.cause:
                raise AssertionError(f"case {number}: not '{cause}': {_why_not(cause, case, folder, run)}")
            _grade_fix(fix, case, folder, number)
    return (f"{len(CASES)} cases: each cause named ({', '.join(CAUSES)}), and each resume from your checkpoint "
            f"repeats the run through step {CRASH} bit for bit, from the newest checkpoint that does")
