"""The ``process`` backend: one OS process per executor on this machine.

Each worker (``flowrl.runtime.backends.process.worker``) runs one node's program. Workers are forked, all at once, from
the zygote (``backends.process.zygote``), a process that imported torch and the worker's modules once, so a
worker starts in milliseconds instead of importing torch itself. The controller's executor thread
for that node talks to it through a ``remote.RemoteProgram`` over a ``WorkerLink``: a socket pair
with msgspec headers and raw tensor bytes (no pickle).
Weights go over shared memory (a transport that cannot cross processes, ``inprocess``, becomes ``shm``). Workers are pinned to their
placement's cores when the placement comes from a CPU plan.

Failure handling: a worker that raises answers with the error and its traceback; a worker that dies
(SIGKILL, OOM) closes its socket, which the controller sees at once. On any failure every worker
is killed; the controller's end closing makes a worker exit by itself, and a worker dies with the
zygote, which dies with the controller's process, even mid-step (``worker.die_with_parent``), so
none is orphaned. Shared-memory
segments of a run whose controller was killed are removed by the next process-backend run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from flowrl.backend_traits import BACKENDS
from flowrl.errors import FlowrlError, NodeBuildError
from flowrl.graph.ir import Graph
from flowrl.graph.kinds import KINDS
from flowrl.graph.serialize import to_json
from flowrl.runtime.backends.backend import OnStep
from flowrl.runtime.backends.remote import RemoteProgram
from flowrl.runtime.backends.process.zygote import ForkedWorker, Zygote
from flowrl.runtime.backends.process.zygote import take as take_zygote
from flowrl.placement.layout import Placement
from flowrl.runtime.programs.nodes import Batch, ProgramEnv
from flowrl.runtime.transports.registry import transport_traits
from flowrl.runtime.wire import recv_message, send_message

if TYPE_CHECKING:
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.staleness import StalenessGate
    from flowrl.runtime.control.controller import RunResult

__all__ = ["ProcessBackend", "ProcessWorkers", "WorkerLink", "WorkerError", "sweep_orphan_segments"]


class WorkerError(FlowrlError):
    """A worker process raised or died; the message names its node and pid.

    ``user_mistake`` is True only when what the worker raised was a flowrl check of the user's input;
    a worker that died or raised anything else is a failed run (the CLI exits 1, not 2).
    """

    def __init__(self, message: str, *, user_mistake: bool = False) -> None:
        super().__init__(message)
        self.user_mistake = user_mistake


class WorkerLink:
    """The ``process`` backend's ``remote.Link``: one peer, a worker process over a socket pair."""

    peers: tuple[int, ...] = (0,)
    closes_with_controller = True

    def __init__(self, node: str, proc: ForkedWorker, sock: socket.socket) -> None:
        self.node = node
        self.proc = proc
        self.sock = sock

    def send(self, peer: int, header: dict[str, Any], tensors: Batch | None) -> None:
        send_message(self.sock, header, tensors)

    def recv(self, peer: int) -> tuple[dict[str, Any], Batch]:
        return recv_message(self.sock)

    def died(self, peer: int) -> WorkerError:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        return WorkerError(f"worker process of node {self.node!r} (pid {self.proc.pid}) died ({how})")

    def raised(self, failures: list[tuple[int, dict[str, Any]]], *, starting: bool) -> FlowrlError:
        """The worker's failure: a node that failed to build is a ``NodeBuildError``; a flowrl check of
        the user's input is its message alone (one paragraph, as on the local backend); anything else,
        a bug, keeps the worker's traceback."""
        [(_, reply)] = failures
        if starting and reply.get("build"):  # the node's factory or operator refused: a user mistake, named as in every backend
            return NodeBuildError(str(reply.get("error")), node=self.node)
        doing = f"worker of node {self.node!r} failed to start: " if starting else ""
        if reply.get("user_mistake"):
            return WorkerError(f"{doing}{reply.get('error')}", user_mistake=True)
        where = f"--- traceback in worker of node {self.node!r} (pid {self.proc.pid}) ---"
        return WorkerError(f"{doing}{reply.get('error')}\n{where}\n{reply.get('traceback', '')}")

    def abort(self) -> None:
        """Kill the worker now."""
        if self.proc.poll() is None:
            self.proc.kill()

    def closing(self) -> bool:
        if self.proc.poll() is not None:
            return False
        self.sock.settimeout(10)
        return True

    def release(self) -> None:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.sock.close()


