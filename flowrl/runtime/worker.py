"""The worker process of the ``process`` backend: hosts one node's program and answers the controller.

Started as ``python -m flowrl.runtime.worker FD`` with a connected socket on file descriptor FD.
The first message is ``init`` (the graph as JSON, the node name, the ``ProgramEnv``, the cores to
pin to); then requests ``start``, ``seek``, ``step``, ``save``, ``load``, ``close``, each answered by
``{"ok": true, ...}`` or ``{"ok": false, "error": ..., "traceback": ...}``. When the controller's end
of the socket closes (it exited or was killed) the worker exits: no orphans.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import traceback

import msgspec
import torch

from flowrl.graph.serialize import from_json
from flowrl.runtime.programs import ProgramEnv, SharedTransports, build_program
from flowrl.runtime.wire import ConnectionLost, recv_message, send_message

__all__ = ["serve"]


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
    except Exception as exc:  # noqa: BLE001 - reported to the controller, which raises it
        send_message(sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return
    try:
        while True:
            request, tensors = recv_message(sock)
            op = request["op"]
            try:
                if op == "close":
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
                    program.save(request["path"])
                elif op == "load":
                    program.load(request["path"])
                else:
                    raise ValueError(f"unknown request {op!r}")
                send_message(sock, {"ok": True})
            except Exception as exc:  # noqa: BLE001
                send_message(sock, {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
    finally:
        transports.close()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the controller decides
    fd = int(sys.argv[1])
    sock = socket.socket(fileno=fd)
    try:
        serve(sock)
    except ConnectionLost:
        pass  # the controller went away: exit quietly
    finally:
        sock.close()


if __name__ == "__main__":
    main()
