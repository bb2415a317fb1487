"""``load_graph``: every form of GRAPH (example, .json, .py, module:attr) and every way each can go wrong."""

from __future__ import annotations

import sys
import textwrap

import pytest

from flowrl.errors import GraphError
from flowrl.examples import build_example
from flowrl.cli.graphs import GRAPH_FORMS, load_graph
from flowrl.graph.serialize import to_json

SCRIPT = """
from flowrl.graph.builder import GraphBuilder

def build_graph():
    b = GraphBuilder("from_script")
    gen = b.generator("gen", b.source("prompts"))
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    policy = b.policy("policy", b.loss("aipo", gen, reward))
    b.weights(policy, gen)
    return b.build()
"""


def test_default_and_examples(example_name: str, example_graph) -> None:
    assert load_graph(example_name) == example_graph
    assert load_graph(None) == build_example("llamarl")


def test_json_file(tmp_path) -> None:
    path = tmp_path / "g.json"
    path.write_text(to_json(build_example("two_scorers")))
    assert load_graph(str(path)) == build_example("two_scorers")


@pytest.mark.parametrize("attr", ["graph = build_graph()", "graph = build_graph"], ids=["graph-object", "graph-function"])
def test_py_file_with_graph(tmp_path, attr: str) -> None:
    path = tmp_path / "pipeline.py"
    path.write_text(SCRIPT + attr + "\n")
    assert load_graph(str(path)).name == "from_script"


def test_py_file_with_build_graph_and_a_sibling_import(tmp_path) -> None:
    (tmp_path / "helpers_for_flowrl_test.py").write_text("NAME = 'from_script'\n")
    path = tmp_path / "pipeline.py"
    path.write_text("import helpers_for_flowrl_test\n" + SCRIPT)
    assert load_graph(str(path)).name == "from_script"
    assert str(tmp_path) not in sys.path  # the script's folder is on sys.path only while it runs
    sys.modules.pop("helpers_for_flowrl_test", None)


def test_module_attr_reference() -> None:
    assert load_graph("flowrl.examples.llamarl:build_two_scorers") == build_example("two_scorers")


@pytest.mark.parametrize(
    ("files", "arg", "match"),
    [
        ({}, "missing.json", r"graph file 'missing.json' does not exist\. GRAPH is one of"),
        ({}, "missing.py", r"graph script 'missing.py' does not exist"),
        ({"g.json": "{not json"}, "g.json", r"g.json: graph file is not valid JSON"),
        ({"g.json": '{"name": "x", "nodes": []}'}, "g.json", r"g.json: invalid graph 'x': graph 'x' has no nodes"),
        ({"g.json": '{"name": "x", "nodes": [{"kind": "actor", "name": "c"}]}'}, "g.json", r"does not match the flowrl schema.*\$\.nodes\[0\]"),
        ({"p.py": "x = 1\n"}, "p.py", r"p.py defines neither `graph` nor `build_graph\(\)`"),
        ({"p.py": "graph = 42\n"}, "p.py", r"p.py:graph is a int, not a flowrl Graph"),
        ({"p.py": "def build_graph(:\n"}, "p.py", r"graph script .*p.py': syntax error at .*p.py, line 1"),
        ({"p.py": "import no_such_module_xyz\n"}, "p.py", r"raised ModuleNotFoundError: No module named 'no_such_module_xyz' \(at .*p.py, line 1\)"),
        ({"p.py": "def build_graph():\n    return 1 / 0\n"}, "p.py", r"calling .*p.py:build_graph\(\) raised ZeroDivisionError: division by zero \(at .*p.py, line 2\)"),
        ({"p.py": SCRIPT.replace("b.weights(policy, gen)", "") + "graph = build_graph()\n"}, "p.py", r"invalid graph 'from_script': generator 'gen' receives no weights"),
        ({"d.json/x": ""}, "d.json", r"graph file 'd.json' is not a file"),
        ({}, "llamrl", r"cannot find graph 'llamrl'\. Did you mean the example 'llamarl'\?"),
        ({}, "no_such_pkg_xyz.mod:graph", r"cannot load 'no_such_pkg_xyz.mod:graph': No module named 'no_such_pkg_xyz'"),
        ({}, "flowrl.examples:nope", r"module 'flowrl.examples' has no attribute 'nope'"),
        ({}, "flowrl.examples:EXAMPLES", r"flowrl.examples:EXAMPLES is a dict, not a flowrl Graph"),
        ({}, "what is this", r"cannot find graph 'what is this'\. GRAPH is one of"),
    ],
    ids=[
        "missing-json", "missing-py", "bad-json", "invalid-graph-json", "unknown-kind", "py-without-graph", "py-graph-not-graph",
        "py-syntax-error", "py-import-error", "py-raises", "py-invalid-graph", "json-is-folder", "typo-example",
        "missing-module", "missing-attr", "attr-not-graph", "nonsense",
    ],
)
def test_load_errors(tmp_path, monkeypatch, files: dict[str, str], arg: str, match: str) -> None:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(GraphError, match=match):
        load_graph(arg)


def test_forms_are_documented() -> None:
    for form in ("built-in example", ".json", ".py", "package.module:attr"):
        assert form in GRAPH_FORMS
