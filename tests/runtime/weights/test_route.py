"""The weight route of an edge (``flowrl.runtime.weights.route``): every route a run can open passes the
transport conformance suite through its halves (``publisher()`` / ``receiver()``), opened from the
spec the run's backend writes for it, and each route names the hop into an engine's own workers.

The routes: the local backend's in-process edge (one object, both halves), the process backend's
(the edge moves into shared memory, each half opened by its own process's route), the file
transport, a user's registered transport (its factory shipped by reference) and a torchrun job's
collective edge (this rank's shared transport, both roles on one rank of a one-rank gloo world).
The direct route and the hop into vLLM owe the engine more (the prefix cache reset after an update):
``tests/operators/test_vllm_direct_engine.py`` and ``test_route_into_vllm.py`` here (vLLM, --runslow).
"""

from __future__ import annotations

import datetime
import itertools
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from flowrl.errors import TransportError
from flowrl.examples.llamarl import build_llamarl
from flowrl.runtime.transports.file import FileTransport
from flowrl.runtime.transports.registry import register_transport
from flowrl.runtime.transports.weight_transport import layout_of
from flowrl.runtime.weights.edges import ROUTE_COLLECTIVE, ROUTE_DIRECT, TransportSpec, transport_specs
from flowrl.runtime.weights.route import DirectEnd, WeightRoute, WeightRoutes
from tests.runtime.transports.conformance import TransportConformance

USER = "test-route-user-file"


class UserFileTransport(FileTransport):
    """A user's transport: the file transport under a name of its own, registered by the test."""


def _spec(tmp_path: Path, transport: str, *, crosses_processes: bool) -> TransportSpec:
    """The spec a run writes for llamarl's one weight edge over ``transport``."""
    (spec,) = transport_specs(build_llamarl(transport=transport), str(tmp_path), crosses_processes=crosses_processes)
    return spec


class _Cheap:
    concurrent_versions = 30
    random_examples = 3


class TestLocalInProcessRouteConformance(_Cheap, TransportConformance):
    def open_pair(self, tmp_path):
        route = WeightRoute(_spec(tmp_path, "inprocess", crosses_processes=False))
        return route.publisher(), route.receiver()  # one process: one object serves both halves


class TestProcessBackendRouteConformance(_Cheap, TransportConformance):
    def open_pair(self, tmp_path):
        spec = _spec(tmp_path, "inprocess", crosses_processes=True)
        assert spec.name == "shm" and spec.writer_options["create"] and not spec.reader_options["create"]
        return WeightRoute(spec).publisher(), WeightRoute(spec).receiver()  # each end's process opens its own half


class TestFileRouteConformance(_Cheap, TransportConformance):
    def open_pair(self, tmp_path):
        spec = _spec(tmp_path, "file", crosses_processes=True)
        return WeightRoute(spec).publisher(), WeightRoute(spec).receiver()


class TestUserTransportRouteConformance(_Cheap, TransportConformance):
    def open_pair(self, tmp_path):
        register_transport(USER, UserFileTransport, replace=True)
        spec = _spec(tmp_path, USER, crosses_processes=True)
        assert spec.name == USER and spec.factory == f"{__name__}:UserFileTransport"  # a worker imports it by this
        writer, reader = WeightRoute(spec).publisher(), WeightRoute(spec).receiver()
        assert isinstance(writer, UserFileTransport) and isinstance(reader, UserFileTransport)
        return writer, reader


# -- a torchrun job's collective edge: this rank's one shared transport, through its route -------------
_CHANNELS = itertools.count()


