"""Reading a placement into a ``Plan``: the one reader of ``--plan`` files for every backend.

``--plan FILE`` takes either form, and :func:`read_plan` turns both into a ``Plan``:

- a plan file from ``flowrl plan -o`` (``load_plan``: the whole struct, with its predictions);
- a *placement*: JSON naming each device node's devices (ranks under torchrun, cores otherwise),
  ``{"gen": [0], "policy": [1, 2]}``, where a node may also give named mesh axes,
  ``{"gen": {"ranks": [1, 2, 3, 4], "mesh": {"dp": 2, "tp": 2}}}`` (names among ``pp``, ``dp``,
  ``tp``; their product is the number of ranks; without ``mesh`` the ranks are data-parallel). The
  mesh is laid out in the plan's axis order (``pp``, ``dp``, ``tp``: tp innermost) whatever order
  the JSON gives. It becomes a plan without predictions (``strategy="manual"``).

Either way every device node of the graph (``DEVICE_KINDS``) must be placed, and only those; a
misspelt name is refused with the closest one. The same module builds the plans of a run without
``--plan`` (``run_plan``: the run strategies of ``flowrl.planners.strategies``).

Example:
    >>> from flowrl.examples import build_example
    >>> plan = placement_plan(build_example("llamarl"), {"gen": (0,), "policy": (1, 2)})
    >>> str(plan), plan.placements["aipo"].devices
    ('gen:d1@0 | policy:d2@1-2', (1, 2))
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

import msgspec

from flowrl.errors import PlanError
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import DEVICE_KINDS
from flowrl.planners.parallel import AXES, ParallelDims
from flowrl.planners.plan_data import MAX_PLAN_BYTES, NodePlacement, Plan, load_plan
from flowrl.planners.strategies import run_devices, run_strategy

__all__ = ["NodeMesh", "PlacementForm", "read_plan", "placement_plan", "run_plan", "decode_placement"]

_EXAMPLE = '{"gen": [0], "policy": [1, 2]} or {"policy": [0], "gen": {"ranks": [1, 2], "mesh": {"tp": 2}}}'


class NodeMesh(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One node of a placement with named mesh axes.

    Attributes:
        ranks: its devices (ranks under torchrun, cores otherwise), in mesh order.
        mesh: axis name -> size (names among ``pp``, ``dp``, ``tp``); empty: ``{"dp": len(ranks)}``.
    """

    ranks: tuple[int, ...]
    mesh: dict[str, int] = {}


#: The placement form: node name -> its devices, or its devices and mesh.
PlacementForm = dict[str, tuple[int, ...] | NodeMesh]


def _dims(where: str, node: str, value: tuple[int, ...] | NodeMesh) -> tuple[tuple[int, ...], ParallelDims]:
    if not isinstance(value, NodeMesh):
        return value, ParallelDims(dp=max(1, len(value)))
    ranks, mesh = value.ranks, value.mesh or {"dp": len(value.ranks)}
    unknown = sorted(set(mesh) - set(AXES))
    if unknown:
        raise PlanError(f"{where}: node {node!r} has mesh axis/axes {unknown}; the axes are {list(AXES)}")
    if not all(v >= 1 for v in mesh.values()):
        raise PlanError(f"{where}: node {node!r} has mesh {mesh}; every axis size must be an integer >= 1")
    dims = ParallelDims(**mesh)
    if dims.size != len(ranks):
        shape = " x ".join(f"{k}={v}" for k, v in mesh.items())
        raise PlanError(
            f"{where}: node {node!r} has mesh {shape} = {dims.size} ranks but {len(ranks)} rank(s) {list(ranks)}; "
            "the product of the mesh axes must equal the number of ranks"
        )
    return ranks, dims


def _check_nodes(graph: Graph, placed: list[str], where: str) -> None:
    """Every device node placed, and nothing else (a misspelt name is named with the closest one)."""
    heavy = [n.name for n in graph.nodes if n.kind in DEVICE_KINDS]
    unknown = [n for n in placed if n not in heavy]
    if unknown:
        hints = [f"{u!r} -> did you mean {close[0]!r}?" for u in unknown if (close := difflib.get_close_matches(u, heavy, n=1))]
        raise PlanError(
            f"{where} places {unknown}, which are not device nodes of graph {graph.name!r} (those are {heavy})"
            + (f"; {'; '.join(hints)}" if hints else "")
        )
    for n in heavy:
        if n not in placed:
            raise PlanError(f"{where} gives node {n!r} no devices; every generator, policy and reference needs at least one")


