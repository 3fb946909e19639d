"""Lab 11 verdicts: right answers pass, plausible mistakes fail with a reason that names them, stubs say TODO; the
graders' own pieces (the folders they build, the simulated host memory) are what they claim."""

import inspect
import json
import os
import random
import re
from pathlib import Path

import nbformat
import pytest
from grader_harness import assert_passes, mistakes_fail, reference_passes, same_verdict_every_run, stubs_are_todo

import minioffload.course.check.lab11  # noqa: F401  (registers Tasks 11.1 to 11.4)
from minioffload.course import check
from minioffload.course.check import lab11, lab11_diagnose, lab11_latest, lab11_paths

ROOT = Path(__file__).resolve().parents[2]

# Task 11.1 -------------------------------------------------------------------------------------


def fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_manifest(directory, manifest, *, replace=True, tmp_fsync=True, flush=True, dir_fsync="after",
                    walk=True, skip=("MANIFEST.json", "MANIFEST.json.tmp"), list_after_tmp=False, mutate=False,
                    sizes=True):
    """A right answer, with switches that turn it into one plausible mistake at a time."""
    directory = Path(directory)
    temporary = directory / ("MANIFEST.json.tmp" if replace else "MANIFEST.json")

    def listing():
        found = directory.rglob("*") if walk else directory.iterdir()
        return {p.relative_to(directory).as_posix(): p.stat().st_size if sizes else 0
                for p in found if p.is_file() and p.relative_to(directory).as_posix() not in skip}

    files = None if list_after_tmp else listing()
    if list_after_tmp:
        temporary.write_text("")
        files = listing()
    if mutate:
        manifest["files"] = files
    written = {**manifest, "files": files}
    if dir_fsync == "before":
        fsync_path(directory)
    with open(temporary, "w") as f:
        json.dump(written, f)
        if flush:
            f.flush()
        if tmp_fsync:
            os.fsync(f.fileno())
    if replace:
        os.replace(temporary, directory / "MANIFEST.json")
    if dir_fsync == "after":
        fsync_path(directory)
    elif dir_fsync == "parent":
        fsync_path(directory.parent)
    return written


def commit_with(**mistake):
    def fn(directory, manifest):
        return commit_manifest(directory, manifest, **mistake)
    return fn


def commit_with_path_methods(directory, manifest):
    """Another right answer: pathlib's write_text and replace, the file fsynced through a descriptor of its own."""
    files = {str(p.relative_to(directory)): p.stat().st_size for p in sorted(Path(directory).rglob("*"))
             if p.is_file() and p.name not in ("MANIFEST.json", "MANIFEST.json.tmp")}
    written = dict(manifest, files=files)
    temporary = Path(directory) / "MANIFEST.json.tmp"
    temporary.write_text(json.dumps(written, indent=1))
    fsync_path(temporary)
    temporary.replace(Path(directory) / "MANIFEST.json")
    fsync_path(directory)
    return written


# Task 11.2 -------------------------------------------------------------------------------------

STEP = re.compile(r"step(\d+)")


def latest_complete(directory, *, numeric=True, check_sizes=True, check_exists=True, catch=True, strict_names=True,
                    newest="highest", name_only=False):
    """A right answer, with switches that turn it into one plausible mistake at a time."""
    directory = Path(directory)
    if not directory.is_dir():
        return None
    found = []
    for path in directory.iterdir():
        match = STEP.fullmatch(path.name) if strict_names else path.name.startswith("step")
        if not match or not path.is_dir():
            continue
        step = int(match[1]) if strict_names else int(path.name[4:])
        found.append((step if numeric else path.name, path))
    candidates = sorted(found, key=lambda item: item[1].stat().st_mtime if newest == "modified" else item[0],
                        reverse=newest != "lowest")
    for _, path in candidates:
        manifest_path = path / "MANIFEST.json"
        if not manifest_path.is_file():
            continue
        try:
            manifest = json.loads(manifest_path.read_text())
        except ValueError:
            if catch:
                continue
            raise
        files = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(files, dict):
            continue
        if all(not check_exists or ((path / name).is_file() and (not check_sizes or (path / name).stat().st_size
                                                                  == size)) for name, size in files.items()):
            return Path(path.name) if name_only else path
    return None


def latest_with(**mistake):
    def fn(directory):
        return latest_complete(directory, **mistake)
    return fn


# Task 11.3 -------------------------------------------------------------------------------------

