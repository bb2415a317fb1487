"""The ``flowrl`` entry point: --version, --help everywhere, ``examples``, and how errors become exit codes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flowrl import __version__
from flowrl.cli.main import SUBCOMMANDS, build_parser, main
from flowrl.errors import GraphError
from flowrl.examples import DEFAULT_EXAMPLE, EXAMPLES


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def _registered() -> list[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return list(sub.choices)


def test_version(capsys) -> None:
    assert _exit_code(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"flowrl {__version__}"


def test_subcommands_in_order() -> None:
    names = _registered()
    assert {"run", "viz", "examples"} <= set(names)
    assert names == [n for n in SUBCOMMANDS if n in names]


def test_help_lists_commands_and_first_steps(capsys) -> None:
    assert _exit_code(["--help"]) == 0
    out = capsys.readouterr().out
    for name in _registered():
        assert name in out
    assert "flowrl viz llamarl --format mermaid" in out


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_every_command_has_help(capsys, command: str) -> None:
    if command not in _registered():
        pytest.skip(f"'flowrl {command}' is not written yet")
    assert _exit_code([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: flowrl {command}")


def test_viz_help_explains_formats_and_graph_forms(capsys) -> None:
    assert _exit_code(["viz", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("{mermaid,dot,json,svg,png,pdf}", "--plan FILE", "a .json graph file", "apt-get install graphviz", "the default"):
        assert text in out


def test_no_command_prints_help_and_exits_2(capsys) -> None:
    assert main([]) == 2
    assert "usage: flowrl" in capsys.readouterr().out


def test_unknown_command_exits_2(capsys) -> None:
    assert _exit_code(["vis"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'vis'" in err and "Traceback" not in err


def test_examples_lists_every_example(capsys) -> None:
    assert main(["examples"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == sorted(EXAMPLES)
    marked = [line.split()[0] for line in lines if "(the default)" in line or "(default)" in line]
    assert marked == [DEFAULT_EXAMPLE]


def test_flowrl_error_is_exit_2_with_every_problem(capsys, tmp_path) -> None:
    import json

    from flowrl.examples import build_example
    from flowrl.graph.serialize import to_json

    data = json.loads(to_json(build_example("llamarl")))
    data["weight_edges"][0].update(transport="pig eon", max_staleness=-1)
    (tmp_path / "g.json").write_text(json.dumps(data))
    assert main(["viz", str(tmp_path / "g.json")]) == 2
    err = capsys.readouterr().err
    first, *rest = err.rstrip("\n").split("\n  also: ")
    assert first.startswith("flowrl viz: error: ") and "transport 'pig eon', which is not a transport name" in first.replace("\n  ", " ")
    assert rest == ["weight edge policy ~> gen has max_staleness=-1; it must be >= 0 (0 is synchronous on-policy training)"]


def test_a_bug_keeps_its_traceback(monkeypatch) -> None:
    import flowrl.cli.graphs as load

    def broken(text):
        raise RuntimeError("a flowrl bug")

    monkeypatch.setattr(load, "load_graph", broken)
    with pytest.raises(RuntimeError, match="a flowrl bug"):
        main(["viz"])


def test_graph_error_message_is_one_paragraph(capsys, monkeypatch) -> None:
    import flowrl.cli.graphs as load

    def refuse(text):
        raise GraphError("word " * 60)

    monkeypatch.setattr(load, "load_graph", refuse)
    assert main(["viz"]) == 2
    lines = capsys.readouterr().err.rstrip("\n").splitlines()
    assert len(lines) > 1 and all(len(line) <= 100 for line in lines)
    assert all(line.startswith("  ") for line in lines[1:])


def test_python_dash_m_flowrl() -> None:
    done = subprocess.run([sys.executable, "-m", "flowrl", "--version"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and done.stdout.strip() == f"flowrl {__version__}"


@pytest.mark.parametrize(
    "argv",
    [["plan", "llamarl"], ["viz", "llamarl"], ["examples"], ["viz", "llamarl", "--format", "json"]],
    ids=["plan", "viz", "examples", "viz-json"],
)
def test_closed_stdout_ends_quietly(argv):
    """`flowrl plan | head -1`: the reader is gone before flowrl writes; no traceback on stderr."""
    import os

    read, write = os.pipe()
    os.close(read)  # no reader at all: the first write fails with EPIPE, deterministically
    try:
        done = subprocess.run([sys.executable, "-m", "flowrl", *argv], stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == 141


def test_run_choices_are_the_capability_tables_keys() -> None:
    """``flowrl run --engine`` offers the engines of ``graph.engines.ENGINE_CAPS``, ``--backend`` the registered backends."""
    from flowrl.graph.engines import ENGINE_CAPS
    from flowrl.runtime.backends.backend import backend_names

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    run = {a.dest: a for a in sub.choices["run"]._actions}
    assert tuple(run["engine"].choices) == tuple(ENGINE_CAPS)
    assert list(run["backend"].choices) == backend_names()
