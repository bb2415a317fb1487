"""A node's torch ``DeviceMesh``, built from its placement on the running process group.

Device ids of a placement are global ranks (one rank per device); the mesh has the placement's
axes (``pp``, ``dp``, ``tp``: ``flowrl.placement.AXES``) as dim names. The placement only describes
meshes; building one needs torch.distributed, so it lives here, in the runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flowrl.errors import PlanError
from flowrl.placement.layout import device_ranges

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from flowrl.placement.layout import Placement

__all__ = ["device_mesh"]


def device_mesh(placement: Placement, name: str, *, device_type: str) -> DeviceMesh:
    """The torch ``DeviceMesh`` of node ``name`` on the running default process group.

    Every rank of the default group must call this (``DeviceMesh`` creates sub-groups collectively).

    Args:
        placement: the run's placement.
        name: the node.
        device_type: ``"cpu"`` or ``"cuda"``: the type of this rank's device.

    Raises:
        PlanError: if the node is not placed, no process group runs, or it is too small.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    m = placement.mesh(name)
    if not dist.is_available() or not dist.is_initialized():
        raise PlanError(f"device_mesh({name!r}) needs a running process group; call torch.distributed.init_process_group first (torchrun does)")
    world = dist.get_world_size()
    if max(m.devices) >= world:
        raise PlanError(
            f"node {name!r} is placed on devices {device_ranges(m.devices)} but the process group has {world} ranks; "
            f"launch {max(m.devices) + 1} or more ranks, or re-plan for {world} devices"
        )
    mesh = torch.tensor(m.devices, dtype=torch.int64).reshape(m.mesh_shape)
    return DeviceMesh(device_type, mesh, mesh_dim_names=m.axes)
