"""Lab verdicts: right answers pass, wrong ones fail with a reason, stubs say TODO; a crash shows the learner's
own frames."""

import inspect
import json
import re
from pathlib import Path

import pytest
from grader_harness import mistakes_fail, reference_passes, stub, stubs_are_todo

from minioffload.course import check
from minioffload.predict import memory

REFERENCE = {
    "1.1": lambda precision, optimizer: memory.footprint(precision, optimizer).per_param(),
    "1.2": lambda s, b, h, a, layers, flash: (
        layers * memory.activation_bytes_per_layer(s, b, h, a, flash_attention=flash), "B"),
    "1.3": lambda hw, placement: (
        memory.max_params_that_fit(hw.device_memory, memory.footprint("mixed_bf16", "adam", placement)), "params"),
    "1.4": lambda n, hw: memory.first_placement_that_fits(n, hw.device_memory, host_bytes=hw.host_memory),
}
WRONG = [  # plausible mistakes a learner makes
    ("1.1", lambda precision, optimizer: 16, "expected"),  # the famous number for every setup
    ("1.2", lambda s, b, h, a, layers, flash: (layers * 34 * s * b * h, "B"), "expected"),  # forgot the scores
    ("1.3", lambda hw, placement: (hw.device_memory / 16, "params"), "expected"),  # ignored the placement
    ("1.4", lambda n, hw: "optimizer_cpu" if 16 * n > hw.device_memory else "device", "expected"),  # ignored host
]

test_reference_passes = reference_passes(REFERENCE, built_on_the_runtime=REFERENCE)
test_plausible_mistake_fails_with_a_reason = mistakes_fail(WRONG)
test_stub_is_todo = stubs_are_todo(REFERENCE)


def test_a_crash_is_a_verdict_not_a_traceback():
    verdict = check.grade("1.1", lambda precision, optimizer: {}["missing"])
    assert verdict.status == "FAIL" and "KeyError" in verdict.detail
    assert check.grade("1.1", 16).status == "FAIL"


def _lookup(table, key):
    return table[key]  # the learner's helper, where the error is raised


def crashes_in_a_helper(precision, optimizer):
    return _lookup({}, precision)


def test_a_crash_shows_the_learners_frames_and_the_exception_after_the_fail_line(capsys):
    check.task("1.1", crashes_in_a_helper)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "FAIL Task 1.1: your function raised KeyError: 'fp32'"
    assert lines[1] == "Traceback (your code only, most recent call last):"
    frames = [line for line in lines if line.startswith("  File ")]
    assert [re.search(r", in (\w+)$", f)[1] for f in frames] == ["crashes_in_a_helper", "_lookup"]
    assert all(__file__ in f for f in frames)  # the test file plays the notebook cell: no grader's or library's
    assert any(line.strip().startswith("return table[key]") for line in lines)  # the line that raised
    assert lines[-1] == "KeyError: 'fp32'"
    assert len(lines) <= 9  # short: the FAIL line, a header, two frames with their lines, the exception


def test_an_error_with_no_frame_of_the_learners_is_not_blamed_on_them_and_shows_every_frame(monkeypatch):
    from functools import partial

    from minioffload.course.check import grading

    monkeypatch.setitem(grading.GRADERS, "0.0", partial(grading.grade, "no such task"))  # a check that breaks itself
    verdict = check.grade("0.0", lambda: None)
    assert verdict.status == "FAIL" and verdict.detail.startswith("the check raised ValueError: no grader")
    assert "your function raised" not in verdict.detail
    assert "grading.py" in verdict.traceback and verdict.traceback.startswith("Traceback (most recent call last)")


def test_only_the_innermost_learners_frames_are_shown():
    def f1():
        return 1 / 0

    def f2():
        return f1()

    def f3():
        return f2()

    def f4():
        return f3()

    def f5():
        return f4()

    verdict = check.grade("1.1", lambda precision, optimizer: f5())  # six frames of the learner's
    frames = [line for line in verdict.traceback.splitlines() if line.startswith("  File ")]
    assert [f.rsplit(" ", 1)[1] for f in frames] == ["f4", "f3", "f2", "f1"][-check.MAX_FRAMES:]
    assert "2 earlier frame(s) of yours" in verdict.traceback
    assert verdict.traceback.endswith("ZeroDivisionError: division by zero")


def test_an_assert_in_the_learners_code_is_theirs_a_graders_assert_is_the_verdict():
    def asserts(precision, optimizer):
        assert precision == "never", "my own check"

    mine = check.grade("1.1", asserts)
    assert mine.status == "FAIL" and mine.detail.startswith("your function raised AssertionError: my own check")
    assert "in asserts" in mine.traceback
    graders = check.grade("1.1", lambda precision, optimizer: 17)
    assert graders.status == "FAIL" and "expected" in graders.detail and graders.traceback == ""
    assert "\n" not in str(graders)


def test_unknown_task_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="known tasks: 1.1, 1.2"):
        check.grade("9.9", stub)