def placement_plan(
    graph: Graph,
    devices: dict[str, tuple[int, ...]],
    dims: dict[str, ParallelDims] | None = None,
    *,
    cluster: str = "placement",
    strategy: str = "manual",
    max_staleness: int | None = None,
) -> Plan:
    """A plan without predictions that puts each device node on ``devices`` (data-parallel unless ``dims``
    say otherwise); losses run on their policy's devices, every other node on the host.

    Raises:
        PlanError: a node's devices repeat or are negative, or its dims do not hold them.
    """
    dims = dims or {}
    k = max_staleness if max_staleness is not None else graph.max_staleness()
    placements: dict[str, NodePlacement] = {}
    for node in graph.nodes:
        owner = node.name
        if node.kind == "loss":
            owner = next((u.name for u in graph.users(node.name) if u.kind == "policy"), node.name)
        if owner not in devices:
            placements[node.name] = NodePlacement(kind=node.kind, notes=("host CPU",))
            continue
        devs = tuple(devices[owner])
        if len(set(devs)) != len(devs) or (devs and min(devs) < 0):
            raise PlanError(f"node {owner!r} is placed on devices {list(devs)}: devices must be distinct and >= 0")
        d = dims.get(owner, ParallelDims(dp=max(1, len(devs))))
        placements[node.name] = NodePlacement(kind=node.kind, devices=devs, dims=d, axes=AXES, mesh_shape=d.mesh_shape)
    return Plan(graph=graph.name, cluster=cluster, strategy=strategy, family="manual", max_staleness=k, workload=None, placements=placements)


def decode_placement(data: bytes, graph: Graph, *, where: str) -> Plan:
    """A placement's JSON (``PlacementForm``) as a plan of ``graph``.

    Raises:
        PlanError: naming ``where``, what is wrong and the expected form.
    """
    try:
        raw = msgspec.json.decode(data, type=dict[str, msgspec.Raw])
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PlanError(f"{where}: neither a flowrl plan nor a placement ({exc}); write a placement like {_EXAMPLE}") from None
    _check_nodes(graph, list(raw), where)
    form: PlacementForm = {}
    for name, value in raw.items():  # one at a time, so that an error names its node
        try:
            form[name] = msgspec.json.decode(value, type=tuple[int, ...] | NodeMesh)
        except msgspec.ValidationError as exc:
            raise PlanError(
                f"{where}: node {name!r} must be a list of devices or {{\"ranks\": [...], \"mesh\": {{\"tp\": 2}}}} ({exc})"
            ) from None
    devices, dims = {}, {}
    for name, value in form.items():
        devices[name], dims[name] = _dims(where, name, value)
    return placement_plan(graph, devices, dims, cluster=f"placement:{where.removeprefix('--plan ')}")


def read_plan(path: str | os.PathLike[str], graph: Graph) -> Plan:
    """The plan a ``--plan`` file gives for ``graph``: a plan file or a placement (module docstring).

    Raises:
        PlanError: naming the file: missing, unreadable, neither form, made for another graph, or
            not placing exactly the graph's device nodes.
    """
    where = f"--plan {path}"
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"plan file {str(p)!r} does not exist; write one with 'flowrl plan {graph.name} --cluster SPEC -o {p}' or a placement like {_EXAMPLE}")
    if p.stat().st_size > MAX_PLAN_BYTES:
        raise PlanError(f"plan file {str(p)!r} is over the {MAX_PLAN_BYTES}-byte limit; is it a flowrl plan?")
    try:
        data = p.read_bytes()
        raw = json.loads(data)
    except OSError as exc:
        raise PlanError(f"cannot read plan file {str(p)!r}: {exc.strerror}") from None
    except ValueError as exc:  # UnicodeDecodeError included
        raise PlanError(f"plan file {str(p)!r} is not valid JSON: {exc}") from None
    if not (isinstance(raw, dict) and "placements" in raw):
        return decode_placement(data, graph, where=where)
    plan = load_plan(p)
    if plan.graph != graph.name:
        raise PlanError(f"plan {str(path)!r} was made for graph {plan.graph!r}, not {graph.name!r}; re-plan with 'flowrl plan {graph.name} ...'")
    for node in graph.nodes:
        if node.kind in DEVICE_KINDS and not (node.name in plan.placements and plan.placements[node.name].devices):
            raise PlanError(f"plan {str(path)!r} places no devices for node {node.name!r}; re-plan this graph")
    return plan


def run_plan(graph: Graph, max_staleness: int, n_devices: int, *, cluster: str | None = None) -> Plan:
    """The plan of a run without ``--plan``: the run strategy for ``max_staleness`` on ``n_devices``."""
    strategy = run_strategy(max_staleness, n_devices)
    kinds = {n.name: n.kind for n in graph.nodes if n.kind in DEVICE_KINDS}
    return placement_plan(
        graph, run_devices(kinds, strategy, n_devices), cluster=cluster or f"cpu:{n_devices}", strategy=strategy, max_staleness=max_staleness
    )
