"""The guides stay true to the CLI: every command in a code block of README.md and docs/*.md runs,
or is marked as needing what this machine lacks.

- Every ``flowrl ...`` command (also ``torchrun ... -m flowrl ...`` and ``python -m flowrl ...``)
  parses with flowrl's own argument parser: the subcommand exists and takes every flag and value.
- The cheap ones (``viz``, ``examples``, ``plan``, ``--help``) run in the default suite, in a fresh
  directory, after the commands of their page that write the files they read.
- The rest of each page runs in order in one directory behind ``--runslow`` (``run`` with
  ``--steps 2``: the tiny setting), shell lines (``echo``, ``torchrun``, ``python -m``, ``bash``: an
  emitted launch script) included.
- A command that needs hardware or files of the reader's says so visibly, ``[needs: GPU]``,
  ``[needs: several hosts]``, ``[needs: your model directory]``, in its own comment or in the
  comment lines just above it (then for every command up to the next blank line); it is skipped
  with that reason. Install steps (``pip``), the test suite itself and the benches (run by
  ``tests/test_benches.py``) are not run here.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

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


# -- running them ---------------------------------------------------------------------------------
FLOWRL = re.compile(r"(?:flowrl|python -m flowrl|torchrun\s.*?-m flowrl)\s+(.*)$")
NEEDS = re.compile(r"\[needs: ([^\]]+)\]")
#: Subcommands cheap enough for the default suite (each well under a second in this process).
QUICK = ("viz", "examples", "plan")
#: Lines that are not run here, and why.
NOT_RUN = {
    "pip ": "an install step",
    "python -m pytest": "the test suite itself",
    "python benches/": "a bench: tests/test_benches.py runs the benches",
}


class Command(NamedTuple):
    where: str  # page:line
    shell: str  # the line as a shell runs it: continuations joined, comments and placeholders kept out
    needs: str  # what a [needs: ...] marker says it needs, else ""

    @property
    def argv(self) -> list[str] | None:
        """flowrl's own arguments, when this is a flowrl command."""
        m = FLOWRL.match(re.sub(r"^(?:[A-Z_]+=\S*\s+)+", "", self.shell))
        return shlex.split(m.group(1)) if m else None

    @property
    def quick(self) -> bool:
        argv = self.argv
        return argv is not None and (bool(argv) and argv[0] in QUICK or "--help" in argv) and not self.shell.startswith("torchrun")


def _page_commands(page: Path) -> list[Command]:
    """Every shell command in the page's code blocks, in order, each with its [needs: ...] marker."""
    out, fence, lang, pending, start, above = [], False, "", "", 0, ""
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("```"):
            fence, lang, above = not fence, line[3:].strip(), ""
            continue
        if not fence or lang not in ("", "sh", "bash", "console", "shell"):
            continue
        if not line.strip():
            above = ""
            continue
        if line.lstrip().startswith("#"):
            above += line
            continue
        text, _, comment = line.partition(" # ")
        text = text.strip()
        start = start if pending else n
        if text.endswith("\\"):
            pending += text[:-1].strip() + " "
            above += comment
            continue
        text, pending = pending + text, ""
        needs = NEEDS.search(comment) or NEEDS.search(above)
        for part in re.split(r"\s&&\s", text):
            first = re.sub(r"^(?:[A-Z_]+=\S*\s+)+", "", re.sub(r"<[^>]*>", "X", part)).split(" ", 1)[0]  # <placeholders>
            if first in ("flowrl", "torchrun", "python", "pip", "echo", "bash"):
                out.append(Command(f"{page.relative_to(ROOT)}:{start}", part.strip(), needs.group(1) if needs else ""))
    return out


COMMANDS = {p.relative_to(ROOT).as_posix(): _page_commands(p) for p in PAGES}


def _why_not_here(cmd: Command) -> str:
    """Why ``cmd`` cannot run on this machine ('' when it can)."""
    if cmd.needs:
        return f"needs {cmd.needs}"
    for prefix, why in NOT_RUN.items():
        if cmd.shell.startswith(prefix):
            return why
    if re.search(r"-o \S+\.(svg|png)\b", cmd.shell) and cmd.argv and cmd.argv[0] == "viz" and not shutil.which("dot"):
        return "Graphviz's dot is not installed (apt-get install graphviz)"
    return ""


