"""One weight edge's route in one process (:class:`WeightRoute`): its publishing half and its receiving half.

Where a run starts, its backend decides each weight edge's route once, as plain data
(``edges.TransportSpec``: ``transport_specs``; in a torchrun job from
``flowrl.placement.weight_routes``' rule, ``backends/torchrun/backend._route``), and hands the specs
to every process of the run. Each process opens them as route objects (:class:`WeightRoutes`, one per
process) and hands each program the objects, never a name:

- the publishing program takes ``route.publisher()`` and publishes every version into it;
- the receiving program takes ``route.receiver()`` and fetches from it; an engine whose weights move
  on into worker processes of its own (vLLM) is handed the route itself and asks it which hop takes
  them there (:meth:`WeightRoute.hop`: ``"direct"``, ``"file"`` or ``"group"``).

A spec's ``route`` says how each half opens: ``"transport"`` through the registry
(``flowrl.runtime.transports.registry``: a built-in, or a user's transport registered with
``register_transport``, one row), ``"collective"`` as this rank's shared collective transport of
the edge (opened during torchrun job setup: ``torchrun_edges.shared``), ``"direct"`` as the policy
ranks' sending into vLLM's workers (``direct_route``: the policy's half is ``DirectPolicy``; the
generator's is a :class:`DirectEnd`, the edge's channel over the job's store). In one process both
halves of an edge are one object (the local backend's in-process transport).

Example:
    >>> import torch
    >>> from flowrl.runtime.weights.edges import TransportSpec
    >>> routes = WeightRoutes((TransportSpec(src="policy", dst="gen", name="inprocess"),))
    >>> routes.writer("policy", "gen").publish({"w": torch.ones(2)}, version=1)
    >>> target = {"w": torch.zeros(2)}
    >>> routes.reader("policy", "gen").fetch_into(target), target["w"].tolist(), routes.route("policy", "gen").hop(lora=False)
    (1, [1.0, 1.0], 'group')
    >>> routes.close()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from flowrl.errors import TransportError
from flowrl.runtime.transports.registry import create_transport, import_transport
from flowrl.runtime.weights.edges import ROUTE_COLLECTIVE, ROUTE_DIRECT, SHARED_DIRECTORY, TransportSpec

if TYPE_CHECKING:
    from flowrl.runtime.transports.weight_transport import WeightTransport

__all__ = ["WeightRoute", "WeightRoutes", "DirectEnd", "Hop"]

#: How weights go on from the receiving process into an engine's own workers (vLLM's): the policy's
#: ranks send into them (``"direct"``), through a file, or over the engine's weight-sync group.
Hop = Literal["direct", "file", "group"]


class DirectEnd:
    """The generator's half of a direct route: the edge's channel over the torchrun job's store, through
    which its engine meets the policy's ranks (``vllm_direct``); no tensor passes through it."""

    def __init__(self, spec: TransportSpec) -> None:
        self.spec = spec
        self._channel: Any = None

    @property
    def channel(self) -> Any:
        """The edge's ``vllm_direct.Channel`` (made on first use, inside the job)."""
        if self._channel is None:
            from flowrl.runtime.weights.direct_route import store_channel
            from flowrl.runtime.weights.torchrun_edges import channel

            self._channel = store_channel(channel(self.spec.src, self.spec.dst))
        return self._channel

    def close(self) -> None:
        """Nothing: the engine closes the route's group (``VLLMGenerator.close``)."""


class WeightRoute:
    """One weight edge's route in this process, from its spec; each half opened on first use.

    Attributes:
        spec: the edge's ``TransportSpec`` (its ends, its route, its transport and options).
    """

    def __init__(self, spec: TransportSpec) -> None:
        self.spec = spec
        self._writer: Any = None
        self._reader: Any = None

    @property
    def direct(self) -> bool:
        """Whether the policy's ranks send straight into the engine's workers (``direct_route``)."""
        return self.spec.route == ROUTE_DIRECT

    def _name(self) -> str:
        return f"weight edge {self.spec.src!r} -> {self.spec.dst!r}"

    def _open(self, options: dict[str, Any]) -> WeightTransport:
        spec = self.spec
        if spec.route == ROUTE_COLLECTIVE:
            from flowrl.runtime.weights.torchrun_edges import shared

            return shared(options)  # the rank's one instance of the edge's collective transport
        import_transport(spec.name, spec.factory)
        return create_transport(spec.name, **options)  # the registry's row: a built-in or a user's

    def publisher(self) -> WeightTransport:
        """The publishing half (opened on first use).

        Raises:
            TransportError: on a direct route, whose policy ranks send on request (``DirectPolicy``).
        """
        if self.direct:
            raise TransportError(
                f"{self._name()} takes the direct route: the policy's ranks send into vLLM's workers on request "
                "(direct_route.DirectPolicy wraps the policy's program); there is nothing to publish into"
            )
        if self._writer is None:
            self._writer = self._open(self.spec.writer_options)
        return self._writer

    def receiver(self) -> Any:
        """The receiving half: a ``WeightTransport`` (the publisher's object when it lives in this
        process), or a :class:`DirectEnd` on a direct route."""
        if self._writer is not None:
            return self._writer
        if self._reader is None:
            self._reader = DirectEnd(self.spec) if self.direct else self._open(self.spec.reader_options)
        return self._reader

    def hop(self, *, lora: bool) -> Hop:
        """How the weights this route delivers go on into an engine's own workers: ``"direct"`` on the
        direct route, ``"file"`` for the file transport or LoRA adapters (they go as a peft
        directory), else ``"group"`` (vLLM's weight-sync group from the receiving process's copy)."""
        if self.direct:
            return "direct"
        return "file" if lora or self.spec.name == SHARED_DIRECTORY else "group"

    def close(self) -> None:
        """Close the halves this process opened."""
        for half in {id(h): h for h in (self._reader, self._writer) if h is not None}.values():
            half.close()
        self._writer = self._reader = None


class WeightRoutes:
    """The routes of one process, one per weight edge it has a spec of, keyed by ``(src, dst)``.

    In the local backend one instance serves every program, so both halves of an in-process edge are
    one object; in a worker process it holds only that worker's halves.
    """

    def __init__(self, specs: tuple[TransportSpec, ...]) -> None:
        self._routes = {(s.src, s.dst): WeightRoute(s) for s in specs}

    def route(self, src: str, dst: str) -> WeightRoute | None:
        """Edge ``src -> dst``'s route (None for an edge without a spec: a program built outside a run)."""
        return self._routes.get((src, dst))

    def _of(self, src: str, dst: str) -> WeightRoute:
        route = self._routes.get((src, dst))
        if route is None:
            raise TransportError(f"weight edge {src!r} -> {dst!r} has no route in this process; its routes: {sorted(self._routes)}")
        return route

    def writer(self, src: str, dst: str) -> WeightTransport:
        """The publishing half of edge ``src -> dst``."""
        return self._of(src, dst).publisher()

    def reader(self, src: str, dst: str) -> Any:
        """The receiving half of edge ``src -> dst`` (``WeightRoute.receiver``)."""
        return self._of(src, dst).receiver()

    def close(self) -> None:
        for route in self._routes.values():
            route.close()
