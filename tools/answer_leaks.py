"""Find lab answers the learner could copy: a solution's marked region that matches a function the runtime defines
or a chapter prints, once names and layout are normalised.

Both sides are parsed and compared as token sequences of `ast.unparse` (so comments, docstrings, whitespace and
line breaks do not count), with the code's own names read as one (`shard_owners(sizes, ranks)` and `owners(s, n)`
read the same; builtins and attribute names are kept) and `self.x` read as `x` (a method and a free function that
do the same work read the same). Two sequences match when difflib's ratio reaches THRESHOLD. Regions and functions
shorter than MIN_TOKENS are skipped: a two-line formula has few ways to be written, and matching them says nothing.

What it compares against: every function and method in the `minioffload` package, and every function a chapter's
code cell defines (chapters print the runtime's source with `inspect.getsource`, which the first set covers).
It is not a plagiarism detector for learners' work: it keeps the course from printing its own answers.

Usage: python tools/answer_leaks.py [--all]   (prints each region's closest function; --all: every region)
"""

from __future__ import annotations

import argparse
import ast
import builtins
import difflib
import io
import keyword
import re
import sys
import textwrap
import tokenize
from dataclasses import dataclass
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
THRESHOLD = 0.8  # a region this close to a function's body, after normalising, is that function's answer
MIN_TOKENS = 40
BUILTINS = frozenset(dir(builtins))
REGION = re.compile(r"^[ \t]*# BEGIN SOLUTION Task (?P<task>(?:\d+|C)\.\d+)[ \t]*\n(?P<body>.*?)^[ \t]*# END SOLUTION",
                    re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Match:
    task: str
    where: str  # the function it matched: module.qualname, or chapter file: function name
    ratio: float


class _SelfAttributesAsNames(ast.NodeTransformer):
    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            return ast.copy_location(ast.Name(id=node.attr, ctx=node.ctx), node)
        return node


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    first = body[0] if body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return body[1:]
    return body


def normalised_tokens(statements: list[ast.stmt]) -> list[str]:
    """The statements as tokens of their unparsed source, every name of the code's own (not a builtin's, not an
    attribute's) read as `v`: a copy with its variables renamed, or one more statement at its top, still matches."""
    module = _SelfAttributesAsNames().visit(ast.Module(body=_without_docstring(statements), type_ignores=[]))
    source = ast.unparse(ast.fix_missing_locations(module))
    out: list[str] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        if tok.type == tokenize.NAME and not keyword.iskeyword(tok.string) and tok.string not in BUILTINS and (
                not out or out[-1] != "."):  # an attribute (`.append`) is an API's name: kept
            out.append("v")
        elif tok.type == tokenize.STRING:
            out.append("STR")
        else:
            out.append(tok.string)
    return out


def solution_regions(solutions: Path = ROOT / "exercises" / "solutions") -> list[tuple[str, list[str]]]:
    """[(task id, normalised tokens)] for every marked region of every lab solution."""
    regions = []
    for path in sorted(solutions.glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "code":
                continue
            for found in REGION.finditer(cell.source):
                body = ast.parse(textwrap.dedent(found["body"])).body  # a region may `return`: ast.parse allows it
                regions.append((found["task"], normalised_tokens(body)))
    return regions


def _functions(tree: ast.AST, prefix: str) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.append((f"{prefix}{node.name}.{item.name}", normalised_tokens(item.body)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.append((f"{prefix}{node.name}", normalised_tokens(node.body)))
    return found


def reference_functions() -> list[tuple[str, list[str]]]:
    """[(where, normalised tokens)]: the package's functions and methods, and the functions chapters define."""
    found = []
    for path in sorted((ROOT / "minioffload").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found += _functions(ast.parse(path.read_text()), f"{module}.")
    for path in sorted((ROOT / "book" / "chapters").glob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                try:
                    tree = ast.parse(cell.source)
                except SyntaxError:  # a cell of IPython magics
                    continue
                found += _functions(tree, f"{path.name}: ")
    return found


def closest(regions: list[tuple[str, list[str]]], references: list[tuple[str, list[str]]]) -> list[Match]:
    """For each region long enough to compare, the reference function it is closest to."""
    matches = []
    for task, tokens in regions:
        if len(tokens) < MIN_TOKENS:
            continue
        best = Match(task, "", 0.0)
        for where, ref in references:
            if len(ref) < MIN_TOKENS or not 0.5 <= len(ref) / len(tokens) <= 2:  # ratio <= 2*min/(sum): cannot reach
                continue
            matcher = difflib.SequenceMatcher(None, tokens, ref, autojunk=False)
            if matcher.real_quick_ratio() < best.ratio or matcher.quick_ratio() < best.ratio:
                continue
            ratio = matcher.ratio()
            if ratio > best.ratio:
                best = Match(task, where, ratio)
        matches.append(best)
    return matches


def leaks() -> list[Match]:
    return [m for m in closest(solution_regions(), reference_functions()) if m.ratio >= THRESHOLD]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="print every region's closest function, not only leaks")
    args = parser.parse_args()
    matches = closest(solution_regions(), reference_functions())
    shown = matches if args.all else [m for m in matches if m.ratio >= THRESHOLD]
    for m in sorted(shown, key=lambda m: -m.ratio):
        print(f"Task {m.task:>5}  {m.ratio:.2f}  {m.where}")
    leaked = sum(m.ratio >= THRESHOLD for m in matches)
    print(f"{leaked} of {len(matches)} regions compared match a function at ratio >= {THRESHOLD}")
    return 1 if leaked else 0


if __name__ == "__main__":
    sys.exit(main())
