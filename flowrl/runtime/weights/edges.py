"""Each weight edge's route as plain data (``TransportSpec``): which way its weights go, by which transport, with which options.

Every backend calls :func:`transport_specs` once per run, where the run starts; each process opens the
specs it is handed as route objects (``flowrl.runtime.weights.route.WeightRoutes``). A spec's ``route``
says which way: ``"transport"`` (the registry's transport ``name``: a built-in or a user's registered
row), ``"collective"`` (a torchrun job's per-rank collective transport, opened during job setup:
``torchrun_edges``) or ``"direct"`` (a torchrun job's policy ranks send straight into vLLM's workers:
``direct_route``; ``name`` stays the graph's own transport, which this route does not use). A transport's traits
(``flowrl.runtime.transports.registry.TransportTraits``) decide its options: one that
``needs_segment`` gets a fresh shared-memory segment name, one that ``needs_directory`` a folder
under the run's directory. In a backend whose processes differ from edge end to edge end
(``crosses_processes``) a transport that cannot cross processes becomes shared memory, and a user
transport carries its factory's reference so that a worker can import it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from flowrl.graph.ir import Graph, WeightEdge
from flowrl.runtime.transports.registry import transport_reference, transport_traits

__all__ = ["TransportSpec", "RouteKind", "transport_specs", "SHARED_MEMORY", "SHARED_DIRECTORY", "ROUTE_TRANSPORT", "ROUTE_COLLECTIVE", "ROUTE_DIRECT"]

#: The built-in transport that carries weights between the processes of one machine.
SHARED_MEMORY = "shm"
#: The built-in transport that carries weights between machines through a directory they all see.
SHARED_DIRECTORY = "file"

#: The ways a weight edge's weights go (``TransportSpec.route``; module docstring).
RouteKind = Literal["transport", "collective", "direct"]
ROUTE_TRANSPORT: RouteKind = "transport"
ROUTE_COLLECTIVE: RouteKind = "collective"
ROUTE_DIRECT: RouteKind = "direct"


class TransportSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One weight edge's route on either side, as plain data: which way, which transport, its options.

    ``route``: which way the weights go (module docstring); ``name``: the transport that moves them
    (for ``"collective"`` the built-in ``collective``; for ``"direct"`` the graph's own, unused).
    ``writer_options`` open it on the policy's side, ``reader_options`` on the consumer's side;
    ``factory`` is a user transport's ``module:qualname`` (``registry.transport_reference``), so that
    a worker process that did not register it can (``""`` for a built-in).
    """

    src: str
    dst: str
    name: str
    route: RouteKind = ROUTE_TRANSPORT
    factory: str = ""
    writer_options: dict[str, Any] = {}
    reader_options: dict[str, Any] = {}


def transport_specs(
    graph: Graph,
    run_dir: str,
    *,
    crosses_processes: bool = False,
    choose: Callable[[WeightEdge], tuple[RouteKind, str]] | None = None,
    references: bool | None = None,
) -> tuple[TransportSpec, ...]:
    """Open options for each weight edge's transport.

    Args:
        graph: the run's graph.
        run_dir: a directory of the run, for transports that need one.
        crosses_processes: the backend puts an edge's ends in different processes: a transport that
            cannot cross them becomes ``SHARED_MEMORY``.
        choose: maps an edge to its route and the transport this backend uses for it (replaces the
            rule above; a torchrun job's: ``backends/torchrun/backend._route``).
        references: ship user transports' factory references (default: ``crosses_processes``).

    Raises:
        TransportError: an edge names a transport nobody registered, or (with ``references``) a user
            transport that another process cannot import.
    """
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    ship = crosses_processes if references is None else references
    specs = []
    for e in graph.weight_edges:
        route: RouteKind = ROUTE_TRANSPORT
        if choose is not None:
            route, name = choose(e)
        else:
            stays = not crosses_processes or transport_traits(e.transport).crosses_processes
            name = e.transport if stays else SHARED_MEMORY
        traits = transport_traits(name)
        writer: dict[str, Any] = {}
        reader: dict[str, Any] = {}
        opened_here = route == ROUTE_TRANSPORT  # else opened by the torchrun job, not the registry: no segment, folder or reference
        if opened_here and traits.needs_segment:
            seg = f"flowrl-{token}-{e.src}-{e.dst}"
            writer, reader = {"name": seg, "create": True}, {"name": seg, "create": False}
        elif opened_here and traits.needs_directory:
            directory = os.path.join(run_dir, f"weights-{e.src}-{e.dst}")
            writer = reader = {"directory": directory}
        factory = transport_reference(name) if ship and opened_here else ""
        specs.append(TransportSpec(src=e.src, dst=e.dst, name=name, route=route, factory=factory, writer_options=writer, reader_options=reader))
    return tuple(specs)
