"""The guides stay true to the CLI: every ``flowrl ...`` command in a code block of README.md and
docs/*.md (also ``torchrun ... -m flowrl ...`` and ``python -m flowrl ...``) parses with flowrl's own
argument parser: the subcommand exists and takes every flag and value written. Commands that need
hardware or files the docs only name (a GPU, a model directory, a cluster) are not run; parsing
them catches a renamed or removed flag, the most common way a guide goes stale."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from flowrl.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands(page: Path) -> list[tuple[int, str]]:
    """(line number, command) of every flowrl command in the page's code blocks, continuations joined."""
    out, fence, lang, pending, start = [], False, "", "", 0
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence, lang = not fence, line[3:].strip()
            continue
        if not fence or lang not in ("", "sh", "bash", "console", "shell"):
            continue
        text = line.split(" # ")[0].strip() if not line.lstrip().startswith("#") else ""
        if pending:
            text, start = pending + " " + text, start
        else:
            start = n
        if text.endswith("\\"):
            pending = text[:-1].strip()
            continue
        pending = ""
        for part in re.split(r"\s(?:&&|\|\||;)\s", text):
            part = re.sub(r"<[^>]*>", "X", part.strip())  # <placeholders>
            part = re.sub(r"^(?:[A-Z_]+=\S*\s+)+", "", part)  # VAR=value prefixes
            m = re.match(r"(?:flowrl|python -m flowrl|torchrun\s.*?-m flowrl)\s(.*)$", part)
            if m:
                out.append((start, m.group(1).strip()))
            elif re.fullmatch(r"flowrl", part.strip()):
                out.append((start, ""))
    return out


CASES = [(f"{p.relative_to(ROOT)}:{n}", c) for p in PAGES for n, c in _commands(p)]


def test_the_docs_hold_flowrl_commands():
    assert len(CASES) >= 30, CASES  # the extraction works: the guides are full of commands
    assert any(w.startswith("README.md") for w, _ in CASES)


@pytest.mark.parametrize(("where", "command"), CASES, ids=[w for w, _ in CASES])
def test_every_flowrl_command_in_the_docs_parses(where, command, capsys):
    argv = shlex.split(command)
    argv = [a for a in argv if a not in ("|", ">")]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        err = capsys.readouterr().err
        if exc.code == 0:  # --help / --version
            return
        pytest.fail(f"{where}: `flowrl {command}` does not parse: {err.strip()}")
    assert argv == [] or getattr(args, "command", None), f"{where}: `flowrl {command}` names no subcommand"
