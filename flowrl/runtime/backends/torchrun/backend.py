"""The ``torchrun`` backend: every rank of a torch.distributed job runs part of the graph.

Launch (one host; several hosts add ``--nnodes``, ``--rdzv-backend c10d --rdzv-endpoint HOST:PORT``)::

    torchrun --nproc-per-node 3 -m flowrl run llamarl --backend torchrun --plan plan.json

Where things run:

- Device ids of the placement are global ranks. Each heavy node (generator, policy, reference) runs on
  its ranks; its first rank is its *lead*. ``--plan`` takes a plan file from ``flowrl plan -o`` or a
  JSON placement ``{"node": [ranks, ...], ...}`` (a node may also be ``{"ranks": [...], "mesh":
  {"dp": 1, "tp": 2}}``), read into a ``Placement`` as on every backend (by the CLI on every rank:
  ``flowrl.planners.forms.read_placement``). Without one: every heavy node on every rank (colocated).
- The controller (version clock, channels, staleness gate, metrics, trace, checkpoints) runs on
  rank 0 only: the clock and the staleness invariant need one owner, and metrics, trace and
  checkpoints must be written once. Light nodes (sources, rule scorers) run in threads there too.
  The other ranks are workers.
- Rank 0 listens on a TCP socket (127.0.0.1 when the job is on one host, this host's address
  otherwise) and publishes ``host:port`` in the job's torch.distributed store. Every rank connects
  once per node it belongs to and answers ``flowrl.runtime.backends.process.worker.serve`` (the process backend's
  protocol: msgspec header + raw tensor bytes). Rank 0's own memberships use a socket pair. The
  controller sends each request to every rank of the node at once (``remote.RemoteProgram`` over
  ``RankLinks``); only the lead gets the batch and returns outputs. Commands come over sockets, never over a collective, so an
  idle rank waits without a timeout ticking; collectives run only inside a step, between busy ranks.
- Each heavy node's ranks form a process group (``dist.new_group``, created by every rank, in graph
  order) and a ``DeviceMesh`` with the placement's named axes (``flowrl.runtime.parallel.meshes``); each collective weight edge a group of
  exactly its ranks (``_setup_groups``).
- Parallel executors (``rank_programs``): a policy on several ranks trains data-parallel
  (``DataParallelPolicy``: equal to a one-process step up to rounding), or sharded with FSDP2 when
  its optimizer says ``sharding="fsdp"`` (``ShardedPolicy``, ``flowrl.runtime.parallel.fsdp``: each rank writes
  its shards of the checkpoint, so its ``save`` goes to every rank of the node), or in pipeline stages
  when its mesh has ``pp`` > 1 (``pp_policy.PipelinePolicy``: each stage writes its own state); a generator on several ranks
  runs replicas (``ParallelGenerator``), each a tensor-parallel group with a ``tp`` mesh axis > 1
  (a vLLM generator's group is one vLLM engine with ``tensor_parallel_size`` = tp, ``vllm_replicas``).
  User / synthetic programs on several ranks run on the lead; the other ranks idle.
- Weights: ``inprocess`` and ``collective`` edges use the collective transport
  (``flowrl.runtime.weights.torchrun_edges``: options from the model config, one instance per rank and
  edge opened at setup, generator ranks receiving in the background); every policy replica
  publishes, every generator rank fetches. Edges that name ``shm`` or ``file`` keep them (``file``
  across hosts needs ``FLOWRL_WEIGHTS_DIR``, a directory every host sees). A default edge into a
  vLLM generator on ranks apart from the policy's takes the direct route instead (the policy's
  ranks send into every vLLM engine's workers at once: ``direct_route``).

Timeouts (a failure stops the whole job in bounded time; nothing waits forever):

- ``FLOWRL_DIST_TIMEOUT_S`` (default 120): the process-group timeout; a collective whose peer died
  or raised fails after it. Steps are not bounded by it, only collectives inside a step. It is also
  the collective weight transport's ``timeout_s`` (its handshake at setup, a publish waiting for the
  previous version's sends, a fetch waiting for announced data).
- ``FLOWRL_CONNECT_TIMEOUT_S`` (default 120): ranks connecting to rank 0, and rank 0's address in the store.
- A rank that raises answers the controller with the error; a rank that dies closes its socket. Either
  way the controller fails the run naming the node and the rank, closes every socket (each worker's
  ``serve`` then returns) and rank 0 exits 1; torchrun then stops any rank still running.
- ``RunConfig.stall_timeout_s``: the controller fails the run if no executor finishes a step for that long.
- ``--liveness-timeout`` (``RunConfig.liveness_timeout_s``, default 60 s): every rank beats a counter in
  the job's store; a rank of any role whose counter stands still that long (dead, SIGSTOPped, wedged)
  ends every rank with a message naming it, its nodes and the cause, a stopped one SIGKILLed by a
  rank on its host (``heartbeat``). A worker that torchrun SIGTERMs ends with its processes
  (``flowrl.fatal.end_process``), naming a peer whose process is gone.

Restarts (``torchrun --max-restarts N``): torchrun's agent restarts every rank with the same command
after one fails. Each attempt's process group keeps its keys apart in the agent's store
(``_attempt_store``). The checkpoint directory is rank 0's alone: whether and from which checkpoint
the run resumes (``--resume auto``: the newest complete one, or a fresh start when there is none) is
decided once, there, under the directory's lock, and the other ranks load what rank 0's ``load``
requests name; no worker reads the directory, so no two ranks can decide differently.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import msgspec
import torch

from flowrl.backend_traits import BACKENDS
from flowrl.errors import ConfigError, FlowrlError, PlanError
from flowrl.fatal import end_process
from flowrl.graph.ir import Graph, WeightEdge
from flowrl.graph.kinds import KINDS
from flowrl.graph.serialize import to_json
from flowrl.runtime.backends.backend import OnStep
from flowrl.runtime.backends.torchrun.rank_programs import RANK_PROGRAM, RankContext, set_context
from flowrl.runtime.weights.direct_route import direct_channels
from flowrl.runtime.backends.torchrun.heartbeat import DEFAULT_TIMEOUT_S, Heartbeat, rank_roles
from flowrl.runtime.backends.remote import RemoteProgram
from flowrl.runtime.weights.torchrun_edges import COLLECTIVE, channel, close_edges, collective_options, open_edges, participants, weight_transport
from flowrl.runtime.config import RunConfig
from flowrl.runtime.control.controller import Controller, RunResult
from flowrl.runtime.parallel.fsdp import check_ranks, fsdp_policies
from flowrl.runtime.parallel.pipeline import check_pipeline, pipeline_policies
from flowrl.runtime.parallel.tp_train import check_tp_meshes
from flowrl.runtime.control.executor_placement import one_device_meshes, rank_device, resolve_device
from flowrl.host import host_memory_bytes
from flowrl.runtime.preflight import check_engine_meshes, check_meshes, check_ranks_fit
from flowrl.placement.layout import Placement
from flowrl.placement.default import default_placement
from flowrl.placement.forms import check_placed
from flowrl.runtime.parallel.meshes import device_mesh
from flowrl.runtime.staleness import StalenessGate
from flowrl.runtime.weights.edges import ROUTE_COLLECTIVE, ROUTE_DIRECT, SHARED_DIRECTORY, SHARED_MEMORY, ROUTE_TRANSPORT, RouteKind, transport_specs
from flowrl.runtime.transports.registry import transport_traits
from flowrl.runtime.programs.table import build_program
from flowrl.runtime.programs.nodes import Batch, ProgramEnv, SharedTransports
from flowrl.runtime.wire import ConnectionLost, recv_message, send_message

__all__ = [
    "TorchrunBackend",
    "run_torchrun",
    "pipelined_policies",
    "rank_placement",
    "RankLinks",
    "RankError",
    "DIST_TIMEOUT_S",
    "CONNECT_TIMEOUT_S",
]

DIST_TIMEOUT_S = float(os.environ.get("FLOWRL_DIST_TIMEOUT_S", "120"))
CONNECT_TIMEOUT_S = float(os.environ.get("FLOWRL_CONNECT_TIMEOUT_S", "120"))
_STORE_KEY = "flowrl/controller"


class RankError(FlowrlError):
    """A rank raised or died; the message names the rank and its node."""


class TorchrunBackend:
    """This process is one rank of a torchrun job (see the module docstring)."""

    name = "torchrun"
    crosses_processes = BACKENDS["torchrun"].crosses_processes

    def run(
        self, graph: Graph, placement: Placement | None, config: RunConfig, *, on_step: OnStep | None = None, gate: StalenessGate | None = None
    ) -> RunResult:
        """Every rank calls this, with the same placement; rank 0 returns the run's result (``run_torchrun``)."""
        return run_torchrun(graph, placement, config, on_step=on_step, gate=gate)


