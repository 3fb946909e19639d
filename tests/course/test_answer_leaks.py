"""No answer before its task: a lab solution matches no function the course prints or defines, and no chapter a
learner reads before a lab prints the source of a runtime function that lab's tasks rebuild."""

import ast
import inspect
import re
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

from minioffload import layout
from minioffload.course.check.grading import REBUILDS
from minioffload.course.check.refuse import resolve
from minioffload.course.source import interface

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import answer_leaks  # noqa: E402

CHAPTERS = sorted((ROOT / "book" / "chapters").glob("[0-9][0-9]_*.ipynb"))


# Tasks whose answer the runtime holds nearly line for line, still to be turned into variants it does not contain
# (or into design tasks graded on properties). Listed, not hidden: the test fails when one stops matching, so that
# the entry goes too, and when any other task starts to.
STILL_THE_RUNTIMES = {
    "2.2": "minioffload.devices.pipeline.overlapped",
    "9.3": "minioffload.planner.milp.brute_force",
}


def test_no_solution_region_matches_a_function_of_the_runtime_or_a_chapter():
    leaks = {m.task: m for m in answer_leaks.leaks()}
    unlisted = [m for task, m in leaks.items() if STILL_THE_RUNTIMES.get(task) != m.where]
    assert not unlisted, "lab answers the course already holds: " + "; ".join(
        f"Task {m.task} matches {m.where} ({m.ratio:.2f})" for m in unlisted)
    assert leaks.keys() == STILL_THE_RUNTIMES.keys(), (
        f"no longer a copy of the runtime: {sorted(STILL_THE_RUNTIMES.keys() - leaks.keys())}; take them off the list")


def test_the_comparison_finds_a_renamed_copy_and_not_a_different_function():
    (definition,) = ast.parse(inspect.getsource(layout.shard_owners)).body
    runtime = [("layout.shard_owners", answer_leaks.normalised_tokens(definition.body))]
    renamed = """
held_so_far = [0] * n
result = []
for s in subgroup_sizes:
    r = min(range(n), key=lambda k: (held_so_far[k], k))  # reworded and commented
    result.append(r)
    held_so_far[r] += s
return result
"""
    different = """
loads = sorted(range(n), key=lambda k: -subgroup_sizes[k])
result = [None] * len(subgroup_sizes)
for position, index in enumerate(loads):
    result[index] = position % n if position // n % 2 == 0 else n - 1 - position % n
assert all(r is not None for r in result), "every subgroup placed"
return result
"""
    for source, copied in ((renamed, True), (different, False)):
        tokens = answer_leaks.normalised_tokens(ast.parse(source).body)
        (match,) = answer_leaks.closest([("0.0", tokens)], runtime)
        assert (match.ratio >= answer_leaks.THRESHOLD) == copied, match


def _printed(chapter: Path) -> str:
    """Everything the stored chapter shows in its outputs (printed source among it)."""
    texts = []
    for cell in nbformat.read(chapter, as_version=4).cells:
        for output in cell.get("outputs", []):
            texts.append(output.get("text", ""))
            texts += [str(v) for k, v in output.get("data", {}).items() if k.startswith("text/")]
    return "\n".join(texts)


def _body_lines(name: str) -> list[str]:
    """The lines of a runtime function's body (its docstring and short lines such as `return out` left out): what
    printing its source would show and printing its interface would not."""
    function = resolve(name)[2]
    source = textwrap.dedent(inspect.getsource(getattr(function, "py_func", function)))
    (node,) = ast.parse(source).body
    body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
        else node.body
    lines = source.splitlines()[body[0].lineno - 1:]
    return [line.strip() for line in lines if len(line.strip()) >= 24]


def _shows(printed: str, lines: list[str]) -> bool:
    return sum(line in printed for line in lines) >= min(2, len(lines)) > 0


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_no_chapter_prints_the_runtime_source_a_later_or_companion_lab_rebuilds(chapter):
    number = int(re.match(r"\d+", chapter.name)[0])
    printed = _printed(chapter)
    shown = [f"Task {task}: {name}" for task, names in REBUILDS.items() if int(task.split(".")[0]) >= number
             for name in names if _shows(printed, _body_lines(name))]
    assert not shown, f"{chapter.name} prints the source of a function a lab after it asks the learner for: {shown}"


def test_an_interface_shows_what_a_function_does_and_not_its_body():
    printed = interface(layout.shard_owners, "Task 10.1")
    assert "def shard_owners(" in printed and "the fewest" in printed and "Task 10.1" in printed
    assert not _shows(printed, _body_lines("minioffload.layout.shard_owners"))
    assert _shows(inspect.getsource(layout.shard_owners), _body_lines("minioffload.layout.shard_owners"))
