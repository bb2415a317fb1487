"""Where a run's executors run, read from its ``Plan``: devices per node, colocation groups, pinning.

The runtime reads placement only from a ``Plan`` (``flowrl.planners``): a plan file, a JSON placement
(both read by ``planners.forms.read_plan``, the one reader for every backend) or, without
``--plan``, the run strategy for the staleness bound (``planners.forms.run_plan``: every heavy node
colocated for k = 0, generators and trainers on disjoint halves of the cores for k >= 1).

Executors whose device sets overlap form one colocation group (``planners.schedule.colocation_groups``)
and never run a step at the same time; executors on disjoint devices run concurrently. On CPU a
device is a core: executors are pinned to their cores when the placement comes from a CPU plan file.

Torch devices (``RunConfig.device``): this module is the one place that decides where a node's model
lives. ``resolve_device`` turns ``"auto"`` into ``"cuda"`` when torch sees a CUDA device and
``"cpu"`` otherwise, and refuses ``"cuda"`` on a machine without one. With ``"cuda"``,
``node_devices`` gives each node ``cuda:N`` with N its first device id in the plan modulo the number
of visible GPUs: colocated nodes share a GPU, and with one GPU every node is on ``cuda:0``; a run
without ``--plan`` is planned over the GPUs rather than the cores. (The torchrun backend gives each
rank ``cuda:LOCAL_RANK`` itself.)
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import msgspec
import torch

from flowrl.errors import ConfigError
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import DEVICE_KINDS
from flowrl.planners.plan_data import Plan

if TYPE_CHECKING:
    from flowrl.runtime.config import RunConfig

__all__ = ["Placement", "run_placement", "HEAVY_KINDS", "resolve_device", "node_devices"]

#: Kinds that run a model; the light ones (source, scorer) run beside them on no device of their own.
HEAVY_KINDS = DEVICE_KINDS


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """The runtime's reading of a run's plan.

    Attributes:
        plan: where every node runs.
        pin: pin executors to their cores (only meaningful on CPU, only when ids are real cores).
        source: where the plan came from (``"default (halves)"``, ``"plan:<file>"``, ...).
    """

    plan: Plan
    pin: bool = False
    source: str = "default"

    @property
    def devices(self) -> dict[str, tuple[int, ...]]:
        """The devices of each executor node that has some (losses run inside their policy)."""
        return {n: p.devices for n, p in self.plan.placements.items() if p.devices and p.kind in HEAVY_KINDS}

    def groups(self) -> list[list[str]]:
        """Colocation groups of the executor nodes: connected components of overlapping device sets."""
        from flowrl.planners.schedule import colocation_groups

        return colocation_groups(self.devices)

    def threads_per_group(self, cpu_count: int | None = None) -> int:
        """Intra-op threads each concurrently running group may use without oversubscribing."""
        cores = cpu_count or os.cpu_count() or 1
        return max(1, cores // max(1, len(self.groups())))


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
        >>> from flowrl.examples import build_example
        >>> from flowrl.planners.forms import placement_plan
        >>> plan = placement_plan(build_example("llamarl"), {"gen": (0,), "policy": (1,)})
        >>> node_devices(Placement(plan=plan), "cuda", cuda_count=2), node_devices(Placement(plan=plan), "cuda", cuda_count=1)
        ({'gen': 'cuda:0', 'policy': 'cuda:1'}, {'gen': 'cuda:0', 'policy': 'cuda:0'})
    """
    if device == "cpu":
        return {}
    count = torch.cuda.device_count() if cuda_count is None else cuda_count
    if count < 1:
        raise ConfigError("no CUDA device is visible (torch.cuda.device_count() is 0); use --device cpu")
    return {node: f"cuda:{min(ids) % count}" for node, ids in placement.devices.items()}


def run_placement(graph: Graph, config: RunConfig, *, n_devices: int | None = None) -> Placement:
    """The placement a run of ``graph`` uses: ``config.plan``'s, or the run strategy for its staleness bound.

    Args:
        graph, config: the run.
        n_devices: devices of a run without a plan (default: this machine's GPUs on CUDA
            (``config.device``), its cores otherwise).

    Raises:
        PlanError: a plan file or placement that cannot be read or does not fit the graph.
        ConfigError: ``config.device`` is ``"cuda"`` on a machine without CUDA.
    """
    from flowrl.planners.forms import read_plan, run_plan

    if config.plan is None:
        cuda = resolve_device(config.device) == "cuda"
        n = n_devices or (torch.cuda.device_count() if cuda else os.cpu_count() or 1)
        plan = run_plan(graph, graph.max_staleness(config.max_staleness), n, cluster=f"cuda:{n}" if cuda else None)
        return Placement(plan=plan, source=f"default ({plan.strategy})")
    plan = read_plan(config.plan, graph)
    cores = os.cpu_count() or 1
    pin = plan.cluster.startswith("cpu") and all(d < cores for ds in Placement(plan=plan).devices.values() for d in ds)
    return Placement(plan=plan, pin=pin, source=f"plan:{config.plan}")
