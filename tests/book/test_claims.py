"""What the chapters claim, read from the notebooks as they are stored (nbval keeps their outputs what a run prints):
a check never prints PASS beside a missed target, and a paper or system a chapter names is cited where it first
names it."""

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / "book" / "chapters").glob("*.ipynb"))
NOTEBOOKS = CHAPTERS + sorted((ROOT / "exercises" / "solutions").glob("*.ipynb"))

# A line that reports a miss: check.target prints "MISSED: value against goal: claim"; prose verdicts say "missed"
MISS = re.compile(r"\b(MISSED|missed|misses|not met|unmet)\b")
PASS = re.compile(r"\bPASS\b")

# Each paper or system the book names, and its key in book/references.bib (a chapter cites it with its own prefix,
# ch7-korthikanti2022reducing). Add a name here when a chapter starts naming it.
NAMED = {
    "ZeRO-Offload": "ren2021zerooffload", "ZeRO-Infinity": "rajbhandari2021zeroinfinity",
    "ZeRO-3": "rajbhandari2020zero", "Fuyou": "liao2024lohan", "LoHan": "liao2024lohan",
    "SSDTrain": "wu2024ssdtrain", "MLP-Offload": "maurya2025mlpoffload", "DataStates": "maurya2024datastates",
    "Deep Optimizer States": "maurya2024deep", "Korthikanti": "korthikanti2022reducing",
    "FlashAttention": "dao2022flashattention", "SynergyScale": "sun-synergyscale", "Tiny-Pipe": "tinypipe",
    "LazyTrain": "wu-lazytrain", "FlexGen": "sheng2023flexgen", "Checkmate": "jain2020checkmate",
    "SuperOffload": "lian2025superoffload", "Twin-Flow": "deepspeed2023offloadpp", "xxHash": "collet2012xxhash",
}


def output_text(cell) -> str:
    return "".join("".join(out.get("text", "")) + "".join(out.get("data", {}).get("text/plain", ""))
                   for out in cell.get("outputs", []))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_check_prints_pass_beside_a_miss(notebook):
    """A cell that prints a miss does not also print PASS: the verdict is the target the prose states."""
    cells = nbformat.read(notebook, as_version=4).cells
    both = []
    for index, cell in enumerate(cells):
        lines = output_text(cell).splitlines() if cell.cell_type == "code" else []
        passes, misses = [x for x in lines if PASS.search(x)], [x for x in lines if MISS.search(x)]
        if passes and misses:
            both.append(f"cell {index}: {passes[0].strip()!r} beside {misses[0].strip()!r}")
    assert not both, f"{notebook.name}: " + "; ".join(both)


def test_the_pass_beside_a_miss_check_can_fail():
    cell = nbformat.v4.new_code_cell("")
    cell.outputs = [nbformat.v4.new_output("stream", text="PASS the plan's step\nMISSED: 0.42 against 0.15: error\n")]
    lines = output_text(cell).splitlines()
    assert any(PASS.search(x) for x in lines) and any(MISS.search(x) for x in lines)


def first_mentions(notebook: Path) -> dict[str, str]:
    """Name -> the markdown of the chapter's first cell that names it."""
    found = {}
    for cell in nbformat.read(notebook, as_version=4).cells:
        if cell.cell_type != "markdown":
            continue
        for name in NAMED:
            if name not in found and re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", cell.source):
                found[name] = cell.source
    return found


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_a_chapter_cites_each_system_where_it_first_names_it(chapter):
    uncited = [name for name, text in first_mentions(chapter).items()
               if not re.search(r"\{cite[a-z:]*\}`[^`]*\b(ch\d+-)?" + re.escape(NAMED[name]) + r"\b", text)]
    assert not uncited, (f"{chapter.name} names {', '.join(uncited)} without citing it where it first does: add "
                         "{cite}`chN-KEY` there (the keys are in tests/book/test_claims.py's NAMED)")


def test_every_named_key_is_in_the_bibliography():
    bib = (ROOT / "book" / "references.bib").read_text()
    keys = set(re.findall(r"^@\w+\{([^,]+),", bib, flags=re.M))
    assert set(NAMED.values()) <= keys, sorted(set(NAMED.values()) - keys)
