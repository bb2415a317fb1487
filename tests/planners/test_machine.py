"""A plan's devices against this machine: described when they are here, refused when they are not."""

from __future__ import annotations

import pytest

from flowrl.errors import PlanError
from flowrl.examples import build_example
from flowrl.planners.machine import check_plan_here
from flowrl.planners.plan import plan_graph


@pytest.fixture(scope="module")
def plans():
    g = build_example("llamarl")
    return {
        "cpu2": plan_graph(g, "cpu:2", strategy="gen:d1@0 | policy:d1@1"),
        "cpu8": plan_graph(g, "cpu:8", strategy="gen:d1@0 | policy:d1@7"),
        "h100": plan_graph(g, "16xH100", strategy="gen:d2@0-1 | policy:d2@2-3"),
        "2x8": plan_graph(g, "2x8xH100", strategy="gen:d8@0-7 | policy:d8@8-15"),
    }


@pytest.mark.parametrize(
    "plan, machine, expected",
    [
        ("cpu2", {"backend": "local", "cores": 2, "cuda_devices": 0}, "plan for cpu:2 on this machine's CPU cores: gen on 0"),
        ("cpu8", {"backend": "torchrun", "cores": 2, "cuda_devices": 0, "world_size": 8}, "on torchrun ranks: gen on 0, aipo on 7, policy on 7"),
        ("h100", {"backend": "torchrun", "cores": 64, "cuda_devices": 8, "world_size": 4}, "plan for 16xH100 on torchrun ranks: gen on 0-1"),
        ("cpu2", {"backend": "local", "cores": 2, "cuda_devices": 2, "device": "cpu"}, "plan for cpu:2 on this machine's CPU cores"),
        ("2x8", {"backend": "torchrun", "cores": 64, "cuda_devices": 8, "world_size": 16, "ranks_per_host": 8}, "gen on 0-7, aipo on 8-15"),
    ],
    ids=["cpu-here", "cpu-ranks", "gpu-ranks", "cpu-plan-device-cpu-on-a-gpu-machine", "two-hosts-as-planned"],
)
def test_devices_here_are_described(plans, plan, machine, expected):
    assert expected in check_plan_here(plans[plan], **machine)


@pytest.mark.parametrize(
    "plan, machine, message",
    [
        ("cpu8", {"backend": "local", "cores": 2, "cuda_devices": 0}, "made for cpu:8 (CPU devices 0-7), but this machine has 2 CPU cores; make a plan for this machine: flowrl plan GRAPH --cluster cpu:2"),
        ("cpu8", {"backend": "local", "cores": 2, "cuda_devices": 0, "graph_arg": "mine_grpo.py"}, "made for cpu:8 (CPU devices 0-7), but this machine has 2 CPU cores; make a plan for this machine: flowrl plan mine_grpo.py --cluster cpu:2 -o plan.json"),
        ("cpu8", {"backend": "local", "cores": 2, "cuda_devices": 0}, "make a plan for this machine: flowrl plan GRAPH --cluster cpu:2 -o plan.json"),
        ("cpu8", {"backend": "torchrun", "cores": 2, "cuda_devices": 0, "world_size": 3}, "but there are 3 ranks in this torchrun job; launch torchrun with 8 processes"),
        ("h100", {"backend": "local", "cores": 2, "cuda_devices": 0}, "made for 16xH100 (GPU devices 0-3), but this machine has no CUDA GPU (2 CPU cores)"),
        ("h100", {"backend": "process", "cores": 2, "cuda_devices": 2}, "but this machine has 2 CUDA GPUs"),
        ("cpu8", {"backend": "torchrun", "cores": 2, "cuda_devices": 0, "world_size": 3, "graph_arg": "'my graph.py'", "plan_path": "p.json"},
         "but there are 3 ranks in this torchrun job; launch torchrun with 8 processes in all ('flowrl plan ... --emit DIR' writes that launch), "
         "or re-plan for 3: flowrl plan 'my graph.py' --cluster cpu:3 -o p.json"),
        ("h100", {"backend": "torchrun", "cores": 64, "cuda_devices": 8, "world_size": 2},
         "but there are 2 ranks in this torchrun job; launch torchrun with 4 processes in all ('flowrl plan ... --emit DIR' writes that launch), "
         "or re-plan for 2: flowrl plan GRAPH --cluster 2xH100 -o plan.json"),
        ("h100", {"backend": "torchrun", "cores": 64, "cuda_devices": 8, "world_size": 4, "device": "cpu"},
         "made for 16xH100 (GPU devices 0-3), but --device cpu runs the models on the CPU; drop --device cpu to run the plan on the GPUs, "
         "or make a plan for this machine: flowrl plan GRAPH --cluster cpu -o plan.json"),
        ("cpu2", {"backend": "local", "cores": 2, "cuda_devices": 2},
         "made for cpu:2 (CPU devices 0-1), but this run puts its models on CUDA GPUs (--device auto; this machine has 2); add --device cpu"),
        ("cpu2", {"backend": "torchrun", "cores": 2, "cuda_devices": 1, "world_size": 2, "device": "cuda"}, "add --device cpu to run the plan as made"),
        ("2x8", {"backend": "torchrun", "cores": 64, "cuda_devices": 4, "world_size": 16, "ranks_per_host": 4},
         "made for 2x8xH100 (GPU devices 0-15), 8 per host on 2 hosts, but this job runs 4 ranks per host: the plan's groups would span "
         "other hosts than it priced; launch --nproc-per-node 8 on every host ('flowrl plan ... --emit DIR' writes that launch), or re-plan "
         "for this job: flowrl plan GRAPH --cluster 4x4xH100 -o plan.json"),
    ],
    ids=["cpu-too-few-cores", "cpu-too-few-cores-names-the-file", "cpu-too-few-cores-no-graph-arg", "cpu-too-few-ranks", "gpu-none", "gpu-too-few", "cpu-plan-on-3-ranks-names-the-fix", "gpu-plan-on-2-ranks",
         "gpu-plan-device-cpu", "cpu-plan-on-cuda-auto", "cpu-plan-device-cuda", "other-ranks-per-host"],
)
def test_devices_not_here_are_refused(plans, plan, machine, message):
    import re

    with pytest.raises(PlanError, match=re.escape(message)):
        check_plan_here(plans[plan], **machine)
