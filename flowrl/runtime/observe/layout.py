"""The layout a run ran: per device node, its devices, the sub-mesh its program built and what runs there.

The run's first metrics row carries it under ``"layout"`` (``RowSink``): ``{node: record}``, each record a
``LayoutRecord`` as builtins::

    {"gen": {"devices": [0, 1, 2, 3], "mesh": {"dp": 2, "tp": 2}, "groups": [[0, 1], [2, 3]],
             "runs": "2 replicas, each 2 tensor-parallel ranks holding their shards"},
     "policy": {"devices": [4, 5], "mesh": {"dp": 2}, "groups": [[4, 5]], "runs": "2 data-parallel replicas"}}

``mesh`` holds the axes of size > 1 as the program runs them and ``groups`` the ranks that work as
one copy of the model (a tp group, a replica's ranks; the dp group of a policy's replicas).
A program over several torchrun ranks reports its own record from what it built (its first step's
info, key ``"layout"``: ``rank_programs``); a node whose program is one process (the local and process
backends, a node on one rank) gets ``one_process`` from the placement and ``flowrl.mesh_support``'s words.
``layout_text`` is the one-line form (``policy: dp=2 over ranks [4, 5] (2 data-parallel replicas)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from flowrl.backend_traits import backend_traits
from flowrl.mesh_support import MESH_AXES, mesh_support

__all__ = ["LAYOUT_KEY", "LayoutRecord", "record", "one_process", "layout_text"]

#: The first row's key holding the layout.
LAYOUT_KEY = "layout"


class LayoutRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One node's layout as it ran (module docstring).

    Attributes:
        devices: its devices (ranks under torchrun), in mesh order.
        mesh: axis -> size, the axes of size > 1 its program runs (empty: one device).
        groups: the devices working as one copy of its model, per copy.
        runs: what runs, in words.
    """

    devices: list[int]
    mesh: dict[str, int]
    groups: list[list[int]]
    runs: str


def record(devices: Sequence[int], mesh: Mapping[str, int], groups: Sequence[Sequence[int]], runs: str) -> dict[str, Any]:
    """A ``LayoutRecord`` as builtins (what a program puts in its info, what the row holds).

    Example:
        >>> record([1, 2], {"dp": 2, "tp": 1}, [[1, 2]], "2 data-parallel replicas")["mesh"]
        {'dp': 2}
    """
    axes = {a: int(mesh[a]) for a in MESH_AXES if int(mesh.get(a, 1)) > 1}
    return msgspec.to_builtins(LayoutRecord(devices=[int(d) for d in devices], mesh=axes, groups=[[int(d) for d in g] for g in groups], runs=runs))


def one_process(kind: str, devices: Sequence[int], mesh_shape: Sequence[int], backend: str, *, engine: str | None = None) -> dict[str, Any] | None:
    """The record of a node whose program is one process: on its one rank under torchrun, or on its
    devices under a one-process backend (where a dp mesh is that process over the cores, ``mesh_support``);
    None for a node on several ranks of a job, whose program reports what it built itself."""
    ids = list(devices)
    if backend_traits(backend).ranks and len(ids) > 1:
        return None
    if backend_traits(backend).ranks or len(ids) == 1:
        where = f"rank {ids[0]}" if backend_traits(backend).ranks else f"device {ids[0]}"
        return record(ids, {}, [ids], f"one process on {where}")
    shape = dict(zip(MESH_AXES, mesh_shape))
    runs = "; ".join(
        mesh_support(kind, a, backend, engine=engine).how.format(n=len(ids), size=s, devices=ids, first=ids[0], idle=ids[1:], axis=a)
        for a, s in shape.items() if s > 1
    )
    return record(ids, shape, [ids], runs)


def layout_text(node: str, rec: Mapping[str, Any], *, ranks: bool = True) -> str:
    """One line for a node's record.

    Example:
        >>> layout_text("gen", record([0, 1, 2, 3], {"dp": 2, "tp": 2}, [[0, 1], [2, 3]], "2 replicas of 2 tp ranks"))
        'gen: dp=2 tp=2 over ranks [0, 1, 2, 3] (2 replicas of 2 tp ranks)'
    """
    mesh = " ".join(f"{a}={s}" for a, s in rec["mesh"].items()) or "one device"
    return f"{node}: {mesh} over {'ranks' if ranks else 'devices'} {rec['devices']} ({rec['runs']})"