def test_task_and_expect_print_exactly_one_line(capsys):
    check.task("1.1", WRONG[0][1])
    check.expect("two is even", 2 % 2 == 0, "2 % 2 = 0")
    check.expect("three is even", 3 % 2 == 0)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("FAIL Task 1.1")
    assert lines[1:] == ["PASS two is even (2 % 2 = 0)", "FAIL three is even"]


def solution_lines(min_length: int = 30) -> list[tuple[str, str]]:
    """(lab, line) for every line of code in the labs' solution regions, comments dropped, short lines left out."""
    lines = []
    for lab in sorted((Path(__file__).resolve().parents[2] / "exercises" / "solutions").glob("*.ipynb")):
        for cell in json.loads(lab.read_text())["cells"]:
            for region in "".join(cell["source"]).split("# BEGIN SOLUTION")[1:]:
                for line in region.split("# END SOLUTION")[0].splitlines()[1:]:
                    code = line.split("#")[0].strip()
                    if len(code) >= min_length:
                        lines.append((lab.name, code))
    return lines


def test_no_grader_holds_a_line_of_a_tasks_solution():
    graders = [m for m in vars(check).values() if inspect.ismodule(m) and m.__name__.startswith(check.__name__)]
    graded = {line.split("#")[0].strip() for m in graders for line in inspect.getsource(m).splitlines()}
    shared = [(lab, line) for lab, line in solution_lines() if line in graded]
    assert not shared, f"{shared[0][0]}: a grader holds the solution's line {shared[0][1]!r}"


def test_in_a_notebook_a_frame_is_named_by_its_cell(monkeypatch):
    # IPython compiles each cell into a temporary file and maps it to the cell's execution count
    from minioffload.course.check import grading

    monkeypatch.setattr(grading, "_notebook_cells", lambda: {__file__: 7})
    lines = check.grade("1.1", crashes_in_a_helper).traceback.splitlines()
    frames = [line for line in lines if line.startswith("  File ")]
    line_of = {name: inspect.getsourcelines(fn)[1] + 1 for name, fn in
               (("crashes_in_a_helper", crashes_in_a_helper), ("_lookup", _lookup))}
    assert frames == [f'  File "Cell In[7]", line {line_of[name]}, in {name}' for name in ("crashes_in_a_helper",
                                                                                          "_lookup")]
    assert any(line.strip().startswith("return table[key]") for line in lines)  # the cell's line is still shown
    assert lines[-1] == "KeyError: 'fp32'"


def test_a_kernel_cell_shows_its_cell_number_and_line(tmp_path):
    # the real thing: a Jupyter kernel runs a learner's helper that raises; the FAIL shows that cell and line
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    helper = ("def _lookup(table, key):\n    value = table[key]\n    return value\n\n\n"
              "def bytes_per_param(precision, optimizer):\n    return _lookup({}, precision)")
    nb.cells = [nbformat.v4.new_code_cell(source) for source in
                ("from minioffload.course import check", helper, 'check.task("1.1", bytes_per_param)')]
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    lines = "".join(o.get("text", "") for o in nb.cells[2].outputs if o.output_type == "stream").splitlines()
    assert lines[0] == "FAIL Task 1.1: your function raised KeyError: 'fp32'"
    frames = [line for line in lines if line.startswith("  File ")]
    assert frames == ['  File "Cell In[2]", line 7, in bytes_per_param', '  File "Cell In[2]", line 2, in _lookup']
    assert lines[-1] == "KeyError: 'fp32'"


def test_a_target_check_prints_a_miss_as_a_miss(capsys):
    from minioffload.course import check

    check.target("the error is within 0.15", 0.56, 0.15, 0.56 <= 0.15, "8 plans")
    check.target("the error is within 0.15", 0.10, 0.15, 0.10 <= 0.15)
    missed, met = capsys.readouterr().out.splitlines()
    assert missed == "MISSED: 0.56 against 0.15: the error is within 0.15 (8 plans)"
    assert met == "MET the error is within 0.15 (0.10 against 0.15)" and "PASS" not in missed


def test_a_timed_verdict_says_so_and_nbval_compares_it_sanitized(capsys):
    """A verdict on a time measured on a shared machine can flip under load: it is marked, and the sanitizer that
    nbval uses turns the whole line into one token (the verdict stays visible in the book)."""
    import configparser
    import re
    from pathlib import Path

    from minioffload.course import check

    check.expect("offload hides", False, "1.30x", timed=True)
    check.target("the error is within 0.15", 0.42, 0.15, False, timed=True)
    check.expect("the bytes agree", True)
    failed, missed, plain = capsys.readouterr().out.splitlines()
    assert failed == "FAIL (timed) offload hides (1.30x)" and missed.startswith("MISSED (timed): 0.42 against 0.15")
    rules = configparser.ConfigParser()
    rules.read(Path(__file__).resolve().parents[1] / "nbval_sanitize.cfg")
    rule = rules["timed verdicts"]
    text = re.sub(rule["regex"], rule["replace"], "\n".join([failed, missed, plain]))
    assert text.splitlines() == ["TIMED VERDICT", "TIMED VERDICT", plain]