def assign_paths(sizes, bandwidths, *, rule="deficit", validate=True, name_path=True, shuffle_ties=False):
    """A right answer (each subgroup to the path furthest below its share of the bytes so far, this one included),
    with switches that turn it into one plausible mistake at a time."""
    if validate:
        if not bandwidths:
            raise ValueError("no paths: give at least one bandwidth")
        for index, bandwidth in enumerate(bandwidths):
            if not bandwidth > 0:
                raise ValueError(f"path {index} has bandwidth {bandwidth}" if name_path else "bad bandwidth")
    summed = sum(bandwidths)
    held, total, out = [0] * len(bandwidths), 0, []
    flip = random.Random().random() < 0.5 if shuffle_ties else False
    for size in sizes:
        total += size
        paths = range(len(bandwidths))
        if rule == "deficit":
            path = max(paths, key=lambda p: (total * bandwidths[p] / summed - held[p], p if flip else -p))
        elif rule == "round robin":
            path = len(out) % len(bandwidths)
        elif rule == "fewest bytes":
            path = min(paths, key=lambda p: (held[p], p))
        elif rule == "fastest":
            path = max(paths, key=lambda p: (bandwidths[p], -p))
        elif rule == "ratio before":
            path = min(paths, key=lambda p: (held[p] / bandwidths[p], p))
        elif rule == "earliest finish":
            path = min(paths, key=lambda p: ((held[p] + size) / bandwidths[p], p))
        out.append(path)
        held[path] += size
    return out


def assign_with(**mistake):
    def fn(sizes, bandwidths):
        return assign_paths(sizes, bandwidths, **mistake)
    return fn


def assign_by_count(sizes, bandwidths):
    """Largest remainder over the subgroup index: the counts are in proportion, the bytes are not."""
    summed, counts, out = sum(bandwidths), [0] * len(bandwidths), []
    for index in range(len(sizes)):
        path = max(range(len(bandwidths)), key=lambda p: ((index + 1) * bandwidths[p] / summed - counts[p], -p))
        counts[path] += 1
        out.append(path)
    return out


def assign_sorting_in_place(sizes, bandwidths):
    sizes.sort(reverse=True)
    return assign_paths(sizes, bandwidths)


def assign_with_zero_division(sizes, bandwidths):
    """Right for good input, but it weighs each path by 1 / bandwidth before checking any."""
    slowness = [1 / bandwidth for bandwidth in bandwidths]
    return assign_paths(sizes, [1 / s for s in slowness], validate=False)


# Task 11.4 -------------------------------------------------------------------------------------

def order_and_reads(n, step, cached, *, order="alternate", cold_start=True, clamp=True, reads="alternate"):
    """A right answer, with switches that turn it into one plausible mistake at a time."""
    if order == "alternate":
        visit = list(range(n)) if step % 2 == 0 else list(range(n - 1, -1, -1))
    elif order == "forward":
        visit = list(range(n))
    elif order == "descending first":
        visit = list(range(n - 1, -1, -1)) if step % 2 == 0 else list(range(n))
    else:  # "rotate": start with the previous visit's last subgroup, then wrap around
        visit = [(i - step) % n for i in range(n)] if n else []
    if reads == "forward":
        needed = n if cached < n else (0 if step else n)
    elif step == 0 and cold_start:
        needed = n
    else:
        needed = n - (min(cached, n) if clamp else cached)
    return visit, needed


def order_with(**mistake):
    def fn(n, step, cached):
        return order_and_reads(n, step, cached, **mistake)
    return fn


# Task 11.5 -------------------------------------------------------------------------------------

def diagnose_with(*, always=None, tolerance=0.0, pick="newest repeating"):
    """A right diagnosis, with switches that turn it into one plausible mistake at a time."""
    def diagnose_resume(folder, run):
        log, resume = run["log"], run["resume"]

        def repeats(path):  # None: the loader refused it
            try:
                got = resume(path)
            except (OSError, ValueError):
                return None
            return all(abs(got[s] - log[s]) <= tolerance for s in got)

        chosen = repeats(run["chosen"])
        cause = always or ("corrupt" if chosen is None else "stale" if chosen else "mixed")
        steps = sorted((int(p.name[4:]), p) for p in folder.iterdir() if STEP.fullmatch(p.name))
        if pick == "complete":  # Task 11.2's answer: a manifest, and every listed file with its size
            return cause, latest_complete(folder)
        if pick == "checksums":  # what load_latest takes: the newest whose bytes match their checksums
            return cause, next(p for _, p in reversed(steps) if (p / "MANIFEST.json").exists()
                               and not lab11_diagnose.bad_checksums(p))
        if pick == "name":
            return cause, folder.name
        order = steps if pick == "oldest repeating" else reversed(steps)
        return cause, next(p for _, p in order if repeats(p))
    return diagnose_resume


