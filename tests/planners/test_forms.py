"""``--plan`` files: a plan file or a JSON placement, read into a ``Plan`` in one place for every backend (issue 12.4)."""

from __future__ import annotations

import json

import pytest

from flowrl.cli.main import main
from flowrl.errors import PlanError
from flowrl.examples.llamarl import build_llamarl, build_llamarl_ref
from flowrl.planners.forms import placement_plan, read_plan, run_plan
from flowrl.planners.plan import plan_graph, save_plan
from flowrl.planners.strategies import run_devices, run_strategy
from flowrl.runtime.backends.torchrun import rank_plan
from flowrl.runtime.config import RunConfig
from flowrl.runtime.placement import run_placement

LLAMARL = build_llamarl(max_staleness=1)


def _write(tmp_path, data) -> str:
    path = tmp_path / "place.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("backend", ["local", "process"])
def test_the_readme_placement_runs_on_local_and_process(tmp_path, capsys, backend):
    path = _write(tmp_path, {"gen": [0], "policy": [1]})
    code = main(["run", "llamarl", "--plan", path, "--backend", backend, "--steps", "2", "--synthetic", "--quiet"])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("backend", ["local", "process", "torchrun"])
def test_a_misspelt_node_is_named_on_every_backend(tmp_path, backend):
    path = _write(tmp_path, {"gen": [0], "polcy": [1]})
    match = r"places \['polcy'\], which are not device nodes of graph 'llamarl' \(those are \['gen', 'policy'\]\); 'polcy' -> did you mean 'policy'\?"
    with pytest.raises(PlanError, match=match):
        if backend == "torchrun":
            rank_plan(LLAMARL, path, 2)
        else:
            run_placement(LLAMARL, RunConfig(plan=path, backend=backend))


def test_a_placement_becomes_a_plan_without_predictions(tmp_path):
    plan = read_plan(_write(tmp_path, {"gen": {"ranks": [0, 1], "mesh": {"tp": 2}}, "policy": [2, 3]}), LLAMARL)
    assert str(plan) == "gen:t2@0-1 | policy:d2@2-3" and plan.strategy == "manual" and plan.workload is None
    assert plan.placements["aipo"].devices == (2, 3) and plan.placements["reward"].devices == ()
    assert plan.colocation_groups() == [["aipo", "policy"], ["gen"]]


def test_a_plan_file_reads_as_itself(tmp_path):
    plan = plan_graph(LLAMARL, "cpu:2", strategy="disaggregated")
    save_plan(plan, tmp_path / "plan.json")
    assert read_plan(tmp_path / "plan.json", LLAMARL) == plan
    with pytest.raises(PlanError, match=r"was made for graph 'llamarl', not 'llamarl_ref'"):
        read_plan(tmp_path / "plan.json", build_llamarl_ref())


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ([0, 1], r"neither a flowrl plan nor a placement \(Expected `object`, got `array`\)"),
        ({"gen": [0], "policy": "1"}, r"node 'policy' must be a list of devices"),
        ({"gen": [0], "policy": [1, 1]}, r"node 'policy' is placed on devices \[1, 1\]: devices must be distinct"),
        ({"gen": [0]}, r"gives node 'policy' no devices"),
    ],
    ids=["array", "string-devices", "duplicate", "missing"],
)
def test_bad_placements_name_what_is_wrong(tmp_path, data, match):
    with pytest.raises(PlanError, match=match):
        read_plan(_write(tmp_path, data), LLAMARL)


@pytest.mark.parametrize(("k", "cores", "expect"), [(0, 4, {"gen": (0, 1, 2, 3), "policy": (0, 1, 2, 3)}), (1, 4, {"gen": (0, 1), "policy": (2, 3)}), (2, 1, {"gen": (0,), "policy": (0,)})],
                         ids=["k0-colocated", "k1-halves", "one-core"])
def test_a_run_without_a_plan_uses_the_run_strategy(k, cores, expect):
    plan = run_plan(LLAMARL, k, cores)
    assert {n: plan.placements[n].devices for n in expect} == expect
    assert plan.strategy == run_strategy(k, cores)
    assert run_devices({"gen": "generator", "policy": "policy"}, plan.strategy, cores) == expect
    assert placement_plan(LLAMARL, expect).placements["aipo"].devices == expect["policy"]
