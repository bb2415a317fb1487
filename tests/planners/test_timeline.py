"""The predicted timeline (``flowrl plan --trace``) has the tracks and span names of a real run's trace."""

from __future__ import annotations

import json

import pytest

from flowrl.cli.main import main
from flowrl.examples.llamarl import build_llamarl, build_llamarl_ref
from flowrl.runtime.run import run_graph
from tests.runtime.helpers import synthetic_config


def _names(path) -> tuple[set[str], set[str]]:
    events = json.loads(path.read_text())["traceEvents"]
    tids = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    return {tids[e["tid"]] for e in spans}, {e["name"] for e in spans}


@pytest.mark.parametrize("build", [build_llamarl, build_llamarl_ref], ids=["llamarl", "llamarl_ref"])
def test_predicted_and_measured_traces_share_tracks_and_span_names(tmp_path, build, capsys):
    graph = build(max_staleness=1)
    graph_file = tmp_path / "g.json"
    assert main(["viz", graph.name, "--format", "json", "-o", str(graph_file)]) == 0
    predicted = tmp_path / "predicted.json"
    assert main(["plan", str(graph_file), "--cluster", "cpu:2", "--strategy", "disaggregated", "--trace", str(predicted)]) == 0, capsys.readouterr().err
    measured = tmp_path / "measured.json"
    run_graph(graph, synthetic_config(graph, steps=3, trace=str(measured)))
    predicted_tracks, predicted_spans = _names(predicted)
    measured_tracks, measured_spans = _names(measured)
    assert predicted_tracks == measured_tracks
    assert predicted_spans == measured_spans - {"wait"}  # waiting is measured, never predicted
