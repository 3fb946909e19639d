"""No notebook carries nbval's comment markers: a page must not show `# NBVAL_IGNORE_OUTPUT`.

nbval reads cell tags as well (`nbval-ignore-output`, `nbval-skip`, `nbval-raises-exception`, ...), and a tag is
not shown on the page; the built HTML is checked for the same in test_book_html.py.
"""

from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "book" / "chapters").glob("*.ipynb")) + sorted((ROOT / "exercises").rglob("*.ipynb"))
NOTEBOOKS = [p for p in NOTEBOOKS if ".ipynb_checkpoints" not in p.parts]


def test_there_are_notebooks_to_check():
    assert any("chapters" in p.parts for p in NOTEBOOKS) and any("solutions" in p.parts for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_cell_holds_an_nbval_comment_marker(path):
    cells = nbformat.read(path, as_version=4).cells
    marked = [f"cell {i}: {line.strip()}" for i, cell in enumerate(cells)
              for line in cell.source.splitlines() if "NBVAL" in line]
    assert not marked, (f"{path.name} has nbval comment markers; make each a cell tag (# NBVAL_IGNORE_OUTPUT -> "
                        f"the tag nbval-ignore-output, # NBVAL_SKIP -> nbval-skip): {marked}")
