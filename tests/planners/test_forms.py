"""``--plan`` files: a plan file or a JSON placement, read into a ``Placement`` in one place for every backend."""

from __future__ import annotations

import json

import pytest

from flowrl.cli.main import main
from flowrl.errors import PlanError
from flowrl.examples.llamarl import build_llamarl, build_llamarl_ref
from flowrl.placement import NodeMesh, default_placement, placement_to_json, run_devices, run_strategy
from flowrl.planners.forms import read_placement
from flowrl.planners.plan import plan_graph, save_plan
from flowrl.runtime.backends.torchrun.backend import rank_placement
from flowrl.runtime.config import RunConfig
from flowrl.runtime.control.executor_placement import run_placement

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


def test_a_misspelt_node_is_named(tmp_path):
    path = _write(tmp_path, {"gen": [0], "polcy": [1]})
    match = r"places \['polcy'\], which are not device nodes of graph 'llamarl' \(those are \['gen', 'policy'\]\); 'polcy' -> did you mean 'policy'\?"
    with pytest.raises(PlanError, match=match):
        read_placement(path, LLAMARL)


@pytest.mark.parametrize("backend", ["local", "torchrun"])
def test_a_placement_for_another_graph_is_refused_by_the_runtime(backend):
    """A Python caller's placement is checked against the graph at run start, as a ``--plan`` file is."""
    wrong = default_placement(build_llamarl_ref(), 1, 4)  # places 'ref' too
    with pytest.raises(PlanError, match=r"places \['ref'\], which are not device nodes of graph 'llamarl'"):
        if backend == "torchrun":
            rank_placement(LLAMARL, wrong, 4)
        else:
            run_placement(LLAMARL, wrong, RunConfig(backend=backend))


def test_a_json_placement_reads_with_its_mesh_and_writes_back(tmp_path):
    data = {"gen": {"ranks": [0, 1], "mesh": {"tp": 2}}, "policy": [2, 3]}
    placement = read_placement(_write(tmp_path, data), LLAMARL)
    assert str(placement) == "gen:t2@0-1 | policy:d2@2-3" and placement.strategy == "manual" and not placement.pin
    assert placement.nodes["gen"] == NodeMesh(devices=(0, 1), mesh_shape=(1, 1, 2)) and "aipo" not in placement.nodes
    assert placement.groups() == [["gen"], ["policy"]]
    assert json.loads(placement_to_json(placement)) == data


def test_a_plan_file_reads_as_its_placement(tmp_path):
    plan = plan_graph(LLAMARL, "cpu:2", strategy="disaggregated")
    save_plan(plan, tmp_path / "plan.json")
    placement = read_placement(tmp_path / "plan.json", LLAMARL)
    assert placement.devices == {"gen": (0,), "policy": (1,)} and placement.pin and placement.strategy == "disaggregated"
    assert placement == plan.placement(source=f"plan:{tmp_path / 'plan.json'}")
    with pytest.raises(PlanError, match=r"was made for graph 'llamarl', not 'llamarl_ref'"):
        read_placement(tmp_path / "plan.json", build_llamarl_ref())


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
        read_placement(_write(tmp_path, data), LLAMARL)


@pytest.mark.parametrize(("k", "cores", "expect"), [(0, 4, {"gen": (0, 1, 2, 3), "policy": (0, 1, 2, 3)}), (1, 4, {"gen": (0, 1), "policy": (2, 3)}), (2, 1, {"gen": (0,), "policy": (0,)})],
                         ids=["k0-colocated", "k1-halves", "one-core"])
def test_a_run_without_a_plan_uses_the_run_strategy(k, cores, expect):
    placement = run_placement(LLAMARL, None, RunConfig(max_staleness=k), n_devices=cores)
    assert placement.devices == expect and placement.strategy == run_strategy(k, cores) and not placement.pin
    assert run_devices({"gen": "generator", "policy": "policy"}, placement.strategy, cores) == expect


def test_a_plan_or_placement_file_that_is_missing_huge_or_unreadable_is_named(tmp_path):
    """Both readers (``--plan``'s and ``load_placement``) refuse through ``fileio.read_bounded``, naming the file."""
    from flowrl.errors import PlanError
    from flowrl.examples import build_example
    from flowrl.placement import load_placement
    from flowrl.placement.forms import MAX_PLACEMENT_BYTES
    from flowrl.planners.forms import read_placement

    graph = build_example("llamarl")
    missing = tmp_path / "none.json"
    with pytest.raises(PlanError, match=r"plan file '.*none.json' does not exist; write one with `flowrl plan llamarl --cluster cpu -o /.*none.json`"):
        read_placement(missing, graph, graph_arg="llamarl")
    with pytest.raises(PlanError, match=r"placement file '.*none.json' does not exist; write one like"):
        load_placement(missing, graph)
    huge = tmp_path / "huge.json"
    huge.write_bytes(b" " * (MAX_PLACEMENT_BYTES + 1))
    with pytest.raises(PlanError, match=r"placement file '.*huge.json' is over the \d+-byte limit; is it a placement file\?"):
        load_placement(huge, graph)
    folder = tmp_path / "dir.json"
    folder.mkdir()
    with pytest.raises(PlanError, match=r"does not exist"):  # a folder is not a file
        read_placement(folder, graph)
