"""The planner proposes only what runs: ``flowrl.planners.runnable`` reads ``flowrl.mesh_support`` for each node.

Each test looks at one row in both states (``monkeypatch``): as the table says today, and flipped.
"""

from __future__ import annotations

import msgspec
import pytest

from flowrl.errors import PlanError
from flowrl.examples import build_example
from flowrl.examples.hf_copy import build_hf_copy
from flowrl.mesh_support import MESH_SUPPORT, allowed, node_facts
from flowrl.modelspec import model_preset
from flowrl.planners.parallel import ParallelDims
from flowrl.planners.cluster import CpuTerms, cpu_device, parse_cluster
from flowrl.planners.plan import plan_graph
from flowrl.planners.runnable import node_axes, plan_backend

QWEN7 = model_preset("qwen2.5-7b")


def _flip(monkeypatch: pytest.MonkeyPatch, *keys: tuple[str, str, str]) -> None:
    for key in keys:
        monkeypatch.setitem(MESH_SUPPORT, key, msgspec.structs.replace(MESH_SUPPORT[key], runs=not MESH_SUPPORT[key].runs))


def _layouts(plan) -> list[dict[str, tuple[int, int, int]]]:
    """Each proposed layout (the plan's and its runners-up'): node -> (dp, tp, pp)."""
    best = {n: (p.dims.dp, p.dims.tp, p.dims.pp) for n, p in plan.placements.items() if p.devices and n in plan.placement().nodes}
    out = [best]
    for alt in plan.alternatives:  # "gen:d2t4@0-7 | policy:d8@0-7"
        dims = {part.split(":")[0]: ParallelDims.parse(part.split(":")[1].split("@")[0]) for part in alt.placement.split(" | ")}
        out.append({n: (d.dp, d.tp, d.pp) for n, d in dims.items()})
    return out


def test_the_backend_a_cluster_implies():
    calibrated = msgspec.structs.replace(parse_cluster("cpu:4"), device=cpu_device(cores=4, memory_bytes=2**34, cpu=CpuTerms(thread_speedup=1.5)))
    assert plan_backend(parse_cluster("8xH100")) == "torchrun" and plan_backend(parse_cluster("cpu:4")) == "torchrun"
    assert plan_backend(calibrated) == "local" and plan_backend(calibrated, fsdp=True) == "torchrun"
    assert plan_backend(parse_cluster("cpu:1")) == "local"


def test_the_hf_example_with_vllm_on_8_h100s_proposes_only_what_runs():
    graph = build_hf_copy(engine="vllm")
    plan = plan_graph(graph, "8xH100", model=QWEN7)
    layouts = _layouts(plan)
    facts = node_facts(graph.node("policy"))
    assert len(layouts) > 1
    for layout in layouts:
        (dp, tp, pp), (gdp, gtp, gpp) = layout["policy"], layout["gen"]
        assert allowed("policy", "torchrun", {"dp": dp, "tp": tp, "pp": pp}, facts=facts), layout
        assert allowed("generator", "torchrun", {"dp": gdp, "tp": gtp, "pp": gpp}, engine="vllm"), layout
        assert not (tp > 1 and pp > 1) and not (dp > 1 and tp > 1 and "fsdp" not in facts), layout  # COMBINATIONS
    assert any(l["gen"][1] > 1 for l in layouts), layouts  # a vLLM generator runs tp: the search offers it


@pytest.mark.parametrize("axis", ["pp", "tp"])
def test_a_policy_row_turned_off_is_not_proposed(monkeypatch, axis):
    index = {"tp": 1, "pp": 2}[axis]
    before = _layouts(plan_graph(build_hf_copy(engine="vllm"), "4xH100", model=QWEN7, strategy="colocated"))
    _flip(monkeypatch, ("policy", "torchrun", axis))
    after = _layouts(plan_graph(build_hf_copy(engine="vllm"), "4xH100", model=QWEN7, strategy="colocated"))
    assert all(l["policy"][index] == 1 for l in after), after
    assert before != after or all(l["policy"][index] == 1 for l in before)


