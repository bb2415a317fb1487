"""Where a run's executors run on this machine: its ``Placement`` checked and completed, and each node's torch device.

The runtime executes a ``flowrl.placement.Placement`` (devices and mesh per device node) and
imports nothing from the planner: ``run_graph(graph, placement, config)`` takes one (the CLI reads
``--plan``'s plan file or JSON placement into one: ``flowrl.planners.forms.read_placement``).
Without one, :func:`run_placement` lays out the run strategy for the staleness bound on this
machine's devices (``flowrl.placement.default``: every device node colocated for k = 0,
generators and trainers on disjoint halves for k >= 1); the devices are the cores, or the GPUs when
the run is on CUDA. (The torchrun backend places on the job's ranks itself.)

Executors whose device sets overlap form one colocation group (``Placement.groups``) and never run
a step at the same time; executors on disjoint devices run concurrently. On CPU a device is a core:
executors are pinned to their cores when the placement comes from a CPU plan and every id is a
core of this machine.

Torch devices (``RunConfig.device``): this module is the one place that decides where a node's model
lives. ``resolve_device`` turns ``"auto"`` into ``"cuda"`` when torch sees a CUDA device and
``"cpu"`` otherwise, and refuses ``"cuda"`` on a machine without one. With ``"cuda"``,
``node_devices`` gives each node ``cuda:N`` with N its first device id in the placement modulo the
number of visible GPUs: colocated nodes share a GPU, and with one GPU every node is on ``cuda:0``.
Under torchrun ``rank_device`` gives each rank ``cuda:LOCAL_RANK`` with ``"cuda"`` (or ``"cpu"``):
every model of a node on that rank lives there, replicas, FSDP2 shards and generators alike
(``flowrl.runtime.backends.torchrun.rank_programs``), and its process groups use NCCL there, gloo on a CPU.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import msgspec
import torch

from flowrl.errors import ConfigError
from flowrl.graph.ir import Graph
from flowrl.placement.layout import Placement
from flowrl.placement.default import default_placement
from flowrl.placement.forms import check_placed
from flowrl.runtime.staleness import StalenessGate

if TYPE_CHECKING:
    from flowrl.runtime.config import RunConfig

__all__ = ["run_placement", "one_device_meshes", "resolve_device", "node_devices"]


def resolve_device(requested: str, *, cuda_available: bool | None = None) -> str:
    """The device type a run uses: ``"cpu"`` or ``"cuda"``.

    Args:
        requested: ``RunConfig.device``: ``"auto"`` (CUDA when torch sees a CUDA device), ``"cpu"`` or ``"cuda"``.
        cuda_available: whether this machine has CUDA (default: ``torch.cuda.is_available()``).

    Raises:
        ConfigError: ``"cuda"`` on a machine without a CUDA device, or an unknown value.

    Example:
        >>> resolve_device("auto", cuda_available=False), resolve_device("auto", cuda_available=True)
        ('cpu', 'cuda')
    """
    has_cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if requested == "auto":
        return "cuda" if has_cuda else "cpu"
    if requested == "cuda" and not has_cuda:
        raise ConfigError("--device cuda: this machine has no CUDA device; use --device cpu or auto")
    if requested not in ("cpu", "cuda"):
        raise ConfigError(f"device {requested!r} is not one of 'auto', 'cpu', 'cuda'")
    return requested


def node_devices(placement: Placement, device: str, *, cuda_count: int | None = None) -> dict[str, str]:
    """The torch device of each executor node's model (``ProgramEnv.devices``): the one place it is decided.

    Args:
        placement: the run's placement (its device ids per node).
        device: ``resolve_device``'s answer, ``"cpu"`` or ``"cuda"``.
        cuda_count: visible GPUs (default: ``torch.cuda.device_count()``).

    Returns:
        ``{}`` on the CPU (every node on ``"cpu"``); with CUDA, ``{node: "cuda:N"}`` with N the node's
        first device id modulo ``cuda_count``.

    Example:
        >>> from flowrl.placement import NodeMesh
        >>> placement = Placement(nodes={"gen": NodeMesh(devices=(0,)), "policy": NodeMesh(devices=(1,))})
        >>> node_devices(placement, "cuda", cuda_count=2), node_devices(placement, "cuda", cuda_count=1)
        ({'gen': 'cuda:0', 'policy': 'cuda:1'}, {'gen': 'cuda:0', 'policy': 'cuda:0'})
    """
    if device == "cpu":
        return {}
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if count < 1:
        raise ConfigError("no CUDA device is visible (torch.cuda.device_count() is 0); use --device cpu")
    return {node: f"cuda:{min(ids) % count}" for node, ids in placement.devices.items()}


def rank_device(device: str, local_rank: int, *, cuda_count: int | None = None) -> torch.device:
    """A torchrun rank's torch device: ``cuda:LOCAL_RANK`` when ``device`` (``resolve_device``'s
    answer) is ``"cuda"``, else the CPU.

    Raises:
        ConfigError: ``LOCAL_RANK`` beyond the GPUs this host shows.

    Example:
        >>> rank_device("cpu", 3), rank_device("cuda", 1, cuda_count=2)
        (device(type='cpu'), device(type='cuda', index=1))
    """
    if device == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if local_rank >= count:
        raise ConfigError(
            f"torchrun's LOCAL_RANK={local_rank} but this host shows {count} GPU(s): launch at most {count} processes "
            "per node (--nproc-per-node), or run on the CPU (--device cpu)"
        )
    return torch.device("cuda", local_rank)


def run_placement(
    graph: Graph, placement: Placement | None, config: RunConfig, *, n_devices: int | None = None, backend: str = "local",
    gate: StalenessGate | None = None,
) -> Placement:
    """The placement a run of ``graph`` uses on this machine: ``placement``, or the run strategy for its staleness bound.

    Args:
        graph, config: the run.
        placement: the placement given to ``run_graph``; None: the default (module docstring).
        n_devices: devices of a run without a placement (default: this machine's GPUs on CUDA
            (``config.device``), its cores otherwise).
        backend: the run's backend: without a placement, a node whose program runs no axis over
            several of its devices there (``flowrl.mesh_support``: any node on GPUs, whose one process
            uses its first) gets its first device only (``one_device_meshes``).
        gate: the run's staleness gate (``run_graph`` builds it); the default placement is laid out for
            its tightest k. None (a caller outside a run): the gate of ``graph`` and ``config.max_staleness``.

    Returns:
        The placement, its pinning kept only where every device id is a core of this machine.

    Raises:
        PlanError: a placement that does not place exactly the graph's device nodes.
        ConfigError: ``config.device`` is ``"cuda"`` on a machine without CUDA.
    """
    if placement is None:
        cuda = resolve_device(config.device) == "cuda"
        n = n_devices or (torch.cuda.device_count() if cuda else os.cpu_count() or 1)
        return one_device_meshes(graph, default_placement(graph, (gate or StalenessGate.of(graph, config.max_staleness)).tightest(), n), backend, "cuda" if cuda else "cpu")
    check_placed(graph, placement.nodes, f"the placement ({placement.source})")
    cores = os.cpu_count() or 1
    pin = placement.pin and all(d < cores for ds in placement.devices.values() for d in ds)
    return placement if pin == placement.pin else msgspec.structs.replace(placement, pin=pin)


def one_device_meshes(graph: Graph, placement: Placement, backend: str, device: str) -> Placement:
    """``placement`` (a default one) with every node whose program runs no axis over several devices on
    ``backend`` and ``device`` (``flowrl.mesh_support.one_device``) on its first device only: a default
    placement says what runs.

    Example:
        >>> from flowrl.examples import build_example
        >>> from flowrl.placement.default import default_placement
        >>> graph = build_example("llamarl")
        >>> str(one_device_meshes(graph, default_placement(graph, 0, 4), "local", "cuda"))
        'gen:d1@0 | policy:d1@0'
    """
    from flowrl.mesh_support import one_device
    from flowrl.placement.layout import NodeMesh

    nodes = {
        name: NodeMesh(devices=m.devices[:1]) if one_device(graph.node(name).kind, backend, engine=getattr(graph.node(name), "engine", None), device=device) else m
        for name, m in placement.nodes.items()
    }
    return msgspec.structs.replace(placement, nodes=nodes)