# -- placement --------------------------------------------------------------------------------------
Axes = tuple[tuple[str, ...], tuple[int, ...]]


def rank_placement(graph: Graph, placement: Placement | None, world: int) -> Placement:
    """The job's placement: the one given or, without one, every heavy node on every rank
    (``all-colocated``; a kind whose program runs on one rank only, ``flowrl.mesh_support``, on rank 0);
    its device ids are ranks (never pinned as cores).

    Raises:
        PlanError: a placement that does not place exactly the graph's device nodes, or a node
            needing ranks >= ``world``.
    """
    if placement is None:  # a kind that runs on one rank only gets rank 0 (mesh_support), every other kind every rank
        placement = one_device_meshes(graph, default_placement(graph, 0, world, strategy="all-colocated"), "torchrun", "cpu")
    check_placed(graph, placement.nodes, f"the placement ({placement.source})")
    for n, rs in placement.devices.items():
        if max(rs) >= world:
            raise PlanError(
                f"node {n!r} needs ranks {list(rs)} but torchrun launched WORLD_SIZE={world} "
                f"(ranks 0-{world - 1}); launch with --nproc-per-node {max(rs) + 1} (or more), or re-plan for {world} devices"
            )
    return msgspec.structs.replace(placement, pin=False)


def _axes(placement: Placement) -> dict[str, Axes]:
    """Each heavy node's mesh: (axis names, shape)."""
    return {n: (m.axes, m.mesh_shape) for n, m in placement.nodes.items()}


