"""``flowrl viz``: every format of every example, files written atomically, plans as labels, and every user mistake."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from flowrl.cli.main import main
from flowrl.examples import build_example
from flowrl.pictures import to_dot, to_mermaid
from flowrl.graph.serialize import from_json, to_json

REPO = Path(__file__).resolve().parents[2]


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["viz", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _user_error(capsys, *argv: str) -> str:
    """Run ``flowrl viz argv``; assert exit 2 with a one-paragraph message and no traceback; return it unwrapped."""
    try:
        code = main(["viz", *argv])
    except SystemExit as exc:  # argparse's own usage errors
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2, f"exit {code}; stderr: {err}"
    assert out == ""
    assert "Traceback" not in err
    assert err.strip() and "\n\n" not in err.strip()
    assert err.startswith("flowrl viz: error: ") or err.startswith("usage: flowrl viz"), err
    return " ".join(err.split())  # main wraps the paragraph at 100 columns


def _needs_dot() -> None:
    if shutil.which("dot") is None:
        pytest.skip("Graphviz 'dot' is not installed (apt-get install graphviz): svg/png through the CLI not checked")


# -- what a user gets -----------------------------------------------------------------------------
def test_default_is_mermaid_of_the_default_example(capsys) -> None:
    code, out, err = _run(capsys)
    assert code == 0 and err == ""
    assert out == to_mermaid(build_example("llamarl"))


@pytest.mark.parametrize("fmt", ["mermaid", "dot", "json"])
def test_text_formats_to_stdout(capsys, example_name: str, example_graph, fmt: str) -> None:
    code, out, _ = _run(capsys, example_name, "--format", fmt)
    assert code == 0
    if fmt == "json":
        assert from_json(out) == example_graph
    else:
        assert out == (to_mermaid if fmt == "mermaid" else to_dot)(example_graph)


@pytest.mark.parametrize("fmt", ["svg", "png", "pdf"])
def test_images_to_files(capsys, tmp_path, example_name: str, fmt: str) -> None:
    _needs_dot()
    target = tmp_path / f"out.{fmt}"
    code, out, err = _run(capsys, example_name, "-f", fmt, "-o", str(target))
    assert code == 0 and out == ""
    assert f"wrote {target} ({fmt}," in err
    data = target.read_bytes()
    assert {"png": data.startswith(b"\x89PNG"), "pdf": data.startswith(b"%PDF"), "svg": b"</svg>" in data}[fmt]
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_image_without_output_goes_to_graph_name(capsys, tmp_path, monkeypatch) -> None:
    _needs_dot()
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(capsys, "llamarl_ref", "--format", "svg")
    assert code == 0 and "wrote llamarl_ref.svg" in err
    assert b"</svg>" in (tmp_path / "llamarl_ref.svg").read_bytes()


def test_default_name_is_safe_for_any_graph_name(capsys, tmp_path, monkeypatch) -> None:
    _needs_dot()
    monkeypatch.chdir(tmp_path)
    text = to_json(build_example("llamarl")).replace('"name": "llamarl"', '"name": "../../evil name"')
    (tmp_path / "g.json").write_text(text)
    assert _run(capsys, "g.json", "-f", "png")[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_.._evil_name.png", "g.json"]  # no folder part, no leading dot


@pytest.mark.parametrize(("suffix", "check"), [(".svg", b"</svg>"), (".dot", b"digraph"), (".mmd", b"flowchart LR"), (".json", b'"nodes"')])
def test_format_from_output_suffix(capsys, tmp_path, suffix: str, check: bytes) -> None:
    if suffix == ".svg":
        _needs_dot()
    target = tmp_path / f"g{suffix}"
    assert _run(capsys, "two_scorers", "-o", str(target))[0] == 0
    assert check in target.read_bytes()


def test_output_dash_is_stdout_even_for_png(capsysbinary) -> None:
    _needs_dot()
    assert main(["viz", "-f", "png", "-o", "-"]) == 0
    assert capsysbinary.readouterr().out.startswith(b"\x89PNG")


def test_output_replaces_a_file_whole(capsys, tmp_path) -> None:
    target = tmp_path / "g.dot"
    target.write_text("x" * 100_000)
    assert _run(capsys, "llamarl", "-o", str(target))[0] == 0
    assert target.read_text() == to_dot(build_example("llamarl"))


def test_json_round_trips_through_the_cli(capsys, tmp_path) -> None:
    target = tmp_path / "g.json"
    assert _run(capsys, "two_scorers", "-f", "json", "-o", str(target))[0] == 0
    code, out, _ = _run(capsys, str(target), "-f", "mermaid")
    assert code == 0 and out == to_mermaid(build_example("two_scorers"))


def test_direction(capsys) -> None:
    assert "rankdir=TB" in _run(capsys, "-f", "dot", "--direction", "TB")[1]


def test_py_and_reference_forms(capsys, tmp_path) -> None:
    script = tmp_path / "mine.py"
    script.write_text("from flowrl.examples import build_example\ngraph = build_example('llamarl_ref')\n")
    assert _run(capsys, str(script), "-f", "dot")[1] == to_dot(build_example("llamarl_ref"))
    assert _run(capsys, "flowrl.examples.llamarl:build_two_scorers", "-f", "dot")[1] == to_dot(build_example("two_scorers"))


# -- plans as labels ------------------------------------------------------------------------------
class _FakePlan:
    def __init__(self, placements: dict[str, tuple[int, ...]]) -> None:
        self.placements = placements

    def node_label(self, name: str) -> str:
        devices = self.placements[name]
        return f"devices {devices[0]}-{devices[-1]} · dp{len(devices)}"

    def node_model(self, name: str) -> str:
        return ""

    def picture_title(self) -> str:
        return "llamarl"


@pytest.fixture
def fake_planner(monkeypatch, tmp_path):
    """A stand-in ``flowrl.planners.plan`` whose ``load_plan`` reads ``{node: [devices]}`` JSON."""
    import flowrl.planners  # noqa: F401 - the real package first, so only its plan module is replaced

    module = types.ModuleType("flowrl.planners.plan")

    def load_plan(path):
        return _FakePlan({k: tuple(v) for k, v in json.loads(Path(path).read_text()).items()})

    module.load_plan = load_plan  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flowrl.planners.plan", module)

    def write(placements: dict[str, list[int]]) -> str:
        path = tmp_path / "plan.json"
        path.write_text(json.dumps(placements))
        return str(path)

    return write


def test_plan_labels_each_node(capsys, fake_planner) -> None:
    plan = fake_planner({"gen": [0, 1, 2, 3], "aipo": [4, 5], "policy": [4, 5]})
    code, out, _ = _run(capsys, "llamarl", "--plan", plan)
    assert code == 0
    annotations = {"gen": "devices 0-3 · dp4", "aipo": "devices 4-5 · dp2", "policy": "devices 4-5 · dp2"}
    assert out == to_mermaid(build_example("llamarl"), annotations=annotations)
    from flowrl.graph.nodes import describe

    gen = build_example("llamarl").node("gen")
    assert f'gen("gen (generator)<br/>{describe(gen)}<br/>devices 0-3 · dp4")' in out


def test_plan_labels_in_svg(capsys, tmp_path, fake_planner) -> None:
    _needs_dot()
    plan = fake_planner({"gen": [0, 1], "policy": [2, 3]})
    target = tmp_path / "p.svg"
    assert _run(capsys, "--plan", plan, "-o", str(target))[0] == 0
    assert "dp2" in target.read_text()


def test_plan_for_another_graph(capsys, fake_planner) -> None:
    plan = fake_planner({"generator_0": [0], "policy": [1]})
    err = _user_error(capsys, "llamarl", "--plan", plan)
    assert "node(s) ['generator_0'] that graph 'llamarl' does not have" in err


def test_plan_with_json_format(capsys, fake_planner) -> None:
    err = _user_error(capsys, "-f", "json", "--plan", fake_planner({"gen": [0]}))
    assert "--format json writes the graph itself" in err


def test_plan_without_planner_installed(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flowrl.planners.plan", None)  # import fails as if not written yet
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    err = _user_error(capsys, "--plan", str(plan))
    assert "--plan needs the planner (flowrl.planners.plan.load_plan)" in err and "drop --plan" in err


def test_real_planner_plan(capsys, tmp_path) -> None:
    plan_mod = pytest.importorskip("flowrl.planners.plan", reason="the planner (flowrl.planners.plan) is not written yet")
    cluster = pytest.importorskip("flowrl.planners.cluster")
    graph = build_example("llamarl")
    plan = plan_mod.plan_graph(graph, cluster.parse_cluster("cpu"))
    path = tmp_path / "plan.json"
    plan_mod.save_plan(plan, path)
    code, out, _ = _run(capsys, "llamarl", "--plan", str(path))
    assert code == 0
    for name in plan.placements:
        assert plan.node_label(name).split()[0] in out


@pytest.mark.parametrize("fmt", ["mermaid", "dot"])
def test_plan_picture_names_the_planned_model_and_cluster(capsys, tmp_path, fmt) -> None:
    """A plan made with --model labels nodes with that model, not the graph's built-in one, and says cluster and model in the title."""
    path = tmp_path / "plan.json"
    assert main(["plan", "llamarl", "--cluster", "64xH100", "--model", "llama3-8b", "-o", str(path)]) == 0
    capsys.readouterr()
    code, out, _ = _run(capsys, "llamarl", "--plan", str(path), "-f", fmt)
    assert code == 0
    assert "model=2L64d" not in out
    assert out.count("model=llama3-8b") == 2  # the generator and the policy
    title = out.split("title: ", 1)[1].split("\n", 1)[0] if fmt == "mermaid" else out.split("label=", 1)[1].split(", labelloc", 1)[0]
    assert title.startswith('"\'llamarl\' on 64xH100 (8 hosts x 8 H100), model llama3-8b: ')
    # the times are another model's and another step's than the nodes show: the title says whose
    assert "; times for model llama3-8b, 256 prompts x 8 samples of 512+2048 tokens (not the graph's own: model 2L64d, 16 prompts x 16 samples of up to 5 new tokens)" in title


