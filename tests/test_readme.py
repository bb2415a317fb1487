"""The README and the guides in docs/ stay true: the Python example runs, the Layout names the
packages there are, the Benchmarks list names every script in ``benches/``, the README stays short
and points at every guide, and the guides' links resolve."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
GUIDES = sorted((ROOT / "docs").glob("*.md"))
#: The README and every guide, as one text to find a section in (each guide's headings one level up).
DOCS = README + "".join("\n" + re.sub(r"^#", "##", g.read_text(), flags=re.M) for g in GUIDES)


def _section(title: str) -> str:
    start = DOCS.index(title)
    rest = DOCS[start + len(title):]
    end = re.search(r"\n#{2,4} ", rest)
    return rest[: end.start()] if end else rest


def _code_blocks(text: str, lang: str = "") -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_the_python_example_runs_and_prints_what_its_comments_say():
    (block,) = _code_blocks(_section("#### From Python"), "python")
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


def _trl_rows() -> list[tuple[str, str, str]]:
    """The "Coming from TRL" table's rows: (TRL options, flowrl, notes)."""
    rows = [line.split(" | ") for line in _section("## Coming from TRL\n").splitlines() if line.startswith("| ") and not line.startswith("| TRL")]
    return [(r[0].removeprefix("| "), r[1], r[2].removesuffix(" |").removesuffix("|")) for r in rows if len(r) == 3]


def test_the_trl_table_names_options_that_exist():
    """Each ``name`` before ``on `b.method``` is a keyword the method takes (its config's field or its own
    parameter), each key of ``lora=dict(...)`` a ``LoraConfig`` field, each ``--flag`` one of the CLI's, and
    every row flowrl lacks says why."""
    import inspect

    from flowrl.graph.builder import GraphBuilder
    from flowrl.graph.configs import LoraConfig
    from flowrl.graph.option_names import option_fields

    cli = "".join(p.read_text() for p in (ROOT / "flowrl" / "cli").glob("*.py"))
    checked = 0
    for trl, flowrl, _notes in _trl_rows():
        if "not supported" in flowrl:
            assert "because" in flowrl, f"{trl}: 'not supported' says why"
        for flag in re.findall(r"(--[a-z][a-z-]+)", flowrl):
            assert f'"{flag}"' in cli, f"{trl}: {flag} is no flowrl CLI flag"
            checked += 1
        options = flowrl
        while re.search(r"\([^()]*\)", options):  # parentheticals hold values and asides, not options
            options = re.sub(r"\([^()]*\)", "", options)
        for part in options.split(";"):
            for before, method in re.findall(r"(.*?)on `b\.(\w+)`", part):
                takes = set(inspect.signature(getattr(GraphBuilder, method)).parameters)
                takes |= set(option_fields(method))
                for name in re.findall(r"`(\w+)(?:=[^`]*)?`", before):
                    assert name in takes, f"{trl}: b.{method}(...) takes no {name!r}"
                    checked += 1
        for keys in re.findall(r"`lora=dict\(([^)]*)\)`", flowrl):
            for key in re.findall(r"(\w+)=", keys):
                assert key in LoraConfig.__struct_fields__, f"{trl}: LoraConfig has no {key!r}"
    assert checked > 40


def test_the_trl_table_lists_every_trl_option_flowrl_knows():
    from flowrl.graph.option_names import TRL_OPTIONS

    listed = {name for trl, _, _ in _trl_rows() for name in re.findall(r"`(\w+)", trl)}
    missing = sorted(set(TRL_OPTIONS) - listed - {"lora_dropout"})  # peft's name: in the peft_config row's notes
    assert not missing, f"TRL options flowrl maps (graph/option_names.py) missing from the README's table: {missing}"


def test_the_readme_is_a_short_map_and_links_every_guide():
    lines = README.count("\n")
    assert lines < 250, f"README.md has {lines} lines: a guide's material goes in docs/"
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", README))
    assert linked == {g.name for g in GUIDES}, f"guides not linked from the README: {sorted({g.name for g in GUIDES} - linked)}"


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for page in [ROOT / "README.md", *GUIDES]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