def test_a_combination_the_program_refuses_is_not_proposed_and_is_refused_when_given():
    graph = build_hf_copy(engine="vllm")
    for layout in _layouts(plan_graph(graph, "8xH100", model=QWEN7)):
        assert not (layout["policy"][1] > 1 and layout["policy"][2] > 1), layout
    with pytest.raises(PlanError, match="pp x tp is not built"):
        plan_graph(graph, "8xH100", model=QWEN7, strategy="gen:d4@0-3 | policy:t2p2@4-7")
    with pytest.raises(PlanError, match="set sharding='fsdp'"):
        plan_graph(graph, "8xH100", model=QWEN7, strategy="gen:d4@0-3 | policy:d2t2@4-7")


def test_a_reference_shares_its_sides_dims_only_where_it_runs_them(monkeypatch):
    graph = build_example("llamarl_ref")
    assert {n: sorted(a) for n, a in node_axes(graph, parse_cluster("8xH100")).items()} == {"gen": ["dp", "tp"], "ref": ["tp"], "policy": ["dp", "ep", "pp", "tp"]}
    for flip in (False, True):  # as the table says (a frozen reference runs tp only), then with its dp row turned on
        if flip:
            _flip(monkeypatch, ("reference", "torchrun", "dp"))
        plan = plan_graph(graph, "8xH100", model=model_preset("qwen2.5-1.5b"), strategy="disaggregated")
        ref, policy = plan.placements["ref"], plan.placements["policy"]
        runs = node_axes(graph, parse_cluster("8xH100"))["ref"]
        active = {a for a in ("dp", "tp", "pp") if getattr(policy.dims, a) > 1}
        if active <= runs:
            assert ref.devices == policy.devices, (ref, policy)
        else:  # the side's dims hold an axis it does not run: it goes on the side's first device alone
            assert len(ref.devices) == 1 and ref.devices[0] == policy.devices[0], (ref, policy)


def test_a_given_placement_with_an_axis_that_does_not_run_is_refused(monkeypatch):
    layout = "gen:t2@0-1 | policy:p2@2-3"
    assert str(plan_graph(build_example("llamarl"), "8xH100", model=model_preset("llama3-8b"), strategy=layout).placement()) == layout
    _flip(monkeypatch, ("policy", "torchrun", "pp"))
    with pytest.raises(PlanError, match=r"policy 'policy' has pp=2 on its mesh .* it would run .*runs under torchrun"):
        plan_graph(build_example("llamarl"), "8xH100", model=model_preset("llama3-8b"), strategy=layout)

def test_a_named_backend_decides_the_axes_and_emit_plans_for_torchrun(tmp_path, capsys):
    calibrated = msgspec.structs.replace(parse_cluster("cpu:4"), device=cpu_device(cores=4, memory_bytes=2**34, cpu=CpuTerms(thread_speedup=1.5)))
    graph = build_example("llamarl")
    assert sorted(node_axes(graph, calibrated)["policy"]) == ["dp"]  # implied: a calibrated CPU's mesh is one process's threads
    assert sorted(node_axes(graph, calibrated, backend="torchrun")["policy"]) == ["dp", "ep", "pp", "tp"]
    # a given layout is checked against the named backend: pp runs under torchrun, not in one process
    with pytest.raises(PlanError, match=r"has pp=2 on its mesh .*runs under local"):
        plan_graph(graph, calibrated, strategy="gen:d1@0 | policy:p2@1-2")
    assert plan_graph(graph, calibrated, strategy="gen:d1@0 | policy:p2@1-2", backend="torchrun").placements["policy"].dims.pp == 2
    from flowrl.cli.main import main

    assert main(["plan", "llamarl", "--cluster", "cpu:3", "--backend", "local", "--emit", str(tmp_path / "out")]) == 2
    assert "--emit writes a torchrun launch" in capsys.readouterr().err and not (tmp_path / "out").exists()
