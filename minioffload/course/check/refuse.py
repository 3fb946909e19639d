"""While a task is graded, the runtime functions it rebuilds refuse to be called by the learner's code.

A task that asks for the shard map must not pass because the learner's function returns
`layout.shard_owners(sizes, ranks)`. `refusing(names, learner)` swaps each named function, for the length of a
`with` block, for a guard that raises `CalledTheRuntime` when the learner's code called it (directly or through
other runtime code), and calls the original otherwise: the graders themselves compare against these functions.

Where the guard goes: wherever a name refers to the function, in every loaded `minioffload` module and in the
learner's own namespace (a notebook that ran `from minioffload.layout import shard_owners` holds the function
itself), and on the class for a method. Who called: the frames between the guard and the `grade` call that runs
the grader; one of the learner's there (a notebook cell, a file outside the package and the installed libraries)
is a refusal. The check cell that called `grade` sits above that boundary and does not count.

A jitted (Numba) function compiled while a guard is up would see the guard in its globals and fail to compile: a
grader whose task rebuilds a jitted helper must not compile the kernels that call it (Lab 3's compare with torch
and with the NumPy reference).

This is not a sandbox: a learner who copies the runtime's source, or imports it under another name after the
grader started, is not caught here (tools/answer_leaks.py keeps the course from printing the answers).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

RUNTIME = "minioffload"


class CalledTheRuntime(Exception):
    """The learner's function called a runtime function its task rebuilds."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def resolve(name: str) -> tuple[object, str, Callable]:
    """'minioffload.layout.shard_owners' or 'minioffload.model.activations.Activations._pack' as
    (the module or class that holds it, the attribute, the function)."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            holder = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:-1]:
            holder = getattr(holder, attr)
        function = vars(holder).get(parts[-1]) if isinstance(holder, type) else getattr(holder, parts[-1], None)
        if not callable(function):
            raise ValueError(f"{name} is not a function (a task's `rebuilds` names runtime functions)")
        return holder, parts[-1], function
    raise ValueError(f"no module found for {name}")


def _learners_frame_below(frame: FrameType | None, boundary: object, is_learners: Callable[[str], bool]) -> bool:
    while frame is not None and frame.f_code is not boundary:
        if is_learners(frame.f_code.co_filename):
            return True
        frame = frame.f_back
    return False


@contextmanager
def refusing(names: tuple[str, ...], learner: object, boundary: object, is_learners: Callable[[str], bool],
             refused: list[str]) -> Iterator[None]:
    """Guard the functions `names` while the block runs; a refused call is appended to `refused` (so a learner's
    `except Exception` that swallows the error does not hide it). `boundary`: the code object of the frame that runs
    the grader; `learner`: the learner's function or class (its module's namespace is guarded too)."""
    swaps: list[tuple[object, str, object]] = []  # (holder, attribute, what it held): put back in reverse order

    def swap(holder: object, attr: str, value: object) -> None:
        swaps.append((holder, attr, vars(holder)[attr] if isinstance(holder, type) else getattr(holder, attr)))
        setattr(holder, attr, value)

    try:
        for name in names:
            holder, attr, original = resolve(name)
            short = name.removeprefix(f"{RUNTIME}.")

            @functools.wraps(original)
            def guard(*args, _original=original, _short=short, **kwargs):
                if _learners_frame_below(sys._getframe(1), boundary, is_learners):
                    refused.append(_short)
                    raise CalledTheRuntime(_short)
                return _original(*args, **kwargs)

            guard.refuses_learners = True  # what a test looks for to see every guard gone again
            if isinstance(holder, type):
                swap(holder, attr, guard)
                continue
            namespaces = [m for key, m in list(sys.modules.items()) if key == RUNTIME or key.startswith(f"{RUNTIME}.")]
            learner_module = sys.modules.get(getattr(learner, "__module__", None) or "")
            for module in namespaces + ([learner_module] if learner_module else []):
                for key, value in list(vars(module).items()):
                    if value is original:
                        swap(module, key, guard)
            learner_globals = getattr(learner, "__globals__", None)  # a notebook's namespace is not a module
            if learner_globals is not None and (learner_module is None or learner_globals is not vars(learner_module)):
                for key, value in list(learner_globals.items()):
                    if value is original:
                        swaps.append((learner_globals, key, value))
                        learner_globals[key] = guard
        yield
    finally:
        for holder, attr, value in reversed(swaps):
            if isinstance(holder, dict):
                holder[attr] = value
            else:
                setattr(holder, attr, value)
