"""``run_graph``: the one call that executes a graph: placement, transports, backend, controller.

Example:
    >>> from flowrl.examples import build_example
    >>> from flowrl.runtime import RunConfig, run_graph
    >>> result = run_graph(build_example("llamarl"), RunConfig(steps=2))  # doctest: +SKIP
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

import torch

from flowrl.errors import ConfigError
from flowrl.graph.ir import Graph, WeightEdge
from flowrl.runtime.config import RunConfig
from flowrl.runtime.controller import Controller, RunResult
from flowrl.runtime.placement import Placement, default_placement, placement_from_plan
from flowrl.runtime.programs import ProgramEnv, TransportSpec
from flowrl.runtime.transports.registry import check_transports, transport_reference, transport_traits

__all__ = ["run_graph", "transport_specs", "resolve_placement", "SHARED_MEMORY"]

#: The built-in transport that carries weights between the processes of one machine.
SHARED_MEMORY = "shm"


def transport_specs(
    graph: Graph, backend: str, run_dir: str, *, choose: Callable[[WeightEdge], str] | None = None
) -> tuple[TransportSpec, ...]:
    """Open options for each weight edge's transport, from the transport's traits.

    ``choose`` maps an edge to the name of the transport this backend uses for it; by default, in
    the process backend a transport that cannot cross processes (``inprocess``) becomes ``shm``
    (shared memory). A transport that ``needs_segment`` gets a fresh shared-memory segment name, one
    that ``needs_directory`` a folder under ``run_dir``; a user transport carries its factory's reference.

    Raises:
        TransportError: an edge names a transport nobody registered, or a user transport that
            another process cannot import.
    """
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    specs = []
    for e in graph.weight_edges:
        if choose is not None:
            name = choose(e)
        else:
            crossing = backend == "process" and not transport_traits(e.transport).crosses_processes
            name = SHARED_MEMORY if crossing else e.transport
        traits = transport_traits(name)
        writer: dict[str, Any] = {}
        reader: dict[str, Any] = {}
        if traits.needs_segment:
            seg = f"flowrl-{token}-{e.src}-{e.dst}"
            writer, reader = {"name": seg, "create": True}, {"name": seg, "create": False}
        elif traits.needs_directory:
            directory = os.path.join(run_dir, f"weights-{e.src}-{e.dst}")
            writer = reader = {"directory": directory}
        factory = transport_reference(name) if backend == "process" else ""  # torchrun ranks load the graph file themselves
        specs.append(TransportSpec(src=e.src, dst=e.dst, name=name, factory=factory, writer_options=writer, reader_options=reader))
    return tuple(specs)


def resolve_placement(graph: Graph, config: RunConfig) -> Placement:
    k = config.max_staleness
    if k is None:
        k = min((e.max_staleness for e in graph.weight_edges), default=0)
    if config.plan is None:
        return default_placement(graph, k)
    from flowrl.planners.plan import load_plan

    return placement_from_plan(graph, load_plan(config.plan), path=config.plan)


def run_graph(graph: Graph, config: RunConfig, *, on_step: Callable[[dict[str, Any]], None] | None = None) -> RunResult:
    """Execute ``graph`` for ``config.steps`` trainer steps; raises ``NodeExecutionError`` on failure."""
    from flowrl.runtime.preflight import check_fits_in_memory

    check_fits_in_memory(graph, skip=frozenset(config.programs))  # user programs allocate what they like
    check_transports(e.transport for e in graph.weight_edges)  # the registry of this process, where the run starts
    if config.backend == "torchrun":  # every rank calls this; placement, transports and controller are its own
        from flowrl.runtime.backends.torchrun import run_torchrun

        return run_torchrun(graph, config, on_step=on_step)
    placement = resolve_placement(graph, config)
    with tempfile.TemporaryDirectory(prefix="flowrl-run-") as run_dir:
        env = ProgramEnv(
            transports=transport_specs(graph, config.backend, run_dir),
            programs=dict(config.programs),
            seed=config.seed,
            options=dict(config.options),
        )
        if config.backend == "local":
            from flowrl.runtime.backends.local import LocalBackend

            backend: Any = LocalBackend(graph, env)
        elif config.backend == "process":
            from flowrl.runtime.backends.process import ProcessBackend

            backend = ProcessBackend(graph, env, placement)
        else:  # RunConfig's Literal already refuses others; kept for direct callers
            raise ConfigError(f"unknown backend {config.backend!r}; choose local, process or torchrun")
        threads = torch.get_num_threads()
        if config.backend == "local":
            torch.set_num_threads(config.threads or placement.threads_per_group())
        try:
            hosts = backend.open()
            controller = Controller(graph, config, hosts, placement, on_step=on_step)
            return controller.run()
        finally:
            backend.close()
            torch.set_num_threads(threads)
