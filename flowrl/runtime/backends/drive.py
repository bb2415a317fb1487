"""The driver shared by the backends whose controller runs in this process over a set of node programs (local, process).

A node's *program* is what the controller's executor thread calls for it: a program built here
(``local``) or a proxy to a program in a worker process (``process``). (In flowrl "host" means a
machine only.) :func:`run_with_controller` resolves
the placement, opens every weight edge's transport options in a temporary run directory, opens the
programs, runs the controller over them, and closes everything whatever happens.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Protocol

import torch

from flowrl.graph.ir import Graph
from flowrl.runtime.backends.backend import OnStep
from flowrl.runtime.parallel.threads import set_intra_op_threads
from flowrl.runtime.config import RunConfig
from flowrl.runtime.control.controller import Controller, RunResult
from flowrl.placement.layout import Placement
from flowrl.runtime.control.executor_placement import node_devices, resolve_device, run_placement
from flowrl.runtime.programs.nodes import NodeProgram, ProgramEnv
from flowrl.runtime.staleness import StalenessGate
from flowrl.runtime.weights.edges import transport_specs

__all__ = ["ProgramSet", "run_with_controller"]


class ProgramSet(Protocol):
    """The programs of one run: ``open`` builds (or starts) one per executor node, ``close`` ends them."""

    def open(self) -> dict[str, NodeProgram]: ...

    def close(self) -> None: ...


def run_with_controller(
    graph: Graph,
    placement: Placement | None,
    config: RunConfig,
    open_programs: Callable[[ProgramEnv, Placement], ProgramSet],
    *,
    crosses_processes: bool,
    set_threads: bool,
    on_step: OnStep | None = None,
    gate: StalenessGate | None = None,
) -> RunResult:
    """Run ``graph`` with one controller in this process over the programs ``open_programs`` gives.

    Args:
        graph, config: what to run and how.
        placement: where (None: the run strategy on this machine's devices, ``placement.run_placement``).
        open_programs: builds the run's programs from the programs' environment and the placement.
        crosses_processes: the programs live in other processes (decides the weight edges' transports).
        set_threads: the programs run here: size torch's intra-op threads for the run, one compute
            thread per colocation group (``flowrl.runtime.control.compute_threads``).
        on_step: called with each metrics row.
        gate: the run's staleness gate (``run_graph`` builds it once and hands it down; None, from a
            user's backend that subclasses a built-in and takes no gate: built here, once).
    """
    import warnings

    from flowrl.runtime.programs.offload import offload_roles
    from flowrl.runtime.preflight import check_meshes

    gate = gate if gate is not None else StalenessGate.of(graph, config.max_staleness)
    placement = run_placement(graph, placement, config, backend=config.backend, gate=gate)
    check_meshes(graph, placement, backend=config.backend, device=resolve_device(config.device), skip=config.programs)  # the default's too
    with warnings.catch_warnings():  # run_graph's check said them already
        warnings.simplefilter("ignore")
        roles = offload_roles(graph, placement, config.offload, device=resolve_device(config.device), backend=config.backend)
    with tempfile.TemporaryDirectory(prefix="flowrl-run-") as run_dir:
        env = ProgramEnv(
            transports=transport_specs(graph, run_dir, crosses_processes=crosses_processes),
            programs=dict(config.programs),
            seed=config.seed,
            options=dict(config.options),
            devices=node_devices(placement, resolve_device(config.device)),
            offload=dict(roles),
            staleness=gate,  # the controller's bounds, for the generator programs
        )
        programs = open_programs(env, placement)
        threads = torch.get_num_threads()
        group_threads = (config.threads or placement.threads_per_group()) if set_threads else None
        if group_threads is not None:
            # Only each colocation group's compute thread runs torch with several intra-op threads
            # (``compute_threads``: one OpenMP team per group); this thread builds the programs with one.
            set_intra_op_threads(1)
        try:
            controller = Controller(graph, config, programs.open(), placement, on_step=on_step, intra_op_threads=group_threads, gate=gate)
            return controller.run()
        finally:
            programs.close()
            torch.set_num_threads(threads)
