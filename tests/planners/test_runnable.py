"""The planner proposes only what runs: ``flowrl.planners.runnable`` reads ``flowrl.mesh_support`` for each node.

Each test looks at one row in both states (``monkeypatch``): as the table says today, and flipped.
"""

from __future__ import annotations

import msgspec
import pytest

from flowrl.errors import PlanError
from flowrl.examples import build_example
from flowrl.examples.hf_copy import build_hf_copy
from flowrl.mesh_support import MESH_SUPPORT
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


def test_the_hf_example_with_vllm_on_8_h100s_proposes_no_tensor_or_pipeline_parallel_policy():
    plan = plan_graph(build_hf_copy(engine="vllm"), "8xH100", model=QWEN7)
    layouts = _layouts(plan)
    assert len(layouts) > 1 and all(l["policy"][1:] == (1, 1) for l in layouts), layouts
    assert any(l["gen"][1] > 1 for l in layouts), layouts  # a vLLM generator runs tp: the search still offers it


@pytest.mark.parametrize("axis", ["pp", "tp"])
def test_a_flipped_policy_row_is_proposed(monkeypatch, axis):
    _flip(monkeypatch, ("policy", "torchrun", axis))
    layouts = _layouts(plan_graph(build_hf_copy(engine="vllm"), "8xH100", model=QWEN7))
    index = {"tp": 1, "pp": 2}[axis]
    other = {"tp": 2, "pp": 1}[axis]
    assert any(l["policy"][index] > 1 for l in layouts), layouts  # the search finds it worth proposing now
    assert all(l["policy"][other] == 1 for l in layouts), layouts  # and the other row still does not run


def test_a_reference_runs_on_one_device_of_its_side_until_its_row_runs(monkeypatch):
    graph = build_example("llamarl_ref")
    assert {n: sorted(a) for n, a in node_axes(graph, parse_cluster("8xH100")).items()} == {"gen": ["dp", "tp"], "ref": [], "policy": ["dp"]}
    plan = plan_graph(graph, "8xH100", model=model_preset("qwen2.5-1.5b"), strategy="disaggregated")
    ref, policy = plan.placements["ref"], plan.placements["policy"]
    assert len(ref.devices) == 1 and ref.devices[0] == policy.devices[0] and len(policy.devices) > 1, (ref, policy)
    _flip(monkeypatch, ("reference", "torchrun", "dp"))
    plan = plan_graph(graph, "8xH100", model=model_preset("qwen2.5-1.5b"), strategy="disaggregated")
    assert plan.placements["ref"].devices == plan.placements["policy"].devices


def test_a_given_placement_with_an_axis_that_does_not_run_is_refused(monkeypatch):
    layout = "gen:t2@0-1 | policy:d2t2@2-5"
    with pytest.raises(PlanError, match=r"policy 'policy' has tp=2 on its mesh .* it would run 4 data-parallel replicas .*runs under torchrun"):
        plan_graph(build_example("llamarl"), "8xH100", model=model_preset("llama3-8b"), strategy=layout)
    _flip(monkeypatch, ("policy", "torchrun", "tp"))
    assert str(plan_graph(build_example("llamarl"), "8xH100", model=model_preset("llama3-8b"), strategy=layout).placement()) == "gen:t2@0-1 | policy:d2t2@2-5"