REFERENCE = {"11.1": commit_with(), "11.2": latest_with(), "11.3": assign_with(), "11.4": order_with(),
             "11.5": diagnose_with()}
WRONG = [  # (task, plausible mistake, what the verdict must mention)
    ("11.1", commit_with(replace=False), "os.replace it over MANIFEST.json"),
    ("11.1", commit_with(tmp_fsync=False), "fsync the temporary file"),
    ("11.1", commit_with(flush=False), "flush the temporary file"),
    ("11.1", commit_with(dir_fsync="none"), "fsync the directory after os.replace"),
    ("11.1", commit_with(dir_fsync="before"), "fsync the directory after os.replace"),
    ("11.1", commit_with(dir_fsync="parent"), "fsync the directory after os.replace"),
    ("11.1", commit_with(walk=False), "misses the files in subfolders"),
    ("11.1", commit_with(skip=("MANIFEST.json",)), "lists MANIFEST.json.tmp"),
    ("11.1", commit_with(list_after_tmp=True, skip=()), "lists MANIFEST.json.tmp"),
    ("11.1", commit_with(skip=("MANIFEST.json.tmp",)), "'files' lists MANIFEST.json:"),
    ("11.1", commit_with(sizes=False), "the file holds"),
    ("11.1", commit_with(mutate=True), "the manifest dict you were given changed"),
    ("11.1", lambda directory, manifest: commit_manifest(directory, {"files": {}}), "lost or changed the caller's"),
    ("11.2", latest_with(numeric=False), "compare the step numbers"),
    ("11.2", latest_with(check_sizes=False), "cut short by a crash"),
    ("11.2", latest_with(check_exists=False), "does not exist makes the checkpoint incomplete"),
    ("11.2", latest_with(catch=False), "catch the ValueError"),
    ("11.2", latest_with(strict_names=False), "only names that are 'step' followed by digits"),
    ("11.2", latest_with(newest="lowest"), "the highest step"),
    ("11.2", latest_with(newest="modified"), "not the last one modified"),
    ("11.2", latest_with(name_only=True), "not its name alone"),
    ("11.3", assign_with(rule="round robin"), "round robin"),
    ("11.3", assign_with(rule="fewest bytes"), "balances bytes, not time"),
    ("11.3", assign_with(rule="fastest"), "every subgroup went to the fastest path"),
    ("11.3", assign_with(rule="ratio before"), "fewest bytes per bandwidth before it"),
    ("11.3", assign_with(rule="earliest finish"), "the path that would finish it first"),
    ("11.3", assign_by_count, "not of their bytes"),
    ("11.3", assign_with(shuffle_ties=True), "the same every time"),
    ("11.3", assign_sorting_in_place, "changed its arguments"),
    ("11.3", assign_with(validate=False), "path 2 has bandwidth 0"),
    ("11.3", assign_with(name_path=False), "does not name the path"),
    ("11.3", assign_with_zero_division, "raised ZeroDivisionError"),
    ("11.4", order_with(order="forward"), "in the same order as step 0"),
    ("11.4", order_with(order="descending first"), "step 0 visits"),
    ("11.4", order_with(order="rotate"), "the reverse of the previous step's order"),
    ("11.4", order_with(cold_start=False), "at step 0 nothing is in host memory"),
    ("11.4", order_with(clamp=False), "a count is never negative"),
    ("11.4", order_with(reads="forward"), "what the same order every step reads"),
    ("11.5", diagnose_with(always="stale"), "the run leaves its log"),
    ("11.5", diagnose_with(always="corrupt"), "matches its checksum"),
    ("11.5", diagnose_with(always="mixed"), "does not match the checksum written for it"),
    ("11.5", diagnose_with(tolerance=1e-2), "not 'stale': resumed from step00000006, the run leaves its log"),
    ("11.5", diagnose_with(pick="complete"), "resuming from step00000008 fails"),
    ("11.5", diagnose_with(pick="checksums"), "resumed from step00000008, the run is not the one that crashed"),
    ("11.5", diagnose_with(pick="oldest repeating"), "redoes 4 steps it need not"),
    ("11.5", diagnose_with(pick="name"), "return the step directory to resume from"),
]

test_reference_passes = reference_passes(REFERENCE)
test_plausible_mistake_fails_with_a_reason = mistakes_fail(WRONG)
test_stub_is_todo = stubs_are_todo(REFERENCE)
test_verdicts_hold_no_timings = same_verdict_every_run(REFERENCE, REFERENCE)


