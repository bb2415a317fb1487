"""A node's torch ``DeviceMesh``, built from its plan placement on the running process group.

Device ids of a plan are global ranks (one rank per device); the mesh has the placement's axes
(``pp``, ``dp``, ``tp``) as dim names. The planner only describes meshes; building one needs
torch.distributed, so it lives here, in the runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flowrl.errors import PlanError
from flowrl.planners.units import device_ranges

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from flowrl.planners.plan_data import Plan

__all__ = ["device_mesh", "mesh_device_type"]


def mesh_device_type(plan: Plan) -> str:
    """``"cpu"`` for a plan made for CPU cores, else ``"cuda"``."""
    kind = plan.cluster_spec.device.kind if plan.cluster_spec else ("cpu" if plan.cluster.startswith("cpu") else "gpu")
    return "cpu" if kind == "cpu" else "cuda"


def device_mesh(plan: Plan, name: str, *, device_type: str | None = None) -> DeviceMesh:
    """The torch ``DeviceMesh`` of node ``name`` on the running default process group.

    Every rank of the default group must call this (``DeviceMesh`` creates sub-groups collectively).

    Args:
        plan: the run's plan.
        name: the node.
        device_type: ``"cpu"`` or ``"cuda"``; default: what the plan was made for (``mesh_device_type``).

    Raises:
        PlanError: if the node has no devices, no process group runs, or it is too small.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    try:
        p = plan.placements[name]
    except KeyError:
        raise PlanError(f"plan for graph {plan.graph!r} has no node {name!r}; nodes: {', '.join(plan.placements)}") from None
    if not p.devices:
        raise PlanError(f"node {name!r} ({p.kind}) runs on the host and has no device mesh")
    if not dist.is_available() or not dist.is_initialized():
        raise PlanError(f"device_mesh({name!r}) needs a running process group; call torch.distributed.init_process_group first (torchrun does)")
    world = dist.get_world_size()
    if max(p.devices) >= world:
        raise PlanError(
            f"node {name!r} is placed on devices {device_ranges(p.devices)} but the process group has {world} ranks; "
            f"launch {max(p.devices) + 1} or more ranks, or re-plan for {world} devices"
        )
    mesh = torch.tensor(p.devices, dtype=torch.int64).reshape(p.mesh_shape)
    return DeviceMesh(device_type or mesh_device_type(plan), mesh, mesh_dim_names=tuple(p.axes))
