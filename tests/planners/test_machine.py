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
    }


@pytest.mark.parametrize(
    "plan, machine, expected",
    [
        ("cpu2", {"backend": "local", "cores": 2, "cuda_devices": 0}, "plan for cpu:2 on this machine's CPU cores: gen on 0"),
        ("cpu8", {"backend": "torchrun", "cores": 2, "cuda_devices": 0, "world_size": 8}, "on torchrun ranks: gen on 0, aipo on 7, policy on 7"),
        ("h100", {"backend": "torchrun", "cores": 64, "cuda_devices": 8, "world_size": 4}, "plan for 16xH100 on torchrun ranks: gen on 0-1"),
    ],
    ids=["cpu-here", "cpu-ranks", "gpu-ranks"],
)
def test_devices_here_are_described(plans, plan, machine, expected):
    assert expected in check_plan_here(plans[plan], **machine)


@pytest.mark.parametrize(
    "plan, machine, message",
    [
        ("cpu8", {"backend": "local", "cores": 2, "cuda_devices": 0, "graph_arg": "mine_grpo.py"}, "made for cpu:8 (CPU devices 0-7), but this machine has 2 CPU cores; make a plan for this machine: flowrl plan mine_grpo.py --cluster cpu:2 -o plan.json"),
        ("cpu8", {"backend": "local", "cores": 2, "cuda_devices": 0}, "make a plan for this machine: flowrl plan GRAPH --cluster cpu:2 -o plan.json"),
        ("cpu8", {"backend": "torchrun", "cores": 2, "cuda_devices": 0, "world_size": 3}, "but there are 3 ranks in this torchrun job; launch torchrun with 8 processes"),
        ("h100", {"backend": "local", "cores": 2, "cuda_devices": 0}, "made for 16xH100 (GPU devices 0-3), but this machine has no CUDA GPU (2 CPU cores)"),
        ("h100", {"backend": "process", "cores": 2, "cuda_devices": 2}, "but this machine has 2 CUDA GPUs"),
    ],
    ids=["cpu-too-few-cores", "cpu-too-few-cores-no-graph-arg", "cpu-too-few-ranks", "gpu-none", "gpu-too-few"],
)
def test_devices_not_here_are_refused(plans, plan, machine, message):
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_plan_here(plans[plan], **machine)
