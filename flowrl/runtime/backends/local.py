"""The ``local`` backend: every program in this process, driven by the controller's threads (the default)."""

from __future__ import annotations

from flowrl.graph.ir import Graph
from flowrl.runtime.programs import NodeProgram, ProgramEnv, SharedTransports, build_program

__all__ = ["LocalBackend"]


class LocalBackend:
    """Builds each node's program here; both sides of a weight edge share one transport object."""

    name = "local"

    def __init__(self, graph: Graph, env: ProgramEnv) -> None:
        self.graph = graph
        self.env = env
        self.transports = SharedTransports(env.transports)

    def open(self) -> dict[str, NodeProgram]:
        hosts: dict[str, NodeProgram] = {}
        try:
            for node in self.graph.nodes:
                if node.kind != "loss":
                    hosts[node.name] = build_program(self.graph, node.name, self.env, self.transports)
        except BaseException:
            self.close()
            raise
        return hosts

    def close(self) -> None:
        self.transports.close()
