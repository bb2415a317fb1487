"""A placement's JSON form: what a user writes for ``--plan`` instead of a plan file, read and written.

A *placement* names each device node's devices (ranks under torchrun, cores or GPUs otherwise),
``{"gen": [0], "policy": [1, 2]}``, where a node may also give named mesh axes,
``{"gen": {"ranks": [1, 2, 3, 4], "mesh": {"dp": 2, "tp": 2}}}`` (names among ``pp``, ``dp``,
``tp``; their product is the number of ranks; without ``mesh`` the ranks are data-parallel), and
``ep``, expert parallelism, a split of ``dp`` that takes no ranks of its own (``{"ep": 2}`` on two
ranks: dp=2 split into one expert-parallel group of 2; ``NodeMesh.ep``). The
mesh is laid out in ``AXES`` order (``pp``, ``dp``, ``tp``: tp innermost) whatever order the JSON
gives. Every device node of the graph (``DEVICE_KINDS``) must be placed, and only those; a misspelt
name is refused with the closest one. Reading decodes with msgspec and never executes code.

(``--plan`` also takes a plan file from ``flowrl plan -o``; the planner reads those,
``flowrl.planners.forms.read_placement``, and gives the same struct.)

Example:
    >>> from flowrl.examples import build_example
    >>> p = decode_placement(b'{"gen": {"ranks": [0, 1], "mesh": {"tp": 2}}, "policy": [2]}', build_example("llamarl"), where="example")
    >>> str(p), placement_to_json(p)
    ('gen:t2@0-1 | policy:d1@2', '{"gen":{"ranks":[0,1],"mesh":{"tp":2}},"policy":[2]}')
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from flowrl.errors import PlanError
from flowrl.fileio import read_bounded
from flowrl.graph.nodes import DEVICE_KINDS
from flowrl.placement.layout import AXES, NodeMesh, Placement

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph

__all__ = ["NodeForm", "PlacementForm", "EXAMPLE", "MAX_PLACEMENT_BYTES", "decode_placement", "load_placement", "placement_to_json", "check_placed"]

#: A placement as a user writes it, for messages.
EXAMPLE = '{"gen": [0], "policy": [1, 2]} or {"policy": [0], "gen": {"ranks": [1, 2], "mesh": {"tp": 2}}}'

#: Placement files larger than this are refused before parsing.
MAX_PLACEMENT_BYTES = 64 * 1024 * 1024


class NodeForm(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One node of a placement with named mesh axes.

    Attributes:
        ranks: its devices (ranks under torchrun, cores otherwise), in mesh order.
        mesh: axis name -> size (names among ``pp``, ``dp``, ``tp``, and ``ep``, which divides dp and is
            left out of the product); empty: ``{"dp": len(ranks)}``.
    """

    ranks: tuple[int, ...]
    mesh: dict[str, int] = {}


#: The placement form: node name -> its devices, or its devices and mesh.
PlacementForm = dict[str, tuple[int, ...] | NodeForm]


def _node_mesh(where: str, node: str, value: tuple[int, ...] | NodeForm) -> NodeMesh:
    ranks, mesh = (value, {}) if not isinstance(value, NodeForm) else (value.ranks, dict(value.mesh))
    if len(set(ranks)) != len(ranks) or (ranks and min(ranks) < 0):
        raise PlanError(f"{where}: node {node!r} is placed on devices {list(ranks)}: devices must be distinct and >= 0")
    unknown = sorted(set(mesh) - set(AXES) - {"ep"})
    if unknown:
        raise PlanError(f"{where}: node {node!r} has mesh axis/axes {unknown}; the axes are {list(AXES)}, and ep (a split of dp)")
    ep = mesh.pop("ep", 1)
    if not isinstance(ep, int) or ep < 1:
        raise PlanError(f"{where}: node {node!r} has ep={ep!r}; ep must be an integer >= 1 dividing its dp ranks")
    if not all(v >= 1 for v in mesh.values()):
        raise PlanError(f"{where}: node {node!r} has mesh {mesh}; every axis size must be an integer >= 1")
    if mesh and math.prod(mesh.values()) != len(ranks):
        shape = " x ".join(f"{k}={v}" for k, v in mesh.items())
        raise PlanError(
            f"{where}: node {node!r} has mesh {shape} = {math.prod(mesh.values())} ranks but {len(ranks)} rank(s) {list(ranks)}; "
            "the product of the mesh axes must equal the number of ranks"
        )
    if not ranks:
        raise PlanError(f"{where} gives node {node!r} no devices; every generator, policy and reference needs at least one")
    try:
        return NodeMesh(devices=tuple(ranks), mesh_shape=tuple(mesh.get(a, 1) for a in AXES) if mesh else (), ep=ep)
    except PlanError as exc:
        raise PlanError(f"{where}: node {node!r}: {exc}") from None


def check_placed(graph: Graph, placed: Iterable[str], where: str) -> None:
    """Every device node of ``graph`` placed, and nothing else (a misspelt name is named with the closest one).

    Raises:
        PlanError: naming ``where``, the nodes wrongly placed or missing, and the device nodes.
    """
    placed = list(placed)
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


def decode_placement(data: bytes, graph: Graph, *, where: str) -> Placement:
    """A placement's JSON (``PlacementForm``) as the placement of ``graph``.

    Raises:
        PlanError: naming ``where``, what is wrong and the expected form.
    """
    try:
        raw = msgspec.json.decode(data, type=dict[str, msgspec.Raw])
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PlanError(f"{where}: neither a flowrl plan nor a placement ({exc}); write a placement like {EXAMPLE}") from None
    check_placed(graph, raw, where)
    nodes: dict[str, NodeMesh] = {}
    for name, value in raw.items():  # one at a time, so that an error names its node
        try:
            form = msgspec.json.decode(value, type=tuple[int, ...] | NodeForm)
        except msgspec.ValidationError as exc:
            raise PlanError(f"{where}: node {name!r} must be a list of devices or {{\"ranks\": [...], \"mesh\": {{\"tp\": 2}}}} ({exc})") from None
        nodes[name] = _node_mesh(where, name, form)
    order = [n.name for n in graph.nodes if n.name in nodes]  # graph order, whatever the JSON's
    return Placement(nodes={n: nodes[n] for n in order}, source=where)


def load_placement(path: str | os.PathLike[str], graph: Graph) -> Placement:
    """The placement of ``graph`` a JSON placement file gives (module docstring).

    Raises:
        PlanError: naming the file: missing, too large, unreadable, or not a placement of ``graph``.
    """
    p = Path(path)
    data = read_bounded(p, limit=MAX_PLACEMENT_BYTES, what="placement file", missing_hint=f"write one like {EXAMPLE}", error=PlanError)
    return decode_placement(data, graph, where=str(p))


def placement_to_json(placement: Placement) -> str:
    """The placement's nodes in the JSON form ``decode_placement`` reads back (data-parallel nodes as plain lists)."""
    form: PlacementForm = {}
    for name, m in placement.nodes.items():
        mesh = m.sizes()
        form[name] = m.devices if set(mesh) <= {"dp"} else NodeForm(ranks=m.devices, mesh=mesh)
    return msgspec.json.encode(form).decode()