def test_plan_picture_of_the_graphs_own_step_says_so(capsys, tmp_path) -> None:
    path = tmp_path / "plan.json"
    assert main(["plan", "llamarl", "--cluster", "cpu:2", "-o", str(path)]) == 0
    capsys.readouterr()
    code, out, _ = _run(capsys, "llamarl", "--plan", str(path))
    title = out.split("title: ", 1)[1].split("\n", 1)[0]
    assert code == 0 and "; times for model 2L64d, 16 prompts x 16 samples of " in title and title.endswith(' tokens (the graph\'s own)"')


# -- every user mistake: exit 2, one paragraph, no traceback --------------------------------------
def test_error_missing_json_file(capsys) -> None:
    assert "graph file 'no/such.json' does not exist" in _user_error(capsys, "no/such.json")


def test_error_bad_json(capsys, tmp_path) -> None:
    (tmp_path / "g.json").write_text("{oops")
    assert "is not valid JSON" in _user_error(capsys, str(tmp_path / "g.json"))


def test_error_bad_graph(capsys, tmp_path) -> None:
    data = json.loads(to_json(build_example("llamarl")))
    data["weight_edges"] = []
    (tmp_path / "g.json").write_text(json.dumps(data))
    assert "generator 'gen' receives no weights" in _user_error(capsys, str(tmp_path / "g.json"))


