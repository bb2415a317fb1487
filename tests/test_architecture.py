"""ARCHITECTURE.md is a map a newcomer reads, and it, with docs/extending.md, points at tests that exist.

ARCHITECTURE.md holds at most :data:`MAX_LINES` lines of at most :data:`MAX_WIDTH` characters: the reasoning
behind a part goes in its module's docstring, the steps to extend flowrl in docs/extending.md. In both
pages every ``tests/...py`` named is a file, every ``tests/...py::test_name`` a test function in that file,
every other backticked ``test_name`` a test function somewhere under ``tests/``, every backticked file
one of the tree's; and each row of ARCHITECTURE.md's extension table names a test that adds that thing.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAP = (ROOT / "ARCHITECTURE.md").read_text()
#: The map and the page its extension table points to, whose pointers are checked alike.
TEXT = MAP + "\n" + (ROOT / "docs" / "extending.md").read_text()
#: How long the map may grow: read in ten minutes, on a screen without wrapping.
MAX_LINES = 250
MAX_WIDTH = 110
#: ``tests/a/b.py`` with an optional ``::test_name`` (or ``::Class::test_name``).
FILE_REF = re.compile(r"(tests/[\w/]+\.py)((?:::\w+)*)")
#: A test named on its own, in backticks: ``test_name``.
NAME_REF = re.compile(r"`(test_\w+)`")


@cache
def _tests_in(path: Path) -> frozenset[str]:
    """Every function and class defined in ``path``, at any depth (test methods and classes included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))


@cache
def _every_test_name() -> frozenset[str]:
    return frozenset(name for p in (ROOT / "tests").rglob("*.py") for name in _tests_in(p) if name.startswith("test_"))


def _file_refs() -> list[tuple[str, tuple[str, ...]]]:
    return sorted({(path, tuple(filter(None, names.split("::")))) for path, names in FILE_REF.findall(TEXT)})


def _extension_rows() -> list[str]:
    section = MAP[MAP.index("## Extension points"):]
    return [line for line in section.splitlines() if re.match(r"\| an? \*\*", line)]


def test_the_architecture_is_a_short_map() -> None:
    lines = MAP.splitlines()
    wide = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > MAX_WIDTH]
    assert len(lines) <= MAX_LINES, f"ARCHITECTURE.md has {len(lines)} lines (at most {MAX_LINES}): move the reasoning into module docstrings"
    assert not wide, f"ARCHITECTURE.md's lines (number, width) wider than {MAX_WIDTH} characters: {wide}"


def test_the_architecture_names_tests():
    assert len(_file_refs()) >= 20 and len(set(NAME_REF.findall(TEXT))) >= 5  # the patterns find them
    assert len(_extension_rows()) >= 8


@pytest.mark.parametrize(("path", "names"), _file_refs(), ids=["::".join((p, *n)) for p, n in _file_refs()])
def test_every_test_file_and_function_it_names_exists(path, names):
    file = ROOT / path
    assert file.is_file(), f"ARCHITECTURE.md or docs/extending.md names {path}, which does not exist"
    missing = [n for n in names if n not in _tests_in(file)]
    assert not missing, f"ARCHITECTURE.md or docs/extending.md names {path}::{'::'.join(names)}, but {path} defines no {missing}"


def test_every_test_it_names_by_itself_exists():
    missing = sorted(set(NAME_REF.findall(TEXT)) - _every_test_name())
    assert not missing, f"ARCHITECTURE.md or docs/extending.md names tests no file under tests/ defines: {missing}"


def _row_name(row: str) -> str:
    """An extension row's thing, its bold cell (``a **backend**`` -> ``backend``)."""
    bold = re.search(r"\*\*(.+?)\*\*", row)
    return bold.group(1) if bold else row[:40]


@pytest.mark.parametrize("row", _extension_rows(), ids=_row_name)
def test_each_extension_row_names_the_test_that_adds_that_thing(row):
    assert FILE_REF.search(row) or NAME_REF.search(row), f"the extension table's row names no test: {row[:120]}..."


def test_every_file_it_names_exists():
    """A file named in backticks (``x.py``, ``a/b.py``, ``x.md``) is one of the tree's (a path: a file whose
    path ends so); a former name (``it was `a/b.py```) excepted."""
    files = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts]
    named = {m.group(2) for m in re.finditer(r"(was )?`([\w./-]+\.(?:py|md|json|mjs))(?=[`:(])", TEXT) if not m.group(1)}
    assert len(named) > 100  # the pattern finds them
    missing = sorted(n for n in named if not any(f == n or f.endswith("/" + n) for f in files))
    assert not missing, f"ARCHITECTURE.md or docs/extending.md names files the tree does not hold: {missing}"
