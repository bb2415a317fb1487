"""``graph_diff``: the differing paths of two graphs' JSON, nodes and edges named, not numbered."""

from __future__ import annotations

import json

from flowrl.examples import build_example
from flowrl.graph.diff import graph_diff
from flowrl.graph.serialize import to_json


def _json(graph):
    return json.loads(to_json(graph))


def test_the_same_graph_has_no_difference():
    assert graph_diff(_json(build_example("llamarl")), _json(build_example("llamarl"))) == []


def test_changes_are_named_by_node_and_edge():
    old = _json(build_example("llamarl"))
    new = json.loads(json.dumps(old))
    next(n for n in new["nodes"] if n["name"] == "aipo")["loss"]["rho"] = 2.0
    new["weight_edges"][0]["max_staleness"] = 3
    new["nodes"].insert(0, {"kind": "source", "name": "extra"})  # shifts every position: still one change
    assert graph_diff(old, new) == [
        "nodes['aipo'].loss.rho: 4.0 -> 2.0",
        "nodes['extra']: (absent) -> {\"kind\": \"source\", \"name\": \"extra\"}",  # the old graph's order, then what is new
        "weight_edges['policy->gen'].max_staleness: 1 -> 3",
    ]
