"""The worker process of the ``process`` backend: runs one node's program and answers the controller.

Forked by the process backend's zygote (``backends.process.zygote``), or started as ``python -m
flowrl.runtime.backends.process.worker FD PARENT_PID``; either way ``run_worker`` serves the connected socket on file
descriptor FD and the worker dies with its parent (``die_with_parent``).
The first message is ``init`` (the graph as JSON, the node name, the ``ProgramEnv``, the cores to
pin to); then requests ``start``, ``seek``, ``step``, ``save``, ``load``, ``close``, and ``snapshot``
(the state taken now, its write run on a thread here: ``checkpointing.background``; one in flight)
and ``written`` (``"done"``: whether that write is on disk; its failure is the reply's error), each answered by
``{"ok": true, ...}`` or ``{"ok": false, "error": ..., "traceback": ..., "user_mistake": ...}``
(``user_mistake``: the error is a flowrl check of the user's input, so the controller reports its
message alone, without the traceback). A program with a ``between_requests()`` method has it called every
few milliseconds while no request is there (``direct_route.DirectPolicy``). When the controller's end
of the socket closes (it exited or was killed) the worker exits, and if the controller is killed
mid-step the kernel kills the worker with it: no orphans.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback

import msgspec
import torch

from flowrl.errors import FlowrlError, NodeBuildError
from flowrl.graph.serialize import from_json
from flowrl.runtime.checkpointing.background import BackgroundSave, snapshot_or_save
from flowrl.runtime.programs.table import build_program
from flowrl.runtime.programs.nodes import ProgramEnv, SharedTransports
from flowrl.runtime.wire import ConnectionLost, recv_message, send_message

__all__ = ["serve", "run_worker", "die_with_parent"]


def _pin(cores: list[int], threads: int) -> None:
    if cores and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cores)
        except OSError:
            pass
    torch.set_num_threads(max(1, len(cores) if cores else threads))


def serve(sock: socket.socket) -> None:
    header, _ = recv_message(sock)
    graph = from_json(header["graph"])
    env = msgspec.convert(header["env"], ProgramEnv)
    _pin(header.get("cores", []), int(header.get("threads", 1)))
    transports = SharedTransports(env.transports)
    try:
        program = build_program(graph, header["node"], env, transports)
        send_message(sock, {"ok": True, "pid": os.getpid()})
    except NodeBuildError as exc:  # the controller raises it as its own NodeBuildError
        send_message(sock, {"ok": False, "build": True, "error": str(exc), "traceback": traceback.format_exc()})
        return
    except Exception as exc:  # noqa: BLE001 - reported to the controller, which raises it
        send_message(sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                            "user_mistake": _rooted_in_flowrl_check(exc)})
        return
    between = getattr(program, "between_requests", None)  # a torchrun policy answering vLLM's direct weight requests
    writes = BackgroundSave()  # a checkpoint's write behind the program's steps (``snapshot``)
    try:
        while True:
            if callable(between):
                from flowrl.runtime.weights.direct_route import wait_for_command

                wait_for_command(sock, between)
            request, tensors = recv_message(sock)
            op = request["op"]
            try:
                if op == "close":
                    writes.wait()
                    program.close()
                    transports.close()
                    send_message(sock, {"ok": True})
                    return
                if op == "step":
                    outputs, info = program.step(request["seq"], tensors, request["min_version"])
                    send_message(sock, {"ok": True, "info": info}, outputs)
                    continue
                if op == "start":
                    program.start()
                elif op == "seek":
                    program.seek(request["position"])
                elif op == "save":
                    writes.wait()
                    program.save(request["path"])
                elif op == "snapshot":
                    writes.wait()  # the previous write first: one in flight
                    if (write := snapshot_or_save(program, request["path"])) is not None:
                        writes.submit(write, f"the checkpoint state {request['path']}")
                elif op == "written":
                    done = not writes.in_flight
                    if done:
                        writes.wait()  # its failure, if it failed
                    send_message(sock, {"ok": True, "done": done})
                    continue
                elif op == "load":
                    program.load(request["path"])
                else:
                    raise ValueError(f"unknown request {op!r}")
                send_message(sock, {"ok": True})
            except Exception as exc:  # noqa: BLE001
                send_message(sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(),
                                    "user_mistake": _rooted_in_flowrl_check(exc)})
    finally:
        transports.close()


def _rooted_in_flowrl_check(exc: BaseException) -> bool:
    """True when the root of ``exc``'s cause chain is a flowrl check of the user's input (a prompt
    longer than the context, a NaN reward): the CLI then reports a user mistake, as in-process."""
    for _ in range(32):
        if exc.__cause__ is None:
            break
        exc = exc.__cause__
    return isinstance(exc, FlowrlError)


def die_with_parent(parent: int) -> None:
    """End this process when ``parent`` (the controller) dies, even while a step is running.

    A worker blocked in a step (a long generation, a wait for weights) would notice the closed
    socket only when the step ends; a SIGKILLed controller must not leave it running. On Linux the
    kernel sends SIGKILL (``PR_SET_PDEATHSIG``); elsewhere a thread polls the parent pid. The check
    after ``prctl`` covers a parent that died before it was set. On Linux no thread is started, so
    the process backend's zygote, which forks workers, stays single-threaded.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)
    if sys.platform.startswith("linux"):
        return

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def run_worker(fd: int, parent: int) -> None:
    """Serve the controller on the connected socket ``fd`` until it closes; die with ``parent``.

    A worker started as its own interpreter (``main``) and one forked by the process backend's zygote
    (``backends.process.zygote``, whose workers die with the zygote) both run this.
    """
    die_with_parent(parent)
    sock = socket.socket(fileno=fd)
    try:
        serve(sock)
    except ConnectionLost:
        pass  # the controller went away: exit quietly
    finally:
        sock.close()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the controller decides
    run_worker(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else os.getppid())


if __name__ == "__main__":
    main()
