"""Where a run's executors run, read from its ``Plan``: devices per node, colocation groups, pinning.

The runtime reads placement only from a ``Plan`` (``flowrl.planners``): a plan file, a JSON placement
(both read by ``planners.forms.read_plan``, the one reader for every backend) or, without
``--plan``, the run strategy for the staleness bound (``planners.forms.run_plan``: every heavy node
colocated for k = 0, generators and trainers on disjoint halves of the cores for k >= 1).

Executors whose device sets overlap form one colocation group (``planners.schedule.colocation_groups``)
and never run a step at the same time; executors on disjoint devices run concurrently. On CPU a
device is a core: executors are pinned to their cores when the placement comes from a CPU plan file.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import msgspec

from flowrl.graph.ir import Graph
from flowrl.graph.nodes import DEVICE_KINDS
from flowrl.planners.plan_data import Plan

if TYPE_CHECKING:
    from flowrl.runtime.config import RunConfig

__all__ = ["Placement", "run_placement", "HEAVY_KINDS"]

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


def run_placement(graph: Graph, config: RunConfig, *, n_devices: int | None = None) -> Placement:
    """The placement a run of ``graph`` uses: ``config.plan``'s, or the run strategy for its staleness bound.

    Args:
        graph, config: the run.
        n_devices: devices of a run without a plan (default: this machine's cores).

    Raises:
        PlanError: a plan file or placement that cannot be read or does not fit the graph.
    """
    from flowrl.planners.forms import read_plan, run_plan

    if config.plan is None:
        plan = run_plan(graph, graph.max_staleness(config.max_staleness), n_devices or os.cpu_count() or 1)
        return Placement(plan=plan, source=f"default ({plan.strategy})")
    plan = read_plan(config.plan, graph)
    cores = os.cpu_count() or 1
    pin = plan.cluster.startswith("cpu") and all(d < cores for ds in Placement(plan=plan).devices.values() for d in ds)
    return Placement(plan=plan, pin=pin, source=f"plan:{config.plan}")