def test_error_schema_mismatch(capsys, tmp_path) -> None:
    (tmp_path / "g.json").write_text('{"name": "x", "nodes": [{"kind": "actor", "name": "c"}]}')
    assert "does not match the flowrl schema" in _user_error(capsys, str(tmp_path / "g.json"))


def test_error_unknown_format(capsys) -> None:
    assert "invalid choice: 'jpeg'" in _user_error(capsys, "llamarl", "--format", "jpeg")


def test_error_unknown_example(capsys) -> None:
    assert "cannot find graph 'two_scorer'. Did you mean the example 'two_scorers'?" in _user_error(capsys, "two_scorer")


def test_error_script_that_raises(capsys, tmp_path) -> None:
    (tmp_path / "p.py").write_text("raise ValueError('my bug')\n")
    assert "raised ValueError: my bug" in _user_error(capsys, str(tmp_path / "p.py"))


def test_error_output_folder_missing(capsys, tmp_path) -> None:
    assert "folder" in _user_error(capsys, "-o", str(tmp_path / "nope" / "g.mmd"))
    assert list(tmp_path.iterdir()) == []


def test_error_output_suffix_contradicts_format(capsys, tmp_path) -> None:
    err = _user_error(capsys, "-f", "dot", "-o", str(tmp_path / "g.svg"))
    assert "has the suffix of format svg but --format is dot" in err
    assert list(tmp_path.iterdir()) == []


