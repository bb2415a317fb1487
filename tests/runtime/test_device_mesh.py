"""``runtime.meshes.device_mesh``: a torch DeviceMesh over the node's devices on a running (one-rank, gloo) process group,
from a plan's placement."""

from __future__ import annotations

import pytest

from flowrl.errors import PlanError
from flowrl.examples import build_example
from flowrl.planners.plan import plan_graph
from flowrl.runtime.parallel.meshes import device_mesh

dist = pytest.importorskip("torch.distributed")


@pytest.fixture
def one_rank_group():
    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    if dist.is_initialized():
        pytest.skip("a process group is already running in this test process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_device_mesh_needs_a_process_group():
    placement = plan_graph(build_example("llamarl"), "cpu:1").placement()
    with pytest.raises(PlanError, match="needs a running process group"):
        device_mesh(placement, "policy", device_type="cpu")


def test_device_mesh_on_one_rank(one_rank_group):
    placement = plan_graph(build_example("llamarl"), "cpu:1").placement()
    mesh = device_mesh(placement, "policy", device_type="cpu")
    assert mesh.mesh_dim_names == ("pp", "dp", "tp")
    assert mesh.mesh.tolist() == [[[0]]]
    assert mesh.device_type == "cpu"
    with pytest.raises(PlanError, match=r"places no node 'reward'; it places gen, policy"):
        device_mesh(placement, "reward", device_type="cpu")


def test_device_mesh_larger_than_the_group(one_rank_group):
    placement = plan_graph(build_example("llamarl"), "cpu:2", strategy="disaggregated").placement()
    with pytest.raises(PlanError, match=r"placed on devices 1 but the process group has 1 ranks; launch 2 or more ranks"):
        device_mesh(placement, "policy", device_type="cpu")
