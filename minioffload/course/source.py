"""What a chapter prints of a runtime function a lab asks the learner to write: its interface, not its body.

`show_interface(fn, "Task 10.1")` prints the function's `def` line and docstring, then a line saying where the
body is written and where the runtime's own version can be read once the task is done. A chapter shows the
runtime's source of everything else with `inspect.getsource`; for a piece a later lab rebuilds, this keeps the
chapter's account of what the piece must do without printing the answer (tests/course/test_answer_leaks.py).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path


def interface(fn, task: str) -> str:
    """The source of `fn` (a function or method; a jitted one through its Python function) with its body replaced
    by a pointer to `task` ("Task 10.1", or "Task 3.5 (its fp32 twin)" for a sibling of what the task builds)."""
    fn = getattr(fn, "py_func", fn)
    lines = textwrap.dedent(inspect.getsource(fn)).splitlines()
    (node,) = ast.parse("\n".join(lines)).body
    first = node.body[0]
    has_docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
        first.value.value, str)
    kept = lines[:first.end_lineno if has_docstring else first.lineno - 1]
    indent = " " * (len(lines[first.lineno - 1]) - len(lines[first.lineno - 1].lstrip()))
    module = Path(inspect.getsourcefile(fn)).resolve()
    package = Path(__file__).resolve().parents[1]
    where = module.relative_to(package.parent).as_posix() if module.is_relative_to(package.parent) else module.name
    return "\n".join([*kept, f"{indent}...  # the body is yours to write in {task}; the runtime's is in {where}"])


def show_interface(fn, task: str) -> None:
    print(interface(fn, task))
