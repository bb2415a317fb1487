"""The ``Placement`` struct: each device node's devices and mesh, the run strategy, colocation groups.

A placement is what the runtime needs to know of where a run's nodes go, and nothing else: for
each device node (``graph.nodes.DEVICE_KINDS``: generators, policies, references) its device ids
(ranks under torchrun, cores or GPUs otherwise) laid out as a mesh with the named axes ``AXES``
(``pp`` outermost, ``tp`` innermost). Losses run inside their policy's step and light nodes
(sources, rule scorers) on the host, so neither is placed. Nodes whose device sets overlap are
*colocated* (``Placement.groups``): the runtime never runs two steps of one group at a time.

Who makes one: the planner (``Plan.placement()``), the JSON form a user writes
(``flowrl.placement.forms``), or the run strategy of a run without either
(``flowrl.placement.default``). Pure data: no torch, no I/O.

The module is ``layout``, not ``data``, and the runtime's completion of a placement is
``flowrl.runtime.control.executor_placement``, not ``placement``: neither name shadows a package
(``flowrl.data``, ``flowrl.placement``).

Example:
    >>> p = Placement(nodes={"gen": NodeMesh(devices=(0,)), "policy": NodeMesh(devices=(1, 2))})
    >>> str(p), p.groups()
    ('gen:d1@0 | policy:d2@1-2', [['gen'], ['policy']])
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import msgspec
import networkx as nx

from flowrl.errors import PlanError

__all__ = ["AXES", "NodeMesh", "Placement", "colocation_groups", "device_ranges", "share_devices"]

#: Mesh axis names, outermost first; the order of ``mesh_shape`` and of a ``DeviceMesh``'s dims.
AXES: tuple[str, ...] = ("pp", "dp", "tp")

_STRUCT = dict(frozen=True, kw_only=True, forbid_unknown_fields=True)


class NodeMesh(msgspec.Struct, **_STRUCT):
    """One device node's devices, laid out as a mesh along ``AXES``.

    Attributes:
        devices: its device ids in mesh order (distinct, >= 0, at least one).
        mesh_shape: sizes along ``AXES`` (pp, dp, tp), whose product is ``len(devices)``; empty:
            every device a data-parallel replica, ``(1, len(devices), 1)``.
        ep: expert parallelism, a split of the ``dp`` axis (not a further axis: it takes no devices of
            its own): each group of ``ep`` consecutive dp ranks holds ``1/ep`` of every mixture-of-experts
            layer's experts and exchanges tokens among them (``flowrl.runtime.parallel.expert_parallel``);
            ``dp / ep`` such groups are replicas of each other. It divides ``dp``; 1: every rank holds
            every expert. Whether the node's program runs it (a policy on a mixture of experts) is
            ``flowrl.mesh_support``'s.

    Example:
        >>> NodeMesh(devices=(0, 1, 2, 3), ep=2).short()
        'd4e2'
        >>> NodeMesh(devices=(0, 1, 2), ep=2)
        Traceback (most recent call last):
        ...
        flowrl.errors.PlanError: a node on devices [0, 1, 2] has ep=2, which does not divide its dp=3 ranks: expert parallelism splits the dp axis into groups of ep ranks; pick an ep among [1, 3]
    """

    devices: tuple[int, ...]
    mesh_shape: tuple[int, ...] = ()
    ep: int = 1

    def __post_init__(self) -> None:
        if not self.devices or len(set(self.devices)) != len(self.devices) or min(self.devices) < 0:
            raise PlanError(f"a node is placed on devices {list(self.devices)}: devices must be distinct and >= 0, at least one")
        if not self.mesh_shape:
            msgspec.structs.force_setattr(self, "mesh_shape", (1, len(self.devices), 1))
        if len(self.mesh_shape) != len(AXES) or min(self.mesh_shape) < 1:
            raise PlanError(f"mesh shape {self.mesh_shape}: give one size >= 1 per axis {AXES}")
        if math.prod(self.mesh_shape) != len(self.devices):
            shape = " * ".join(f"{a}({s})" for a, s in zip(AXES, self.mesh_shape))
            raise PlanError(f"{shape} = {math.prod(self.mesh_shape)} != devices({len(self.devices)}) {list(self.devices)}")
        dp = self.mesh_shape[AXES.index("dp")]
        if not isinstance(self.ep, int) or self.ep < 1 or dp % self.ep:
            fits = [d for d in range(1, dp + 1) if dp % d == 0]
            raise PlanError(
                f"a node on devices {list(self.devices)} has ep={self.ep!r}, which does not divide its dp={dp} ranks: "
                f"expert parallelism splits the dp axis into groups of ep ranks; pick an ep among {fits}"
            )

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh's axis names, ``AXES``."""
        return AXES

    def size(self, axis: str) -> int:
        """The mesh's size along ``axis`` (``"dp"``, ``"tp"`` or ``"pp"``; ``"ep"``: the expert-parallel split of dp)."""
        return self.ep if axis == "ep" else self.mesh_shape[AXES.index(axis)]

    def sizes(self) -> dict[str, int]:
        """Every axis of size > 1, ``ep`` after ``AXES``: ``{"dp": 4, "ep": 2}``."""
        out = {a: s for a, s in zip(AXES, self.mesh_shape) if s > 1}
        if self.ep > 1:
            out["ep"] = self.ep
        return out

    def short(self) -> str:
        """The dims in the planner's compact form: ``d2t4`` (axes of size 1 left out, ``d1`` for one device; ``e2`` after dp: ep)."""
        return "".join(f"{a[0]}{self.size(a)}" for a in ("dp", "ep", "tp", "pp") if self.size(a) > 1) or "d1"


