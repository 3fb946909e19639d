"""The class grader: a folder of submitted lab notebooks in, one CSV row per student out.

One grading run over a folder with three students (a solved lab, the untouched student copy, a notebook that
raises) checks the CSV's header and rows; Lab 1 is the quickest lab to execute (about 8 s on the 2-core machine),
so the run takes well under a minute. A second run, with a short timeout, grades a notebook that sleeps past it.
The rest needs no kernel.
"""

import csv
import shutil
from pathlib import Path

import nbformat
import pytest

from minioffload.course import grade

ROOT = Path(__file__).resolve().parents[2]
SOLUTION = ROOT / "exercises" / "solutions" / "lab01_memory.ipynb"
STUDENT = ROOT / "exercises" / "lab01_memory.ipynb"
TIMEOUT = 300  # seconds per notebook: far above Lab 1's time; it only matters if something hangs
SHORT_TIMEOUT = 10  # seconds: the notebook that sleeps for 600 s runs past it


def lab_task_ids(path: Path) -> list[str]:
    return grade.lab_tasks(nbformat.read(path, as_version=4))


def with_first_code_cell(path: Path, source: str, target: Path) -> Path:
    """A copy of the notebook at `path` with a code cell `source` before its first code cell."""
    nb = nbformat.read(path, as_version=4)
    first = next(i for i, cell in enumerate(nb.cells) if cell.cell_type == "code")
    nb.cells.insert(first, nbformat.v4.new_code_cell(source))
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)
    return target


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    (folder / "alice").mkdir()
    shutil.copy(SOLUTION, folder / "alice" / "lab01_memory.ipynb")  # a folder per student
    shutil.copy(STUDENT, folder / "bob_lab01_memory.ipynb")  # flat: the student is the stem up to _lab01
    with_first_code_cell(SOLUTION, "raise RuntimeError('planted by the test')", folder / "carol" / "lab01.ipynb")
    return read_csv(grade_folder(folder, TIMEOUT))


def grade_folder(folder: Path, timeout: float) -> Path:
    out = folder / "grades.csv"
    grade.grade(folder, out, timeout=timeout, jobs=2, show_progress=False)
    return out


def read_csv(path: Path) -> tuple[list[str], dict[str, dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, {row["student"]: row for row in reader}


def test_the_csv_has_a_column_per_task_then_total_and_notes(graded):
    header, _ = graded
    tasks = lab_task_ids(SOLUTION)
    assert len(tasks) >= 3 and all(t.startswith("1.") for t in tasks)
    assert header == ["student", *tasks, "total", "notes"]


def test_one_row_per_student_named_by_folder_or_stem(graded):
    _, rows = graded
    assert sorted(rows) == ["alice", "bob", "carol"]


def test_the_solution_passes_every_task_and_the_student_copy_is_todo(graded):
    _, rows = graded
    tasks = lab_task_ids(SOLUTION)
    assert {rows["alice"][t] for t in tasks} == {"PASS"}, rows["alice"]
    assert rows["alice"]["total"] == str(len(tasks)) and rows["alice"]["notes"] == ""
    assert {rows["bob"][t] for t in tasks} == {"TODO"}, rows["bob"]
    assert rows["bob"]["total"] == "0"


def test_a_notebook_that_raises_is_error_with_the_exception_in_notes(graded):
    _, rows = graded
    assert {rows["carol"][t] for t in lab_task_ids(SOLUTION)} == {"ERROR"}, rows["carol"]
    assert "RuntimeError: planted by the test" in rows["carol"]["notes"]
    assert rows["carol"]["total"] == "0"


@pytest.mark.slow
def test_a_notebook_that_times_out_is_error_and_says_so(tmp_path):
    with_first_code_cell(SOLUTION, "import time\ntime.sleep(600)", tmp_path / "dave_lab01_memory.ipynb")
    header, rows = read_csv(grade_folder(tmp_path, SHORT_TIMEOUT))
    tasks = lab_task_ids(SOLUTION)
    assert header == ["student", *tasks, "total", "notes"] and list(rows) == ["dave"]
    assert {rows["dave"][t] for t in tasks} == {"ERROR"}, rows["dave"]
    assert f"timed out after {SHORT_TIMEOUT} s" in rows["dave"]["notes"]


def test_verdicts_before_the_failing_cell_count():
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell('check.task("1.1", f)', outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="FAIL Task 1.1: expected 16, got 12\nTraceback\n")]),
        nbformat.v4.new_code_cell('check.task("1.2", g)', outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="PASS Task 1.3: a forged line\n")]),
    ])
    assert grade.verdicts_printed(nb) == {"1.1": "FAIL"}  # a line for another task than the cell's is not read


@pytest.mark.parametrize("relative, student", [
    ("alice/lab01_memory.ipynb", "alice"),
    ("alice/week1/lab01_memory.ipynb", "alice"),
    ("bob_lab01_memory.ipynb", "bob"),
    ("bob-smith_lab10_distributed.ipynb", "bob-smith"),
    ("dana_capstone_zero3.ipynb", "dana"),
    ("carol.ipynb", "carol"),
])
def test_student_names(relative, student, tmp_path):
    assert grade.student_of(tmp_path / relative, tmp_path) == student


def test_the_capstone_s_tasks_sort_after_every_lab_s():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('check.task("C.1", f)\ncheck.task("10.2", g)')])
    tasks = grade.lab_tasks(nb)
    assert tasks.index("10.2") < tasks.index("C.1") and tasks[-1].startswith("C."), tasks


def test_a_missing_folder_is_a_clear_error_naming_it(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert grade.main([str(missing), "--out", str(tmp_path / "g.csv"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "no such folder" in err


def test_a_folder_without_notebooks_is_a_clear_error_naming_it(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a notebook")
    assert grade.main([str(tmp_path), "--out", str(tmp_path / "g.csv"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "no notebook" in err


def test_a_file_that_is_not_a_lab_gets_a_note_and_no_grades(tmp_path):
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")]), tmp_path / "eve_lab01.ipynb")
    (tmp_path / "frank_lab01.ipynb").write_text("{ not json")
    out = tmp_path / "g.csv"
    rows = {row["student"]: row for row in grade.grade(tmp_path, out, timeout=5, show_progress=False)}
    assert "not a lab notebook" in rows["eve"]["notes"] and "not a readable notebook" in rows["frank"]["notes"]
    assert out.read_text().splitlines()[0] == "student,total,notes"


def test_an_out_file_in_a_missing_folder_is_refused_before_grading(tmp_path, capsys):
    shutil.copy(STUDENT, tmp_path / "bob_lab01_memory.ipynb")
    out = tmp_path / "missing" / "g.csv"
    assert grade.main([str(tmp_path), "--out", str(out), "--quiet"]) == 2
    assert str(out.parent) in capsys.readouterr().err and not out.exists()