def test_pdf_suffix_picks_pdf(capsys, tmp_path) -> None:
    """`-o pipeline.pdf` draws a PDF through Graphviz (or says Graphviz is missing); never Mermaid text."""
    target = tmp_path / "pipeline.pdf"
    code, _, err = _run(capsys, "llamarl", "-o", str(target))
    if shutil.which("dot") is None:
        assert code == 2 and "drawing pdf needs the Graphviz program" in " ".join(err.split())
        assert not target.exists()
    else:
        assert code == 0 and target.read_bytes().startswith(b"%PDF")


@pytest.mark.parametrize("name", ["g.txt", "g.jpeg", "g.html"], ids=["txt", "jpeg", "html"])
def test_error_unknown_output_suffix(capsys, tmp_path, name: str) -> None:
    err = _user_error(capsys, "llamarl", "-o", str(tmp_path / name))
    assert f"the suffix '{name[1:]}' names no format flowrl writes" in err and ".pdf .png .svg" in err
    assert list(tmp_path.iterdir()) == []


def test_error_plan_file_missing(capsys) -> None:
    assert "--plan nope.json: no such file; make one with: flowrl plan llamarl" in _user_error(capsys, "--plan", "nope.json")


def test_error_graphviz_missing(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    err = _user_error(capsys, "-f", "svg", "-o", str(tmp_path / "g.svg"))
    assert "apt-get" in err and "install graphviz" in err
    assert list(tmp_path.iterdir()) == []


# -- as a user runs it: a real process ------------------------------------------------------------
def _flowrl(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowrl", *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def test_subprocess_user_error_has_no_traceback(tmp_path) -> None:
    done = _flowrl("viz", "missing.json", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("flowrl viz: error: graph file 'missing.json' does not exist")
    assert "Traceback" not in done.stderr


def test_subprocess_json_graph_never_imports_its_scorer(tmp_path) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "flowrl_evil_cli_scorer.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    text = to_json(build_example("llamarl")).replace("flowrl.operators.tasks:copy_reward", "flowrl_evil_cli_scorer:score")
    (tmp_path / "g.json").write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    done = _flowrl("viz", "g.json", "--format", "dot", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert "fn=flowrl_evil_cli_scorer:score" in done.stdout
    assert not marker.exists()
    control = subprocess.run([sys.executable, "-c", "import flowrl_evil_cli_scorer"], cwd=tmp_path, env=env, check=True, timeout=60)
    assert control.returncode == 0 and marker.exists()  # the module does have a side effect on import


def test_a_picture_without_graphviz_names_it_and_its_three_installs_and_so_do_the_guides(tmp_path, monkeypatch, capsys):
    """No 'dot' on PATH: `flowrl viz -o p.svg` fails with a one-line reason (no traceback) naming
    Graphviz and how to install it (apt-get, brew, conda); docs/running.md, README and --help say the same."""
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no 'dot'
    assert main(["viz", "llamarl", "-o", str(tmp_path / "p.svg")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    installs = ("apt-get install graphviz", "brew install graphviz", "conda install graphviz")
    assert "Graphviz" in err and all(i in err for i in installs) and "Traceback" not in err, err
    root = Path(__file__).parents[2]
    for guide in ("docs/running.md", "README.md"):
        text = " ".join((root / guide).read_text(encoding="utf-8").split())
        assert all(f"`{i}`" in text for i in installs), guide
    with pytest.raises(SystemExit):
        main(["viz", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert all(i in usage for i in installs), usage
