"""Where executors run: the devices of each node, from a plan or a default, and the colocation groups.

Executors whose device sets overlap form one colocation group and never run a step at the same
time; executors on disjoint devices run concurrently. On CPU a device is a core: executors are
pinned to their cores when the placement comes from a plan.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import msgspec

from flowrl.errors import PlanError
from flowrl.graph.ir import Graph

if TYPE_CHECKING:
    from flowrl.planners.plan import Plan
    from flowrl.runtime.config import RunConfig

__all__ = ["Placement", "default_placement", "placement_from_plan", "run_placement", "HEAVY_KINDS"]

#: Kinds that run a model; the light ones (source, scorer) run beside them on no device of their own.
HEAVY_KINDS = frozenset({"generator", "policy", "reference"})


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Node name -> device ids (cores on CPU). Nodes absent from ``devices`` share none.

    Attributes:
        devices: the devices of each executor node.
        pin: pin executors to their cores (only meaningful on CPU, only when ids are real cores).
        source: where the placement came from ("default", "plan:<file>").
    """

    devices: dict[str, tuple[int, ...]]
    pin: bool = False
    source: str = "default"

    def groups(self) -> list[list[str]]:
        """Colocation groups: connected components of nodes whose device sets overlap."""
        names = sorted(self.devices)
        parent = {n: n for n in names}

        def find(n: str) -> str:
            while parent[n] != n:
                parent[n] = parent[parent[n]]
                n = parent[n]
            return n

        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if set(self.devices[a]) & set(self.devices[b]):
                    parent[find(a)] = find(b)
        out: dict[str, list[str]] = {}
        for n in names:
            out.setdefault(find(n), []).append(n)
        return sorted(out.values())

    def threads_per_group(self, cpu_count: int | None = None) -> int:
        """Intra-op threads each concurrently running group may use without oversubscribing."""
        cores = cpu_count or os.cpu_count() or 1
        return max(1, cores // max(1, len(self.groups())))


def default_placement(graph: Graph, max_staleness: int, cpu_count: int | None = None) -> Placement:
    """Colocated (every heavy node on every core) when k == 0, the synchronous baseline;
    otherwise generators and the policy on disjoint halves of the cores, so they overlap."""
    cores = cpu_count or os.cpu_count() or 1
    heavy = [n.name for n in graph.nodes if n.kind in HEAVY_KINDS]
    if max_staleness == 0 or cores < 2:
        return Placement(devices={n: tuple(range(cores)) for n in heavy}, source="default (colocated)")
    half = cores // 2
    trainer_side = {n.name for n in graph.nodes if n.kind in {"policy", "reference"}}
    devices = {n: tuple(range(half, cores)) if n in trainer_side else tuple(range(half)) for n in heavy}
    return Placement(devices=devices, source="default (disaggregated)")


def placement_from_plan(graph: Graph, plan: Plan, *, path: str = "plan") -> Placement:
    """The executors' devices as the plan places them; the plan must cover every heavy node."""
    if plan.graph != graph.name:
        raise PlanError(f"plan {path!r} was made for graph {plan.graph!r}, not {graph.name!r}; re-plan with 'flowrl plan {graph.name} ...'")
    devices: dict[str, tuple[int, ...]] = {}
    for node in graph.nodes:
        if node.kind not in HEAVY_KINDS:
            continue
        if node.name not in plan.placements:
            raise PlanError(f"plan {path!r} places no devices for node {node.name!r}; re-plan this graph")
        devices[node.name] = tuple(plan.placements[node.name].devices)
    cores = os.cpu_count() or 1
    pin = plan.cluster.startswith("cpu") and all(d < cores for ds in devices.values() for d in ds)
    return Placement(devices=devices, pin=pin, source=f"plan:{path}")


def run_placement(graph: Graph, config: RunConfig) -> Placement:
    """The placement a run of ``graph`` uses: ``config.plan``'s, or the default for its staleness bound."""
    k = config.max_staleness
    if k is None:
        k = min((e.max_staleness for e in graph.weight_edges), default=0)
    if config.plan is None:
        return default_placement(graph, k)
    from flowrl.planners.plan import load_plan

    return placement_from_plan(graph, load_plan(config.plan), path=config.plan)