# -- the controller's side: one node = requests to all its ranks at once -------------------------------
class RankLinks:
    """The ``torchrun`` backend's ``remote.Link``: one peer per rank of the node (a socket each, lead first).

    The controller's ``close`` leaves the ranks' programs open; ``_control`` ends them after the run
    with ``RemoteProgram.shutdown``.
    """

    closes_with_controller = False

    def __init__(self, node: str, links: dict[int, socket.socket]) -> None:
        self.node = node
        self.links = links  # rank -> socket, lead first
        self.peers = tuple(links)

    def send(self, peer: int, header: dict[str, Any], tensors: Batch | None) -> None:
        send_message(self.links[peer], header, tensors)

    def recv(self, peer: int) -> tuple[dict[str, Any], Batch]:
        return recv_message(self.links[peer])

    def died(self, peer: int) -> RankError:
        return RankError(f"rank {peer} of node {self.node!r} died (its connection to the controller is closed)")

    def raised(self, failures: list[tuple[int, dict[str, Any]]], *, starting: bool) -> RankError:
        return RankError("\n".join(
            f"rank {r} of node {self.node!r} raised {reply.get('error')}\n--- traceback on rank {r} ---\n{reply.get('traceback', '')}"
            for r, reply in failures
        ))

    def abort(self) -> None:
        """Close the sockets, so every worker's ``serve`` returns."""
        for s in self.links.values():
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def closing(self) -> bool:
        for s in self.links.values():
            s.settimeout(30)
        return True

    def release(self) -> None:
        for s in self.links.values():
            s.close()


# -- setting up the job -----------------------------------------------------------------------------
def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ConfigError(f"--backend torchrun needs {name} in the environment: launch with 'torchrun --nproc-per-node N -m flowrl run ... --backend torchrun'")
    return int(value)


def _attempt_store(rank: int, world: int) -> dict[str, Any]:
    """``init_process_group``'s store for this attempt of a job that torchrun's elastic agent restarts.

    The agent hosts one store for every attempt (``TORCHELASTIC_USE_AGENT_STORE``), so the keys of the
    attempt before a restart are still there: gloo's rendezvous and ``_STORE_KEY`` would read the dead
    ranks' addresses whenever one rank reaches them before another has written its own (seen: a
    restarted job failing with "Gloo connectFullMesh failed ... Connection refused"). Each attempt
    (``TORCHELASTIC_RESTART_COUNT``) gets keys of its own. Outside such an agent: torchrun's default.
    """
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S))
    return {"store": dist.PrefixStore(_attempt_prefix(), store), "rank": rank, "world_size": world}


