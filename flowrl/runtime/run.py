"""``run_graph``: the one call that executes a graph: the checks every backend needs, then the backend.

``run_graph(graph, placement, config)`` runs ``graph`` with its device nodes where ``placement``
(a ``flowrl.placement.Placement``) puts them; ``run_graph(graph, config)`` (or a ``None``
placement) uses the default, the run strategy for the staleness bound on this machine's devices
(``flowrl.placement.default``: every device node colocated for k = 0, generators and trainers on
disjoint halves otherwise), which needs no planner. A plan file or a JSON placement becomes a
placement with ``flowrl.planners.forms.read_placement`` (what ``flowrl run --plan`` does).

The backend (``RunConfig.backend``) comes from the registry in ``flowrl.runtime.backends.backend``; it
decides where the programs live and the transports the weight edges open.

Example:
    >>> from flowrl.examples import build_example
    >>> from flowrl.placement import NodeMesh, Placement
    >>> from flowrl.runtime.config import RunConfig
    >>> from flowrl.runtime.run import run_graph
    >>> placement = Placement(nodes={"gen": NodeMesh(devices=(0,)), "policy": NodeMesh(devices=(1,))})
    >>> result = run_graph(build_example("llamarl"), placement, RunConfig(steps=2, progress=False))
    >>> len(result.rows), result.version
    (2, 2)
"""

from __future__ import annotations

from typing import overload

from flowrl.backend_traits import backend_traits
from flowrl.errors import ConfigError
from flowrl.graph.ir import Graph
from flowrl.placement.layout import Placement
from flowrl.runtime.backends.backend import OnStep, create_backend, takes_gate
from flowrl.runtime.config import RunConfig
from flowrl.runtime.control.controller import RunResult

__all__ = ["run_graph"]


@overload
def run_graph(graph: Graph, config: RunConfig, /, *, on_step: OnStep | None = None) -> RunResult: ...


@overload
def run_graph(graph: Graph, placement: Placement | None, config: RunConfig, /, *, on_step: OnStep | None = None) -> RunResult: ...


def run_graph(
    graph: Graph, placement: Placement | RunConfig | None = None, config: RunConfig | None = None, /, *, on_step: OnStep | None = None
) -> RunResult:
    """Execute ``graph`` on ``placement`` for ``config.steps`` trainer steps on ``config.backend``.

    Args:
        graph: what to run.
        placement: where its device nodes run; omitted (``run_graph(graph, config)``) or None: the
            default placement (module docstring).
        config: how to run it.
        on_step: called with each metrics row.

    Raises:
        ConfigError: no ``RunConfig``, or a placement that is not a ``Placement`` (a path: read it
            with ``flowrl.planners.forms.read_placement``).
        PlanError: a placement that does not place exactly the graph's device nodes.
        ConfigError: a node whose mesh has an axis its program does not run on this backend
            (``preflight.check_meshes``, read from ``flowrl.mesh_support.MESH_SUPPORT``).
        ConfigError: an unknown backend, ``config.device="cuda"`` on a machine without CUDA, a
            policy with ``sharding="fsdp"`` on a backend other than torchrun, a model that does not
            fit in this machine's memory, or a generator engine that cannot run here
            (``preflight.check_engines``), or ``packing=True`` with a model family that cannot take
            packed rows (``preflight.check_packing_families``).
        TransportError: a weight edge names a transport this process has not registered.
        ConfigError: also ``config.eval_data`` that cannot be read or lacks a field the prompt or a
            scorer needs, or is given for a graph whose source is a task (``evaluation.check_eval_data``).
        ConfigError: also ``config.offload="on"`` for a trainer that shares no device with a
            generator (``flowrl.runtime.programs.offload.offload_roles``).
        NodeExecutionError: a node failed while running (or an evaluation, ``config.eval_every``).

    Warns:
        GraphWarning: for each of ``flowrl.graph.advice.advice(graph)``.
    """
    from flowrl.graph.advice import warn_about
    from flowrl.host import release_freed_memory
    from flowrl.runtime.parallel.fsdp import check_backend
    from flowrl.runtime.names import check_names
    from flowrl.runtime.control.executor_placement import resolve_device
    from flowrl.runtime.preflight import check_engines, check_fits_in_memory, check_meshes, check_packing_families, check_teachers
    from flowrl.runtime.staleness import StalenessGate

    if isinstance(placement, RunConfig) and config is None:  # run_graph(graph, config)
        placement, config = None, placement
    if not isinstance(config, RunConfig):
        raise ConfigError(f"run_graph(graph, placement, config) needs a RunConfig as config, not {type(config).__name__}")
    if placement is not None and not isinstance(placement, Placement):
        raise ConfigError(
            f"run_graph's placement must be a flowrl.placement.Placement or None, not {type(placement).__name__} "
            f"({placement!r}); read a plan file or a JSON placement with flowrl.planners.forms.read_placement(path, graph)"
        )
    device = resolve_device(config.device)  # refuse --device cuda without CUDA before any work
    backend = create_backend(config.backend)
    check_backend(graph, backend.name, skip=config.programs)  # sharding="fsdp" runs under torchrun only
    if placement is not None:  # an axis a node's program does not run: refused, never run as something else (mesh_support)
        check_meshes(graph, placement, backend=backend.name, device=device, skip=config.programs)
    if not backend_traits(backend.name).ranks:  # under torchrun each rank checks its share (preflight.check_ranks_fit)
        check_fits_in_memory(graph, skip=frozenset(config.programs))  # user programs allocate what they like
    check_engines(graph, backend=config.backend, device=device, skip=frozenset(config.programs))
    check_packing_families(graph, skip=frozenset(config.programs))  # packing=True with a family that cannot pack
    check_teachers(graph, skip=frozenset(config.programs))  # a teacher with another tokenizer than its student's
    if config.eval_every:
        from flowrl.runtime.evaluation.during_run import check_eval_data

        check_eval_data(graph, str(config.eval_data))  # a missing file or column: refused before any work
    check_names(graph)  # tasks, objectives, transports: the registries of this process, where the run starts
    # the run's one gate, which everything that needs k reads; a user's backend that takes none builds
    # it in the built-in backend it calls (so that a run still builds one)
    gate = StalenessGate.of(graph, config.max_staleness) if takes_gate(backend) else None
    if config.offload == "on" or (config.offload == "auto" and placement is not None and placement.offload):  # refused before any work
        from flowrl.runtime.programs.offload import offload_roles
        from flowrl.runtime.control.executor_placement import run_placement

        if backend_traits(backend.name).ranks:  # its ranks hold the default placement of the job's world: refused or said without it
            offload_roles(graph, placement or Placement(nodes={}), config.offload, device=device, backend=backend.name)
        else:
            offload_roles(graph, run_placement(graph, placement, config, backend=backend.name, gate=gate), config.offload, device=device, backend=backend.name)
    warn_about(graph)  # legal but most likely a mistake (n_samples=1 with a group baseline): GraphWarning
    try:
        if gate is not None:
            return backend.run(graph, placement, config, on_step=on_step, gate=gate)
        return backend.run(graph, placement, config, on_step=on_step)  # a user's backend that takes no gate
    finally:
        release_freed_memory()  # a notebook's next run starts from what is live, not what this one freed