class ProcessBackend:
    """One OS process per executor on this machine; weights cross processes."""

    name = "process"
    crosses_processes = BACKENDS["process"].crosses_processes

    def run(
        self, graph: Graph, placement: Placement | None, config: RunConfig, *, on_step: OnStep | None = None, gate: StalenessGate | None = None
    ) -> RunResult:
        """Run ``graph`` with one worker per executor node (``ProcessWorkers``), the controller here."""
        from flowrl.runtime.backends.drive import run_with_controller

        return run_with_controller(graph, placement, config, lambda env, placement: ProcessWorkers(graph, env, placement),
                                   crosses_processes=True, set_threads=False, on_step=on_step, gate=gate)


class ProcessWorkers:
    """Starts one worker per executor node and hands the controller proxies to them."""

    def __init__(self, graph: Graph, env: ProgramEnv, placement: Placement) -> None:
        self.graph = graph
        self.env = env
        self.placement = placement
        self.workers: dict[str, RemoteProgram] = {}
        self.zygote: Zygote | None = None

    def _spawn(self, zygote: Zygote, node: str) -> RemoteProgram:
        """Fork the worker of ``node`` from ``zygote`` and send it its init message (its reply is read by ``open``)."""
        parent, child = socket.socketpair()
        try:
            proc = zygote.fork(child)
        finally:
            child.close()
        worker = RemoteProgram(node, WorkerLink(node, proc, parent))
        cores = list(self.placement.devices.get(node, ())) if self.placement.pin else []
        worker.open({
            "op": "init",
            "graph": to_json(self.graph, indent=0),
            "node": node,
            "env": msgspec.to_builtins(self.env),
            "cores": cores,
            "threads": self.placement.threads_per_group(),
        })
        return worker

    def open(self) -> dict[str, Any]:
        """Fork every worker at once (they build their programs in parallel), then wait for each to be ready."""
        sweep_orphan_segments()
        try:
            self.zygote = zygote = take_zygote()
            for node in self.graph.nodes:
                if KINDS[node.kind].runs_on != "policy":  # a loss runs in its policy
                    self.workers[node.name] = self._spawn(zygote, node.name)
            for worker in self.workers.values():
                worker.ready()
        except BaseException:
            self.abort()
            self.close()
            raise
        return dict(self.workers)

    def abort(self) -> None:
        for worker in self.workers.values():
            worker.abort()

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        if self.zygote is not None:
            self.zygote.close()
        self._unlink_segments()

    def _unlink_segments(self) -> None:
        """Remove shared-memory segments a killed worker could not unlink itself."""
        for spec in self.env.transports:
            name = spec.writer_options.get("name") if transport_traits(spec.name).needs_segment else None
            if name:
                path = Path("/dev/shm") / name.lstrip("/")
                if path.exists():
                    path.unlink(missing_ok=True)


def sweep_orphan_segments(root: str = "/dev/shm") -> list[str]:
    """Remove flowrl shared-memory segments whose creating controller (the pid in their name,
    ``flowrl-<pid>-<token>-...``) is dead: a SIGKILLed run cannot unlink its own. Returns their names."""
    removed: list[str] = []
    folder = Path(root)
    if not folder.is_dir():
        return removed
    for path in folder.glob("flowrl-*"):
        pid = path.name.split("-")[1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # still running (or a pid reused by another process: leave it)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed
