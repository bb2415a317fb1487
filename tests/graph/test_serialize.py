"""JSON serialisation: exact round trips of random valid graphs, typed decoding errors, and no code run on load."""

from __future__ import annotations

import json
import sys

import msgspec
import pytest
from hypothesis import given, settings

from flowrl.errors import GraphError
from flowrl.graph.ir import Graph
from flowrl.cli.graphs import load_graph
from flowrl.graph.serialize import MAX_GRAPH_BYTES, from_json, references, to_json
from tests.graph.strategies import valid_graphs


@settings(max_examples=60)
@given(valid_graphs())
def test_random_graphs_round_trip_exactly(graph: Graph) -> None:
    text = to_json(graph)
    back = from_json(text)
    assert back == graph
    assert back.spec == graph.spec
    assert to_json(back) == text  # the text, too, is a fixed point
    assert str(back) == str(graph)
    compact = to_json(graph, indent=0)
    assert "\n" not in compact and from_json(compact) == graph
    assert from_json(text.encode()) == graph


@pytest.mark.slow
@settings(max_examples=1000)
@given(valid_graphs(max_pipelines=3, max_scorers=4))
def test_random_graphs_round_trip_exactly_many(graph: Graph) -> None:
    assert from_json(to_json(graph)) == graph


def test_example_round_trips(example_graph: Graph) -> None:
    assert from_json(to_json(example_graph)) == example_graph
    assert json.loads(to_json(example_graph))["name"] == example_graph.name


def _example_dict(example_graph: Graph) -> dict:
    return json.loads(to_json(example_graph))


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.update(extra=1), r"schema.*unknown field `extra`|Object contains unknown field `extra`"),
        (lambda d: d["nodes"][0].update(kind="actor"), r"Invalid value 'actor'"),
        (lambda d: d["nodes"][1]["sampling"].update(n_samples="four"), r"Expected `int`, got `str`.*n_samples"),
        (lambda d: d["nodes"][1]["sampling"].update(temperature=0), r"temperature=0.* must be > 0"),
        (lambda d: d["nodes"][1]["sampling"].update(tempreature=1.0), r"unknown field `tempreature`"),
        (lambda d: d["nodes"][1].pop("name"), r"missing required field `name`"),
        (lambda d: d["weight_edges"][0].update(max_staleness=1.5), r"Expected `int`, got `float`"),
        (lambda d: d.update(nodes={}), r"Expected `array`, got `object`"),
    ],
    ids=["unknown-top-field", "unknown-kind", "wrong-type", "out-of-range", "typo-field", "missing-name", "float-staleness", "nodes-not-list"],
)
def test_schema_errors_name_the_path(example_graph: Graph, mutate, match: str) -> None:
    data = _example_dict(example_graph)
    mutate(data)
    with pytest.raises(GraphError, match=match):
        from_json(json.dumps(data))


def test_schema_error_names_the_json_path() -> None:
    from flowrl.examples import build_example

    data = json.loads(to_json(build_example("llamarl")))
    data["nodes"][1]["sampling"]["n_samples"] = "four"
    with pytest.raises(GraphError, match=r"\$\.nodes\[1\]\.sampling\.n_samples"):
        from_json(json.dumps(data))


@pytest.mark.parametrize(
    "text",
    [b"", b"{", b"not json", b"\xff\xfe", b"[1, 2]", b"null", b'"a string"', b"[" * 100_000],
    ids=["empty", "truncated", "not-json", "bad-utf8", "a-list", "null", "a-string", "deep-nesting"],
)
def test_garbage_is_a_graph_error(text: bytes) -> None:
    with pytest.raises(GraphError, match=r"graph (file|JSON)"):
        from_json(text)


def test_oversized_file_refused_before_parsing() -> None:
    with pytest.raises(GraphError, match=r"over the .*-byte limit"):
        from_json(b" " * (MAX_GRAPH_BYTES + 1))


def test_valid_json_invalid_graph_raises_the_rule(example_graph: Graph) -> None:
    data = _example_dict(example_graph)
    data["weight_edges"][0]["max_staleness"] = -1
    with pytest.raises(GraphError, match=r"max_staleness=-1; it must be >= 0"):
        from_json(json.dumps(data))
    assert from_json(json.dumps(data), validate=False).weight_edges[0].max_staleness == -1


EVIL_MODULE = """
import pathlib
pathlib.Path({marker!r}).write_text("imported")
raise RuntimeError("this module must never be imported by loading a graph")

def score(prompt_ids, completion_ids):
    return 0.0
"""


def _graph_referencing(module: str) -> str:
    from flowrl.examples import build_example

    data = json.loads(to_json(build_example("llamarl")))
    for node in data["nodes"]:
        if node["kind"] == "scorer":
            node["fn"] = f"{module}:score"
        if node["kind"] == "source":
            node["source"]["task"] = f"{module}:make_task"
    return json.dumps(data)


def test_loading_json_never_imports_the_scorer_module(tmp_path, monkeypatch) -> None:
    marker = tmp_path / "imported.txt"
    (tmp_path / "flowrl_evil_scorer.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "g.json"
    path.write_text(_graph_referencing("flowrl_evil_scorer"))

    graph = load_graph(str(path))
    assert references(graph) == ["flowrl_evil_scorer:make_task", "flowrl_evil_scorer:score"]
    assert references(path.read_bytes()) == references(graph)
    assert references(path.read_text()) == references(graph)
    assert "flowrl_evil_scorer" not in sys.modules
    assert not marker.exists()
    # the module is importable (and would fail/side-effect), so the test can fail if loading imported it
    with pytest.raises(RuntimeError, match="must never be imported"):
        __import__("flowrl_evil_scorer")
    assert marker.exists()
    sys.modules.pop("flowrl_evil_scorer", None)


def test_references_of_examples(example_graph: Graph) -> None:
    refs = references(example_graph)
    assert refs and all(r.startswith(("flowrl.operators.tasks:", "flowrl.operators.rewards:", "flowrl.examples.", "flowrl.envs.")) for r in refs)
    if example_graph.name == "calc_agent":  # an environment is a reference too
        assert "flowrl.envs.games:CalcEnv" in refs


def test_to_json_is_deterministic(example_graph: Graph) -> None:
    again = from_json(to_json(example_graph))
    assert to_json(again).encode() == msgspec.json.format(msgspec.json.encode(again.spec, order="deterministic"), indent=2)
