"""The README stays true: its Python example runs, its Layout names the packages there are, and its
Benchmarks list names every script in ``benches/``."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(title)
    rest = README[start + len(title):]
    end = re.search(r"\n#{2,3} ", rest)
    return rest[: end.start()] if end else rest


def _code_blocks(text: str, lang: str = "") -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_the_python_example_runs_and_prints_what_its_comments_say():
    (block,) = _code_blocks(_section("### From Python"), "python")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "README.md:From Python", "exec"), {"__name__": "readme"})
    first = out.getvalue().splitlines()[0]
    assert first == "20 20", out.getvalue()  # 20 metrics rows, policy version 20


def test_the_layout_lists_every_package_and_only_packages_that_exist():
    (layout,) = _code_blocks(_section("## Layout"))
    listed = set(re.findall(r"^flowrl/(\w+)/", layout, flags=re.M))
    present = {p.parent.name for p in (ROOT / "flowrl").glob("*/__init__.py")}
    assert listed == present, f"README Layout lists {sorted(listed - present)} not in the tree, misses {sorted(present - listed)}"


def test_the_benchmarks_list_names_every_bench_script():
    (commands,) = _code_blocks(_section("## Benchmarks"))
    listed = set(re.findall(r"python benches/(\w+\.py)", commands))
    # a script another one runs (generation.py --longtail runs longtail_generation.py) counts as listed
    runs = {m for p in (ROOT / "benches").glob("*.py") for m in re.findall(r"^\s*import (\w+)$", p.read_text(), flags=re.M)}
    present = {p.name for p in (ROOT / "benches").glob("*.py") if not p.name.startswith("_") and p.stem not in runs}
    assert listed == present, f"benches not in the README: {sorted(present - listed)}; listed but absent: {sorted(listed - present)}"