@pytest.fixture(scope="module")
def one_rank_world():
    """A one-rank gloo world (the collective transport's default group), ended after the module."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


class _CollectiveRoute:
    """Both halves of a collective edge's route on one rank (trainer and generator), opened as a torchrun
    job opens them (``torchrun_edges.open_edges``, then the route's ``shared`` handle) on the first
    publish, from that state's names, shapes and dtypes (the suite does not declare them up front)."""

    name = "collective"

    def __init__(self) -> None:
        self._half: Any = None
        self._closed = False

    def publish(self, state, version):
        if self._half is None and not self._closed:
            from flowrl.placement.resharding import replicated
            from flowrl.runtime.weights.torchrun_edges import COLLECTIVE, open_edges

            layout = layout_of(state, transport=COLLECTIVE)
            options = msgspec.json.decode(msgspec.json.encode({
                "params": {s.name: {"shape": list(s.shape), "dtype": s.dtype} for s in layout.tensors},
                "trainer_layout": msgspec.to_builtins(replicated((0,))), "generator_layout": msgspec.to_builtins(replicated((0,))),
                "channel": f"route-test-{next(_CHANNELS)}", "timeout_s": 30.0,
            }))
            open_edges({options["channel"]: options}, {options["channel"]: None}, 0, torch.device("cpu"))
            spec = TransportSpec(src="policy", dst="gen", name=COLLECTIVE, route=ROUTE_COLLECTIVE, writer_options=options, reader_options=options)
            self._route = WeightRoute(spec)
            self._half = self._route.publisher()
            assert self._route.receiver() is self._half  # one rank, both roles: one handle
        if self._half is None:
            raise TransportError("collective route: publish() called after close()")
        self._half.publish(state, version)

    def latest_version(self):
        if self._half is None:
            if self._closed:
                raise TransportError("collective route: latest_version() called after close()")
            return -1
        return self._half.latest_version()

    def fetch_into(self, target, *, newer_than=-1):
        if self._half is None:
            if self._closed:
                raise TransportError("collective route: fetch_into() called after close()")
            return None
        return self._half.fetch_into(target, newer_than=newer_than)

    def close(self):
        from flowrl.runtime.weights.torchrun_edges import close_edges

        self._closed = True
        if self._half is not None:
            self._route.close()  # the route's handle is closed for good ...
            self._half.close()  # ... idempotently
            close_edges()  # and the job closes the rank's shared transport


@pytest.mark.usefixtures("one_rank_world")
class TestCollectiveRouteConformance(_Cheap, TransportConformance):
    def open_pair(self, tmp_path):
        t = _CollectiveRoute()
        return t, t


# -- the route's other duties ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("transport", "route", "lora", "hop"),
    [("inprocess", "transport", False, "group"), ("shm", "transport", False, "group"), ("collective", "collective", False, "group"),
     ("file", "transport", False, "file"), ("inprocess", "transport", True, "file"), ("inprocess", "direct", False, "direct")],
)
def test_a_route_names_the_hop_into_an_engines_own_workers(transport, route, lora, hop):
    spec = TransportSpec(src="policy", dst="gen", name=transport, route=route)
    assert WeightRoute(spec).hop(lora=lora) == hop


def test_a_direct_routes_halves_are_the_policys_sending_and_the_generators_channel():
    """The policy's ranks send on request (``DirectPolicy``): nothing is published into the route; the
    generator's half is the edge's channel (made inside a torchrun job only, on first use)."""
    route = WeightRoute(TransportSpec(src="policy", dst="gen", name="inprocess", route=ROUTE_DIRECT))
    assert route.direct
    with pytest.raises(TransportError, match=r"'policy' -> 'gen' takes the direct route.*DirectPolicy"):
        route.publisher()
    end = route.receiver()
    assert isinstance(end, DirectEnd) and end.spec.route == ROUTE_DIRECT
    route.close()


def test_the_run_writes_no_options_for_routes_the_torchrun_job_opens(tmp_path):
    """A collective or direct edge gets no segment, folder or factory reference: the job opens it, not the
    registry; the graph's transport name is kept as it was (never renamed into a made-up one)."""
    graph = build_llamarl(transport="shm")
    ways = {"collective": (ROUTE_COLLECTIVE, "collective"), "direct": (ROUTE_DIRECT, "shm")}
    for way, (route, name) in ways.items():
        (spec,) = transport_specs(graph, str(tmp_path), crosses_processes=True, choose=lambda e: (route, name))
        assert (spec.route, spec.name, spec.writer_options, spec.reader_options, spec.factory) == (route, name, {}, {}, ""), way


def test_an_edge_without_a_route_in_this_process_is_an_error_naming_it():
    routes = WeightRoutes(())
    assert routes.route("policy", "gen") is None
    with pytest.raises(TransportError, match=r"weight edge 'policy' -> 'gen' has no route in this process"):
        routes.writer("policy", "gen")