class Placement(msgspec.Struct, **_STRUCT):
    """Where a run's device nodes run (module docstring).

    Attributes:
        nodes: device node name -> its devices and mesh.
        strategy: how it was made: ``manual`` (a JSON placement), a planner strategy, or a run
            strategy (``all-colocated``, ``halves``: ``flowrl.placement.default``).
        pin: the device ids are CPU cores (a placement from a CPU plan): the local and process
            backends pin each executor to its cores where this machine has them all.
        source: where it came from, for messages (``"plan:plan.json"``, ``"default (halves)"``).
        offload: the nodes whose state the plan moves to host memory while a colocated node runs
            (a trainer's parameters, gradients and optimizer state; a vLLM engine asleep): what a
            run with ``offload="auto"`` does (``flowrl.runtime.programs.offload``).
    """

    nodes: dict[str, NodeMesh]
    strategy: str = "manual"
    pin: bool = False
    source: str = "manual"
    offload: tuple[str, ...] = ()

    @property
    def devices(self) -> dict[str, tuple[int, ...]]:
        """The devices of each placed node."""
        return {n: m.devices for n, m in self.nodes.items()}

    def mesh(self, name: str) -> NodeMesh:
        """Node ``name``'s mesh.

        Raises:
            PlanError: naming the placed nodes, when ``name`` is not one of them.
        """
        try:
            return self.nodes[name]
        except KeyError:
            raise PlanError(f"the placement ({self.source}) places no node {name!r}; it places {', '.join(self.nodes) or 'nothing'}") from None

    def groups(self) -> list[list[str]]:
        """Colocation groups: connected components of overlapping device sets (``colocation_groups``)."""
        return colocation_groups(self.devices)

    def threads_per_group(self, cpu_count: int | None = None) -> int:
        """Intra-op threads each concurrently running group may use without oversubscribing the cores."""
        cores = cpu_count or os.cpu_count() or 1
        return max(1, cores // max(1, len(self.groups())))

    def __str__(self) -> str:
        return " | ".join(f"{n}:{m.short()}@{device_ranges(m.devices)}" for n, m in self.nodes.items())


def colocation_groups(devices: Mapping[str, Sequence[int]]) -> list[list[str]]:
    """Connected components of nodes whose device sets overlap (nodes with no devices are left out).

    Example:
        >>> colocation_groups({"gen": (0, 1), "policy": (1, 2), "ref": (3,), "reward": ()})
        [['gen', 'policy'], ['ref']]
    """
    overlaps = nx.Graph()
    names = sorted(n for n, d in devices.items() if len(d))
    overlaps.add_nodes_from(names)
    overlaps.add_edges_from((a, b) for i, a in enumerate(names) for b in names[i + 1 :] if share_devices(devices[a], devices[b]))
    return sorted(sorted(c) for c in nx.connected_components(overlaps))


def share_devices(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether two device (or rank) sets share one; ranges (the search's meshes) are compared as intervals, in O(1)."""
    if isinstance(a, range) and isinstance(b, range) and a.step == 1 and b.step == 1:
        return max(a.start, b.start) < min(a.stop, b.stop)
    return not set(a).isdisjoint(b)


def device_ranges(ids: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8, 9, 11]`` -> ``"0-3,8-9,11"`` (ids in the order given).

    Example:
        >>> device_ranges(range(8))
        '0-7'
    """
    if isinstance(ids, range) and ids.step == 1 and len(ids):
        return f"{ids.start}-{ids.stop - 1}" if len(ids) > 1 else f"{ids.start}"
    parts: list[str] = []
    start = prev = None
    for d in ids:
        if start is None:
            start = prev = d
        elif d == prev + 1:  # type: ignore[operator]  # prev is set with start, one line up
            prev = d
        else:
            parts.append(f"{start}-{prev}" if prev != start else f"{start}")
            start = prev = d
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
    return ",".join(parts)