def test_another_commit_passes():
    assert_passes("11.1", commit_with_path_methods)


def test_the_check_leaves_no_files(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    for task_id in ("11.1", "11.2"):
        check.grade(task_id, REFERENCE[task_id])
        check.grade(task_id, WRONG[0][1] if task_id == "11.1" else latest_with(catch=False))
    assert list(tmp_path.iterdir()) == []


def test_each_built_step_directory_is_in_the_state_it_claims(tmp_path):
    for number, state in enumerate(lab11_latest.STATES):
        lab11_latest.make_step(tmp_path, number + 1, state, number)
    got = latest_complete(tmp_path)
    assert got == tmp_path / lab11_latest.step_name(1)  # only the first, "complete", is complete
    names = {p.name for p in (tmp_path / lab11_latest.step_name(3)).iterdir()}
    assert "MANIFEST.json.tmp" in names and "MANIFEST.json" not in names


def test_hand_folders_cover_every_state_and_the_padding():
    states = {state for folder in lab11_latest.HAND for _, state in folder.steps}
    assert states == set(lab11_latest.STATES)
    steps = [step for folder in lab11_latest.HAND for step, _ in folder.steps]
    assert any(len(str(step)) > 8 for step in steps), "no step has more digits than the padding"


def test_the_simulated_host_memory_keeps_the_last_visited():
    forward = [list(range(5))] * 3
    alternate = [list(range(5)), list(range(4, -1, -1)), list(range(5))]
    assert lab11_paths.simulated_reads(forward, 2) == [5, 5, 5]  # LRU meets the kept ones last: all pushed out
    assert lab11_paths.simulated_reads(alternate, 2) == [5, 3, 3]
    assert lab11_paths.simulated_reads(alternate, 9) == [5, 0, 0]
    assert lab11_paths.simulated_reads(alternate, 0) == [5, 5, 5]


def test_the_right_split_stays_within_one_subgroup_on_many_more_cases():
    rng = random.Random(7)
    for _ in range(2000):
        sizes, bandwidths = lab11_paths._random_case(rng)
        assert lab11_paths._property_broken(sizes, bandwidths, assign_paths(sizes, bandwidths)) == ""


def test_the_graders_mistakes_are_the_tests_mistakes():
    """The grader names a mistake by recomputing it: its copy must give what the learner's would."""
    for sizes, bandwidths in lab11_paths.cases()[:60]:
        for rule, mistake in (("round robin", lab11_paths._round_robin), ("fewest bytes", lab11_paths._fewest_bytes),
                              ("fastest", lab11_paths._fastest_only),
                              ("ratio before", lab11_paths._lowest_ratio_before),
                              ("earliest finish", lab11_paths._earliest_finish)):
            assert mistake(sizes, bandwidths) == assign_paths(sizes, bandwidths, rule=rule), rule


def solution_lines(min_length=25):
    nb = nbformat.read(ROOT / "exercises" / "solutions" / "lab11_checkpoints.ipynb", as_version=4)
    lines = []
    for cell in nb.cells:
        for region in cell.source.split("# BEGIN SOLUTION")[1:]:
            for line in region.split("# END SOLUTION")[0].splitlines()[1:]:
                code = line.split("#")[0].strip()
                if len(code) >= min_length:
                    lines.append(code)
    return lines


def test_no_lab11_grader_holds_a_line_of_the_solution():
    graded = {line.split("#")[0].strip() for module in (lab11, lab11_diagnose, lab11_latest, lab11_paths)
              for line in inspect.getsource(module).splitlines()}
    shared = [line for line in solution_lines() if line in graded]
    assert solution_lines() and not shared, f"a Lab 11 grader holds the solution's line {shared[:1]}"


@pytest.mark.parametrize("task_id", sorted(REFERENCE))
def test_the_solution_notebook_answers_pass(task_id):
    """The notebook's own answers, run outside Jupyter: each passes its grader."""
    nb = nbformat.read(ROOT / "exercises" / "solutions" / "lab11_checkpoints.ipynb", as_version=4)
    namespace: dict = {}
    for cell in nb.cells:
        if cell.cell_type == "code" and ("# BEGIN SOLUTION" in cell.source or cell.source.startswith("import")):
            exec(compile(cell.source, "<lab11 solution>", "exec"), namespace)
    called = {re.search(r'check\.task\("([\d.]+)", (\w+)\)', c.source).groups()
              for c in nb.cells if c.cell_type == "code" and 'check.task("' in c.source}
    fn_name = dict(called)[task_id]
    assert_passes(task_id, namespace[fn_name])
