"""The runtime source a notebook prints (`inspect.getsource` cells) against the runtime's source today.

nbval does not compare those cells' outputs (they are tagged `nbval-ignore-output`, since their text is long), so a
change to the runtime would leave the book printing yesterday's code. This script runs, per notebook, the cell that
imports `inspect` and then each cell that calls `inspect.getsource` (or `show_interface`, which prints a function's
interface), and compares what they print with the stored
output: `--check` lists the stale cells and exits 1; without it, their stored outputs are replaced (nothing else in
the notebook changes, so every measured figure stays as it was measured).

    python tools/notebook_sources.py --check book/chapters/*.ipynb exercises/solutions/*.ipynb

What this is not: an executor of notebooks (nbval and `make book` execute them).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from pathlib import Path


def _stored(cell: dict) -> str:
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def stale_cells(path: Path, refresh: bool = False) -> list[str]:
    """The cells of `path` whose stored source differs from what they print today (replaced when `refresh`)."""
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    shown = [c for c in code if any(call in "".join(c["source"]) for call in ("inspect.getsource", "show_interface("))]
    if not shown:
        return []
    setup = next(c for c in code if "import inspect" in "".join(c["source"]))
    namespace: dict = {}
    here = os.getcwd()
    os.chdir(path.parent)  # as the notebook runs
    try:
        stale = []
        for cell in [setup] + [c for c in shown if c is not setup]:
            lines = [line for line in "".join(cell["source"]).splitlines() if not line.startswith("%")]
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile("\n".join(lines), f"{path.name}: {cell.get('id')}", "exec"), namespace)
            if cell not in shown:  # the setup cell only imports
                continue
            if printed.getvalue() != _stored(cell):
                stale.append(f"{path}: cell {cell.get('id')}: {''.join(cell['source']).splitlines()[0]}")
                cell["outputs"] = [{"name": "stdout", "output_type": "stream",
                                    "text": printed.getvalue().splitlines(keepends=True)}]
    finally:
        os.chdir(here)
    if refresh and stale:
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="list the stale cells and exit 1; change nothing")
    args = parser.parse_args(argv)
    os.environ.setdefault("MPLBACKEND", "Agg")
    stale = [line for path in args.notebooks for line in stale_cells(path.resolve(), refresh=not args.check)]
    for line in stale:
        print(("stale: " if args.check else "refreshed: ") + line)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