def _attempt_prefix() -> str:
    """The store prefix of this attempt's keys (``TORCHELASTIC_RESTART_COUNT``; 0 outside an elastic agent)."""
    return f"flowrl/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _one_host() -> bool:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "-1")) == int(os.environ.get("WORLD_SIZE", "-2"))


def _weight_transport(edge: WeightEdge, programs: Mapping[str, str]) -> str:
    """The transport a weight edge uses across ranks: the collective one for a collective transport
    or one that cannot cross processes (``torchrun_edges.COLLECTIVE``), the graph's own otherwise.

    An edge whose transport cannot cross processes with a user program at either end (synthetic
    operators, say) moves its weights through ``shm`` on one host and ``file`` otherwise: the
    collective transport lays out the built-in model's parameters and cannot know a user program's tensors.
    """
    traits = transport_traits(edge.transport)
    user = edge.src in programs or edge.dst in programs
    if user and traits.collective:
        raise ConfigError(
            f"weight edge {edge.src!r} -> {edge.dst!r} asks for the collective transport, but "
            f"{edge.src if edge.src in programs else edge.dst!r} runs a user program: the collective transport "
            "moves the built-in model's parameters only; use transport='shm' or 'file' for this edge"
        )
    if user and not traits.crosses_processes:
        return SHARED_MEMORY if _one_host() else SHARED_DIRECTORY
    return weight_transport(edge.transport)


def _listen_address() -> str:
    if _one_host():
        return "127.0.0.1"
    return os.environ.get("FLOWRL_CONTROLLER_ADDR") or socket.gethostbyname(socket.gethostname())


def _serve_thread(sock: socket.socket, node: str, errors: list[str]) -> threading.Thread:
    from flowrl.runtime.backends.process.worker import serve

    def main() -> None:
        try:
            serve(sock)
        except ConnectionLost:
            pass  # the controller closed the connection: the run is over
        except BaseException as exc:  # noqa: BLE001 - reported after join
            errors.append(f"node {node!r}: {type(exc).__name__}: {exc}")
        finally:
            sock.close()

    t = threading.Thread(target=main, name=f"flowrl-rank-{node}", daemon=True)
    t.start()
    return t


