"""The ``local`` backend: every program in this process, driven by the controller's threads (the default)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowrl.backend_traits import BACKENDS
from flowrl.graph.ir import Graph
from flowrl.graph.kinds import KINDS
from flowrl.runtime.backends.backend import OnStep
from flowrl.runtime.programs.table import build_program
from flowrl.runtime.programs.nodes import NodeProgram, ProgramEnv, SharedTransports

if TYPE_CHECKING:
    from flowrl.placement.layout import Placement
    from flowrl.runtime.config import RunConfig
    from flowrl.runtime.staleness import StalenessGate
    from flowrl.runtime.control.controller import RunResult

__all__ = ["LocalBackend", "LocalPrograms"]


class LocalBackend:
    """Threads in this process: both sides of a weight edge share one transport object."""

    name = "local"
    crosses_processes = BACKENDS["local"].crosses_processes

    def run(
        self, graph: Graph, placement: Placement | None, config: RunConfig, *, on_step: OnStep | None = None, gate: StalenessGate | None = None
    ) -> RunResult:
        """Run ``graph`` here; torch's intra-op threads are divided among the placement's colocation groups."""
        from flowrl.runtime.backends.drive import run_with_controller

        return run_with_controller(graph, placement, config, lambda env, placement: LocalPrograms(graph, env),
                                   crosses_processes=False, set_threads=True, on_step=on_step, gate=gate)


class LocalPrograms:
    """Builds each node's program here; both sides of a weight edge share one transport object."""

    def __init__(self, graph: Graph, env: ProgramEnv) -> None:
        self.graph = graph
        self.env = env
        self.transports = SharedTransports(env.transports)

    def open(self) -> dict[str, NodeProgram]:
        programs: dict[str, NodeProgram] = {}
        try:
            for node in self.graph.nodes:
                if KINDS[node.kind].runs_on != "policy":  # a loss runs in its policy
                    programs[node.name] = build_program(self.graph, node.name, self.env, self.transports)
        except BaseException:
            for program in programs.values():  # those built already may hold processes (a vLLM engine)
                program.close()
            self.close()
            raise
        return programs

    def close(self) -> None:
        self.transports.close()