def _writes(cmd: Command) -> set[str]:
    argv = cmd.argv or []
    return {argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-o", "--output")}


def _reads(cmd: Command) -> set[str]:
    return {a for a in (cmd.argv or []) if re.fullmatch(r"[\w.-]+\.(json|jsonl)", a)} - _writes(cmd)


QUICK_CASES = [(page, i) for page, cmds in COMMANDS.items() for i, c in enumerate(cmds) if c.quick]


def test_every_page_with_commands_has_some_that_run_and_markers_are_seen():
    assert len(QUICK_CASES) >= 5, QUICK_CASES
    marked = [c for cmds in COMMANDS.values() for c in cmds if c.needs]
    assert any("several hosts" in c.needs for c in marked), marked  # the 2-host torchrun line


@pytest.mark.parametrize(("page", "index"), QUICK_CASES, ids=[COMMANDS[p][i].where for p, i in QUICK_CASES])
def test_the_cheap_commands_in_the_docs_run(page, index, tmp_path, monkeypatch, capsys):
    """Run in this process (flowrl's ``main``), in a fresh directory, after the earlier commands of the
    page that write a file it reads (``flowrl plan ... -o plan.json`` before ``viz --plan plan.json``)."""
    from flowrl.cli.main import main

    cmds = COMMANDS[page]
    cmd = cmds[index]
    why = _why_not_here(cmd)
    if why:
        pytest.skip(f"{cmd.where}: {why}")
    monkeypatch.chdir(tmp_path)
    needed = _reads(cmd)
    for earlier in cmds[:index]:
        if earlier.quick and _writes(earlier) & needed:
            assert main(earlier.argv) == 0, f"{earlier.where}: `{earlier.shell}` failed: {capsys.readouterr().err}"
    assert not [f for f in needed if not (tmp_path / f).exists()], f"{cmd.where}: `{cmd.shell}` reads a file no earlier quick command of its page writes"
    try:
        code = main(cmd.argv)
    except SystemExit as exc:  # --help
        code = exc.code
    err = capsys.readouterr().err
    assert code == 0, f"{cmd.where}: `{cmd.shell}` exited {code}: {err.strip()[-2000:]}"
    for written in _writes(cmd):
        assert (tmp_path / written).stat().st_size > 0, f"{cmd.where}: `{cmd.shell}` wrote no {written}"


def _tiny(shell: str) -> str:
    """A training command at tiny settings: 2 steps, an evaluation every step."""
    if not re.search(r"(?:^|\s)(?:flowrl|-m flowrl) run\b", shell):
        return shell
    shell = re.sub(r"--steps \d+", "--steps 2", shell) if "--steps" in shell else shell + " --steps 2"
    return re.sub(r"--(eval|checkpoint)-every \d+", r"--\1-every 1", shell)


#: Files the docs leave to the reader that a page's commands read, made here from flowrl's own.
def _reader_files(directory: Path) -> None:
    from flowrl.examples.hf_copy import ASSETS

    shutil.copy(ASSETS / "prompts.jsonl", directory / "held.jsonl")  # held-out prompts for hf_copy's --eval-data


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p, cmds in COMMANDS.items() if any(not c.quick for c in cmds)])
def test_every_other_command_of_a_page_runs_in_order(page, tmp_path):
    """Each page's training and shell commands, in order, in one directory (``run`` at ``--steps 2``)."""
    _reader_files(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    ran, skipped = 0, []
    for cmd in COMMANDS[page]:
        why = _why_not_here(cmd)
        if why:
            skipped.append(f"{cmd.where} ({why})")
            continue
        shell = re.sub(r"(?<![\w.])/tmp(?=[/\s]|$)", str(tmp_path), _tiny(cmd.shell))  # what a page writes to /tmp stays in this test's directory
        done = subprocess.run(["bash", "-c", shell], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{cmd.where}: `{shell}` exited {done.returncode}: {(done.stdout + done.stderr)[-3000:]}"
        ran += 1
    if not ran:
        pytest.skip(f"nothing on {page} runs here: {skipped}")