def _setup_groups(graph: Graph, ctx: RankContext, placement: Placement, edges: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every rank creates every node's group and mesh, then every collective weight edge's group (its
    participating ranks exactly), in graph order (``new_group`` is collective). Returns the edge groups."""
    import torch.distributed as dist

    for node in graph.nodes:
        ranks = ctx.ranks.get(node.name)
        if not ranks:
            continue
        ctx.groups[node.name] = dist.new_group(list(ranks))
        mesh = device_mesh(placement, node.name, device_type=ctx.device.type)
        if ctx.rank in ranks:
            ctx.meshes[node.name] = mesh
    groups = {}
    for ch, options in edges.items():
        members = participants(options)
        groups[ch] = dist.new_group(members)
        if ctx.rank in members:  # one collective first: NCCL's first point-to-point batch must involve every rank
            dist.all_reduce(torch.zeros(1, device=ctx.device), group=groups[ch])
    return groups


def _edge_options(graph: Graph, ctx: RankContext, axes: dict[str, Axes]) -> dict[str, dict[str, Any]]:
    """Channel -> options of every collective weight edge (the same on every rank)."""
    return {
        channel(e.src, e.dst): collective_options(graph, e.src, e.dst, ctx.ranks, ctx.programs, axes, DIST_TIMEOUT_S)
        for e in graph.weight_edges
        if _route(e, ctx)[0] == ROUTE_COLLECTIVE
    }


def _route(edge: WeightEdge, ctx: RankContext) -> tuple[RouteKind, str]:
    """The route ``edge`` takes in this job and the transport that moves its weights: the direct route
    into vLLM (``ctx.direct``: ``placement.weight_routes``' rule; the graph's transport kept, unused),
    the rank's collective transport, or ``_weight_transport``'s through the registry."""
    if channel(edge.src, edge.dst) in ctx.direct:
        return ROUTE_DIRECT, edge.transport
    name = _weight_transport(edge, ctx.programs)
    return (ROUTE_COLLECTIVE if name == COLLECTIVE else ROUTE_TRANSPORT), name


def pipelined_policies(graph: Graph, axes: Mapping[str, Axes], *, skip: Iterable[str] = ()) -> frozenset[str]:
    """The names of the policies whose mesh has ``pp`` > 1: their weight edges into vLLM take the hop,
    never the direct route (``placement.weight_routes.direct_edges`` reads names).

    Example:
        >>> from flowrl.examples import build_example
        >>> sorted(pipelined_policies(build_example("llamarl"), {"policy": (("pp",), (2,))}))
        ['policy']
    """
    return frozenset(node.name for node, _ in pipeline_policies(graph, axes, skip=skip))


def run_torchrun(
    graph: Graph, placement: Placement | None, config: RunConfig, *, on_step: Callable[[dict[str, Any]], None] | None = None,
    gate: StalenessGate | None = None,
) -> RunResult:
    """Run ``graph`` as one rank of a torchrun job. Rank 0 returns the run's result; the other
    ranks serve their nodes and return an empty result (``version == -1``) when rank 0 is done.
    ``gate``: the run's staleness gate, built once on each rank by ``run_graph`` (None, from a backend
    that subclasses this one and takes no gate: built here, once).

    Raises:
        PlanError: (every rank, before any work) a placement needing more ranks than WORLD_SIZE.
        RankError / NodeExecutionError: on rank 0, a rank that raised or died, naming it and its node.
    """
    import torch.distributed as dist

    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    gate = gate if gate is not None else StalenessGate.of(graph, config.max_staleness)
    placement = rank_placement(graph, placement, world)
    ranks, axes = placement.devices, _axes(placement)
    device = rank_device(resolve_device(config.device), int(os.environ.get("LOCAL_RANK", "0")))
    cuda = device.type == "cuda"
    check_meshes(graph, placement, backend="torchrun", device=device.type, skip=config.programs)  # every rank alike, the default's too
    check_ranks(graph, ranks, axes, skip=config.programs)  # every rank, before any work
    pipelined = pipelined_policies(graph, axes, skip=config.programs)  # take the hop (weight_routes)
    check_pipeline(graph, axes, skip=config.programs)
    check_tp_meshes(graph, axes, skip=config.programs)  # a tensor-parallel policy's, reference's or critic's tp against its heads and widths
    check_engine_meshes(graph, {n: a for n, a in axes.items() if n not in config.programs}, ranks, cores=None if cuda else len(os.sched_getaffinity(0)))
    memory = torch.cuda.get_device_properties(device).total_memory if cuda else host_memory_bytes()
    check_ranks_fit(graph, ranks, device=device.type, memory_bytes=memory, skip=frozenset(config.programs),
                    ranks_per_host=int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))  # every rank alike, before any work
    if cuda:
        torch.cuda.set_device(device)
    ctx = RankContext(rank=rank, world=world, ranks=ranks, programs=dict(config.programs), device=device,
                      direct=direct_channels(graph, ranks, dict(config.programs), pipelined), ep={n: m.ep for n, m in placement.nodes.items() if m.ep > 1})
    set_context(ctx)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=DIST_TIMEOUT_S), **_attempt_store(rank, world))
    edges = _edge_options(graph, ctx, axes)
    ok = False
    heartbeat = Heartbeat.connect(_attempt_prefix(), rank, world, rank_roles(ranks, world), config.liveness_timeout_s or DEFAULT_TIMEOUT_S)
    if heartbeat is not None:
        heartbeat.start()
    try:
        groups = _setup_groups(graph, ctx, placement, edges)
        open_edges(edges, groups, rank, device)  # handshakes: every participating rank is here now
        store = dist.distributed_c10d._get_default_store()
        mine = [n for n, rs in ranks.items() if rank in rs]
        if rank != 0:
            with _end_on_sigterm(heartbeat, rank, ranks, world):
                result = _work(store, ctx, mine)
        else:
            seen: dict[str, Controller] = {}
            with _report_on_sigterm(seen, heartbeat.dead_peer if heartbeat is not None else lambda: None):
                result = _control(graph, config, placement, store, ctx, on_step, seen, edges, gate)
        ok = True
        return result
    finally:
        if heartbeat is not None:  # this rank is leaving: its peers no longer judge it (its exit status speaks now)
            heartbeat.done()
        close_edges(drain_s=10.0 if ok else 0.0)  # after a success, let the last version reach the generators
        set_context(None)
        if owns_group:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer already gone must not hide the run's outcome
                pass


def _work(store: Any, ctx: RankContext, mine: list[str]) -> RunResult:
    """A worker rank: connect to rank 0 once per node of this rank, serve until rank 0 closes."""
    store.set_timeout(datetime.timedelta(seconds=CONNECT_TIMEOUT_S))
    host, port = store.get(_STORE_KEY).decode().rsplit(":", 1)
    errors: list[str] = []
    threads = []
    for node in mine:
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
        sock.settimeout(None)
        send_message(sock, {"rank": ctx.rank, "node": node})
        threads.append(_serve_thread(sock, node, errors))
    for t in threads:
        t.join()
    if errors:
        raise RankError(f"rank {ctx.rank}: " + "; ".join(errors))
    return RunResult(rows=[], version=-1, consumed=[], wall_s=0.0)


@contextlib.contextmanager
def _end_on_sigterm(heartbeat: Heartbeat | None, rank: int, ranks: Mapping[str, Any], world: int) -> Iterator[None]:
    """A worker rank that torchrun SIGTERMs (another rank failed) says so, naming a peer on this host
    whose process is gone where there is one, and ends with its own processes (vLLM's:
    ``fatal.end_process``) rather than dying silently."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    me = f"rank {rank} ({rank_roles(ranks, world)[rank]})"

    def on_term(signum: int, frame: Any) -> None:
        dead = heartbeat.dead_peer() if heartbeat is not None else None
        end_process(f"{me}: torchrun stopped this rank (SIGTERM)" + (f" after {dead}" if dead else ", most likely because another rank failed"))

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _report_on_sigterm(seen: dict[str, Controller], dead_peer: Callable[[], str | None] = lambda: None) -> Iterator[None]:
    """When a rank dies, torchrun SIGTERMs every other rank, rank 0 included, often before rank 0
    has printed what it saw. On SIGTERM, print the failure the controller recorded (naming the rank
    and its node) or, without one, the peer on this host whose process is gone (``dead_peer``) or
    that torchrun stopped this rank; then exit 1."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_term(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        controller = seen.get("controller")
        failure = controller.stop.failure if controller is not None else None  # RunStop: the first failure
        if failure is not None:
            node, step, exc = failure
            at = f" at step {step}" if step is not None else ""
            message = f"node {node!r} failed{at}: {type(exc).__name__}: {exc}"
        elif (dead := dead_peer()) is not None:
            message = f"torchrun stopped rank 0 (SIGTERM) after {dead}"
        else:
            message = "torchrun stopped rank 0 (SIGTERM), most likely because another rank failed; see torchrun's summary"
        print(f"flowrl run: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(1)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    except BaseException as exc:
        # the failure is on its way to the CLI, which prints it; until it does, a SIGTERM prints it.
        # Bind the text now: Python deletes `exc` when this except block ends.
        failure = str(exc)

        def on_term_after(signum: int, frame: Any) -> None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            print(f"flowrl run: error: {failure}", file=sys.stderr, flush=True)
            raise SystemExit(1)

        signal.signal(signal.SIGTERM, on_term_after)
        raise
    signal.signal(signal.SIGTERM, previous)


def _control(
    graph: Graph,
    config: RunConfig,
    placement: Placement,
    store: Any,
    ctx: RankContext,
    on_step: Callable[[dict[str, Any]], None] | None,
    seen: dict[str, Controller],
    edges: dict[str, dict[str, Any]],
    gate: StalenessGate,
) -> RunResult:
    listener = socket.create_server((_listen_address(), 0))
    listener.settimeout(CONNECT_TIMEOUT_S)
    host, port = listener.getsockname()[:2]
    store.set(_STORE_KEY, f"{host}:{port}")
    shared = os.environ.get("FLOWRL_WEIGHTS_DIR")
    if not shared and not _one_host() and any(transport_traits(_route(e, ctx)[1]).needs_directory for e in graph.weight_edges):
        raise ConfigError("a torchrun job over several hosts moves weights through files: set FLOWRL_WEIGHTS_DIR to a directory every host sees")
    run_dir = tempfile.mkdtemp(prefix="flowrl-torchrun-", dir=shared or None)
    specs = tuple(
        msgspec.structs.replace(s, writer_options=edges[channel(s.src, s.dst)], reader_options=edges[channel(s.src, s.dst)])
        if s.route == ROUTE_COLLECTIVE else s
        for s in transport_specs(graph, run_dir, crosses_processes=True, choose=lambda e: _route(e, ctx), references=False)
    )
    env = ProgramEnv(
        transports=specs,
        programs={**dict(config.programs), **{n: RANK_PROGRAM for n in ctx.ranks}},
        seed=config.seed,
        options=dict(config.options),
        staleness=gate,  # the controller's bounds, for the generator programs
    )
    local_errors: list[str] = []
    links: dict[str, dict[int, socket.socket]] = {n: {} for n in ctx.ranks}
    node_programs: dict[str, Any] = {}
    light = SharedTransports(env.transports)
    try:
        # rank 0's own memberships: a socket pair served by a thread
        for node, rs in ctx.ranks.items():
            if 0 in rs:
                mine, theirs = socket.socketpair()
                links[node][0] = mine
                _serve_thread(theirs, node, local_errors)
        expected = {(n, r) for n, rs in ctx.ranks.items() for r in rs if r != 0}
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while expected:
            listener.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                missing = ", ".join(f"rank {r} (node {n!r})" for n, r in sorted(expected))
                raise RankError(f"{missing} did not connect to the controller on rank 0 within {CONNECT_TIMEOUT_S:.0f} s (FLOWRL_CONNECT_TIMEOUT_S)") from None
            conn.settimeout(None)
            hello, _ = recv_message(conn)
            key = (hello["node"], int(hello["rank"]))
            expected.discard(key)
            links[key[0]][key[1]] = conn
        init = {
            "op": "init",
            "graph": to_json(graph, indent=0),
            "env": msgspec.to_builtins(env),
            "cores": [],
            "threads": torch.get_num_threads(),
        }
        sharded = {n.name for n in fsdp_policies(graph, skip=config.programs)}  # on one rank a policy runs whole and saves one file
        sharded |= {n.name for n, _ in pipeline_policies(graph, _axes(placement), skip=config.programs)}  # each stage writes its own
        sharded |= {n for n, (names, shape) in _axes(placement).items() if dict(zip(names, shape)).get("tp", 1) > 1
                    and graph.node(n).kind == "policy" and n not in config.programs}  # a tensor-parallel policy (tp_policy)
        gathers = {n for n, (names, shape) in _axes(placement).items() if dict(zip(names, shape)).get("tp", 1) > 1
                   and graph.node(n).kind == "critic" and n not in config.programs}  # a tensor-parallel critic (tp_critic)
        for node, rs in ctx.ranks.items():
            gathered = node in gathers and len(rs) > 1  # every rank takes part in the save, the lead writes one file
            node_programs[node] = RemoteProgram(node, RankLinks(node, {r: links[node][r] for r in rs}),
                                                save_on_every_peer=(node in sharded or gathered) and len(rs) > 1, one_file=gathered)
        for node, group in node_programs.items():
            group.open({**init, "node": node})
            group.ready()
        for n in graph.nodes:
            if KINDS[n.kind].runs_on != "policy" and n.name not in node_programs:  # a loss runs in its policy
                node_programs[n.name] = build_program(graph, n.name, msgspec.structs.replace(env, programs=dict(config.programs)), light)
        controller = Controller(graph, config, node_programs, placement, on_step=on_step, gate=gate)
        seen["controller"] = controller
        return controller.run()
    except BaseException:
        for h in node_programs.values():
            if isinstance(h, RemoteProgram):
                h.abort()
        raise
    finally:
        for node, h in node_programs.items():
            if isinstance(h, RemoteProgram):
                h.shutdown()
        for node_links in links.values():
            for s in node_links.values():
                s.close()
        listener.close()
        light.close()
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
