"""Exporters: DOT parsed by pydot, Mermaid and the text form against golden files, labels, escaping, rendering."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings

from flowrl.examples import build_example
from flowrl.pictures import (
    KIND_STYLES,
    ExportError,
    export_text,
    field_summary,
    format_for_path,
    render,
    render_bytes,
    to_dot,
    to_json,
    to_mermaid,
    write_atomic,
)
from flowrl.graph.fields import ROLLOUT_FIELDS
from flowrl.graph.ir import Graph, GraphSpec
from flowrl.graph.nodes import describe
from flowrl.graph.serialize import from_json
from tests.graph.golden import assert_golden
from tests.graph.strategies import valid_graphs

# pydot's parser calls pyparsing names that newer pyparsing deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings(r"ignore:'\w+' deprecated - use")

PLAN_LABELS = {"gen": "devices 0-3 · dp2 tp2", "aipo": "devices 4-7 · dp4", "policy": "devices 4-7 · dp4"}


def _unquote(value: str | None) -> str:
    assert value is not None
    return value[1:-1] if value.startswith('"') and value.endswith('"') else value


# -- golden files ---------------------------------------------------------------------------------
def test_text_form_golden(example_name: str, example_graph: Graph) -> None:
    assert_golden(f"{example_name}.txt", str(example_graph) + "\n")


def test_mermaid_golden(example_name: str, example_graph: Graph) -> None:
    assert_golden(f"{example_name}.mmd", to_mermaid(example_graph))


def test_dot_golden(example_name: str, example_graph: Graph) -> None:
    assert_golden(f"{example_name}.dot", to_dot(example_graph))


def test_annotated_goldens() -> None:
    graph = build_example("llamarl")
    assert_golden("llamarl_plan.mmd", to_mermaid(graph, annotations=PLAN_LABELS))
    assert_golden("llamarl_plan.dot", to_dot(graph, annotations=PLAN_LABELS, direction="TB"))


# -- DOT through a real parser --------------------------------------------------------------------
def _parse_dot(text: str):
    pydot = pytest.importorskip("pydot")
    parsed = pydot.graph_from_dot_data(text)
    assert parsed and len(parsed) == 1, f"pydot could not parse:\n{text}"
    return parsed[0]


def test_dot_structure(example_graph: Graph) -> None:
    dot = _parse_dot(to_dot(example_graph, annotations={"gen": "devices 0-1 · dp2"}))
    nodes = {_unquote(n.get_name()): n for n in dot.get_nodes() if _unquote(n.get_name()) not in ("node", "edge", "graph")}
    assert set(nodes) == {n.name for n in example_graph.nodes}
    for node in example_graph.nodes:
        attrs = nodes[node.name].get_attributes()
        assert attrs["shape"] == KIND_STYLES[node.kind].dot_shape
        assert _unquote(attrs["fillcolor"]) == KIND_STYLES[node.kind].fill
        label = _unquote(attrs["label"]).split("\\n")
        assert label[:2] == [f"{node.name} ({node.kind})", describe(node)]
        assert label[2:] == (["devices 0-1 · dp2"] if node.name == "gen" else [])
    edges = dot.get_edges()
    assert len(edges) == len(example_graph.edges) + len(example_graph.weight_edges)
    dashed = [e for e in edges if e.get_attributes().get("style") == "dashed"]
    assert [(_unquote(e.get_source()), _unquote(e.get_destination())) for e in dashed] == [
        (w.src, w.dst) for w in example_graph.weight_edges
    ]
    for e, w in zip(dashed, example_graph.weight_edges):
        assert _unquote(e.get_attributes()["label"]) == f"{w.transport}\\nk<={w.max_staleness}"
        assert e.get_attributes()["constraint"] == "false"
    solid = [e for e in edges if e not in dashed]
    for e, d in zip(solid, example_graph.edges):
        assert (_unquote(e.get_source()), _unquote(e.get_destination())) == (d.src, d.dst)
        assert _unquote(e.get_attributes()["label"]) == field_summary(d.fields)


@settings(max_examples=15)
@given(valid_graphs())
def test_random_graphs_export_parseable_dot_and_complete_mermaid(graph: Graph) -> None:
    dot = _parse_dot(to_dot(graph))
    names = {_unquote(n.get_name()) for n in dot.get_nodes()} - {"node", "edge", "graph"}
    assert names == {n.name for n in graph.nodes}
    assert len(dot.get_edges()) == len(graph.edges) + len(graph.weight_edges)
    mermaid = to_mermaid(graph).splitlines()
    assert mermaid[3] == "flowchart LR"
    assert sum(" -->|" in line for line in mermaid) == len(graph.edges)
    assert sum(" -.->|" in line for line in mermaid) == len(graph.weight_edges)
    assert to_dot(graph) == to_dot(from_json(to_json(graph)))  # deterministic, from data alone


def _weird_graph() -> Graph:
    """A graph whose names and strings try to break out of quotes (exporters must draw even invalid graphs)."""
    spec = build_example("llamarl").spec
    text = to_json(build_example("llamarl"))
    for old, new in (('"gen"', '"end"'), ('"prompts"', '"pro\\"mpts\\\\N<b>#quot;"'), ('"reward"', '"o x"')):
        text = text.replace(old, new)
    text = text.replace('"name": "llamarl"', '"name": "my \\"graph\\"\\n--- x"')
    graph = from_json(text, validate=False)
    assert len(graph.nodes) == len(spec.nodes)
    return graph


def test_dot_escapes_quotes_and_backslashes() -> None:
    graph = _weird_graph()
    dot = _parse_dot(to_dot(graph))
    names = {n.get_name() for n in dot.get_nodes()}
    assert '"pro\\"mpts\\\\N<b>#quot;"' in names
    assert '"end"' in names and '"o x"' in names


def test_mermaid_escapes_and_renames_reserved_ids() -> None:
    text = to_mermaid(_weird_graph())
    lines = text.splitlines()
    assert lines[1] == 'title: "my \\"graph\\"\\n--- x"'  # one YAML line, JSON-quoted
    node_lines = [line.strip() for line in lines[4:] if "(" in line and "-->" not in line and "-.->" not in line]
    ids = [re.match(r"^([A-Za-z0-9_]+)", line).group(1) for line in node_lines]
    assert "end" not in ids and len(set(ids)) == len(ids)
    assert 'pro#quot;mpts\\N#lt;b#gt;#35;quot;' in text  # no raw quote, tag or entity reaches Mermaid
    assert not re.search(r'"[^"\n]*<b>', text)


def test_mermaid_parses_with_the_real_parser(tmp_path) -> None:
    """Mermaid's own parser accepts every golden file and escaped names; a broken file is refused.

    Needs node and the npm packages mermaid and jsdom:
    ``npm install --prefix /tmp/mm mermaid@11 jsdom`` then ``FLOWRL_MERMAID_NODE_MODULES=/tmp/mm/node_modules``.
    """
    modules = os.environ.get("FLOWRL_MERMAID_NODE_MODULES")
    if not modules or shutil.which("node") is None:
        pytest.skip("Mermaid parser not set up (node + FLOWRL_MERMAID_NODE_MODULES with mermaid and jsdom): Mermaid syntax checked by goldens only")
    (tmp_path / "weird.mmd").write_text(to_mermaid(_weird_graph(), annotations=None))
    (tmp_path / "plan.mmd").write_text(to_mermaid(build_example("two_scorers"), annotations={"gen": 'a "b" <c> & #d;'}))
    files = sorted(str(p) for p in (Path(__file__).parent / "golden").glob("*.mmd")) + [str(tmp_path / "weird.mmd"), str(tmp_path / "plan.mmd")]
    script = str(Path(__file__).parent / "mermaid_parse.mjs")
    done = subprocess.run(["node", script, *files], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    (tmp_path / "broken.mmd").write_text("flowchart LR\n    a -->|x| end\n")
    assert subprocess.run(["node", script, str(tmp_path / "broken.mmd")], capture_output=True, timeout=120, check=False).returncode == 1


def test_field_summary() -> None:
    assert field_summary([]) == "(no fields)"
    assert field_summary(["objective"]) == "objective"
    assert field_summary(["prompt_lens", "prompt_ids", "prompt_index"]) == "prompt_{ids,index,lens}"
    assert field_summary(ROLLOUT_FIELDS) == "rollout (13 fields)"
    assert field_summary(["completion", "completion_ids", "completion_lens"]) == "completion, completion_{ids,lens}"
    assert field_summary(["a_x", "b_x", "c_x", "d_x", "e_x"]) == "a_x, b_x, +3 more"
    assert field_summary(["a_x", "b_x", "c_x", "d_x"], max_items=10) == "a_x, b_x, c_x, d_x"
    assert field_summary(["z", "a"]) == field_summary(["a", "z"]) == "a, z"


def test_annotations_for_unknown_nodes_are_refused() -> None:
    graph = build_example("llamarl")
    with pytest.raises(ExportError, match=r"annotations name node\(s\) \['trainer'\] that graph 'llamarl' does not have.*another graph"):
        to_dot(graph, annotations={"trainer": "devices 0-1"})
    with pytest.raises(ExportError, match=r"not strings"):
        to_mermaid(graph, annotations={"gen": 3})  # type: ignore[dict-item]


def test_annotations_are_one_line() -> None:
    text = to_mermaid(build_example("llamarl"), annotations={"gen": "devices 0-3\n dp2"})
    assert "devices 0-3 dp2" in text


def test_direction_and_formats() -> None:
    graph = build_example("llamarl")
    assert "rankdir=TB" in to_dot(graph, direction="TB")
    assert "flowchart TB" in to_mermaid(graph, direction="TB")
    with pytest.raises(ExportError, match=r"direction 'RL' is not one of \['LR', 'TB'\]"):
        to_dot(graph, direction="RL")
    assert from_json(export_text(graph, "json")) == graph
    assert export_text(graph, "dot") == to_dot(graph)
    with pytest.raises(ExportError, match=r"unknown export format 'svg'; formats: mermaid, dot, json"):
        export_text(graph, "svg")
    with pytest.raises(ExportError, match=r"json format is the graph itself"):
        export_text(graph, "json", annotations={"gen": "x"})
    assert [format_for_path(p) for p in ("a.SVG", "b.gv", "c.mmd", "d.txt", "e")] == ["svg", "dot", "mermaid", None, None]


# -- rendering through Graphviz -------------------------------------------------------------------
def _needs_dot() -> None:
    if shutil.which("dot") is None:
        pytest.skip("Graphviz 'dot' is not installed (apt-get install graphviz): SVG/PNG rendering not checked")


def test_render_svg(tmp_path, example_graph: Graph) -> None:
    _needs_dot()
    path = render(example_graph, "svg", tmp_path / "g.svg", annotations={"gen": "devices 0-1 · dp2"})
    svg = path.read_text()
    assert svg.lstrip().startswith("<?xml") and "</svg>" in svg
    for node in example_graph.nodes:
        assert f"{node.name} ({node.kind})" in svg
    assert "devices 0&#45;1 · dp2" in svg or "devices 0-1 · dp2" in svg
    assert "k&lt;=" in svg and 'stroke-dasharray="5,2"' in svg
    assert [p.name for p in tmp_path.iterdir()] == ["g.svg"]


def test_render_png(tmp_path) -> None:
    _needs_dot()
    data = render_bytes(build_example("llamarl"), "png")
    assert data.startswith(b"\x89PNG\r\n\x1a\n")


def test_render_without_graphviz_names_the_package(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no 'dot'
    target = tmp_path / "g.svg"
    with pytest.raises(ExportError) as info:
        render(build_example("llamarl"), "svg", target)
    message = str(info.value)
    assert "apt-get install graphviz" in message and "brew install graphviz" in message
    assert "--format mermaid" in message
    assert not target.exists()


def test_render_failure_leaves_old_file_and_no_temp(tmp_path, monkeypatch) -> None:
    fake = tmp_path / "bin" / "dot"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nprintf 'partial'\necho 'Error: syntax error in line 1' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    target = tmp_path / "g.svg"
    target.write_text("old picture")
    with pytest.raises(ExportError, match=r"failed \(exit status 1\).*syntax error in line 1"):
        render(build_example("llamarl"), "svg", target)
    assert target.read_text() == "old picture"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "g.svg"]


def test_render_rejects_text_formats() -> None:
    with pytest.raises(ExportError, match=r"unknown export format 'dot'; formats: svg, png"):
        render_bytes(build_example("llamarl"), "dot")


# -- atomic writes --------------------------------------------------------------------------------
def test_write_atomic_creates_and_replaces(tmp_path) -> None:
    path = tmp_path / "out.txt"
    write_atomic(path, "one")
    assert path.read_text() == "one"
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    path.chmod(0o600)
    write_atomic(path, b"two")
    assert path.read_bytes() == b"two" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_write_atomic_errors_name_the_path(tmp_path) -> None:
    with pytest.raises(ExportError, match=r"folder '.*nope' does not exist; create it first"):
        write_atomic(tmp_path / "nope" / "x.svg", "x")
    with pytest.raises(ExportError, match=r"it is a folder"):
        write_atomic(tmp_path, "x")


def test_write_atomic_interrupted_write_leaves_nothing(tmp_path, monkeypatch) -> None:
    path = tmp_path / "out.txt"
    path.write_text("old")

    def boom(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_exporters_do_not_need_a_valid_graph() -> None:
    graph = Graph(GraphSpec(name="empty", nodes=()), validate=False)
    assert _parse_dot(to_dot(graph)).get_name() == '"empty"'
    assert to_mermaid(graph).splitlines()[-1] == "flowchart LR"
