"""The driver shared by the backends whose controller runs in this process over host objects (local, process).

A *host* is what the controller's executor thread calls for one node: a program built here
(``local``) or a proxy to a program in a worker process (``process``). :func:`run_hosted` resolves
the placement, opens every weight edge's transport options in a temporary run directory, opens the
hosts, runs the controller over them, and closes everything whatever happens.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Protocol

import torch

from flowrl.graph.ir import Graph
from flowrl.runtime.backends.base import OnStep
from flowrl.runtime.config import RunConfig
from flowrl.runtime.controller import Controller, RunResult
from flowrl.runtime.placement import Placement, run_placement
from flowrl.runtime.programs import NodeProgram, ProgramEnv
from flowrl.runtime.weight_edges import transport_specs

__all__ = ["Hosts", "run_hosted"]


class Hosts(Protocol):
    """The programs of one run: ``open`` builds (or starts) one per executor node, ``close`` ends them."""

    def open(self) -> dict[str, NodeProgram]: ...

    def close(self) -> None: ...


def run_hosted(
    graph: Graph,
    config: RunConfig,
    make_hosts: Callable[[ProgramEnv, Placement], Hosts],
    *,
    crosses_processes: bool,
    set_threads: bool,
    on_step: OnStep | None = None,
) -> RunResult:
    """Run ``graph`` with one controller in this process over the hosts ``make_hosts`` gives.

    Args:
        graph, config: what to run and how.
        make_hosts: builds the run's hosts from the programs' environment and the placement.
        crosses_processes: the hosts live in other processes (decides the weight edges' transports).
        set_threads: size this process's torch intra-op threads for the run (the programs run here).
        on_step: called with each metrics row.
    """
    placement = run_placement(graph, config)
    with tempfile.TemporaryDirectory(prefix="flowrl-run-") as run_dir:
        env = ProgramEnv(
            transports=transport_specs(graph, run_dir, crosses_processes=crosses_processes),
            programs=dict(config.programs),
            seed=config.seed,
            options=dict(config.options),
        )
        hosts = make_hosts(env, placement)
        threads = torch.get_num_threads()
        if set_threads:
            torch.set_num_threads(config.threads or placement.threads_per_group())
        try:
            controller = Controller(graph, config, hosts.open(), placement, on_step=on_step)
            return controller.run()
        finally:
            hosts.close()
            torch.set_num_threads(threads)
