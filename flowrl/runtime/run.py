"""``run_graph``: the one call that executes a graph: the checks every backend needs, then the backend.

The backend (``RunConfig.backend``) comes from the registry in ``flowrl.runtime.backends.base``; it
decides where the programs live, the placement they run on and the transports the weight edges open.

Example:
    >>> from flowrl.examples import build_example
    >>> from flowrl.runtime.config import RunConfig
    >>> from flowrl.runtime.run import run_graph
    >>> result = run_graph(build_example("llamarl"), RunConfig(steps=2, progress=False))
    >>> len(result.rows), result.version
    (2, 2)
"""

from __future__ import annotations

from flowrl.graph.ir import Graph
from flowrl.runtime.backends.base import OnStep, create_backend
from flowrl.runtime.config import RunConfig
from flowrl.runtime.controller import RunResult

__all__ = ["run_graph"]


def run_graph(graph: Graph, config: RunConfig, *, on_step: OnStep | None = None) -> RunResult:
    """Execute ``graph`` for ``config.steps`` trainer steps on ``config.backend``.

    Raises:
        ConfigError: an unknown backend, ``config.device="cuda"`` on a machine without CUDA, a
            policy with ``sharding="fsdp"`` on a backend other than torchrun, a model that does not
            fit in this machine's memory, or a generator engine that cannot run here
            (``preflight.check_engines``).
        TransportError: a weight edge names a transport this process has not registered.
        ConfigError: also ``config.eval_data`` that cannot be read or lacks a field the prompt or a
            scorer needs, or is given for a graph whose source is a task (``evaluation.check_eval_data``).
        NodeExecutionError: a node failed while running (or an evaluation, ``config.eval_every``).

    Warns:
        GraphWarning: for each of ``flowrl.graph.advice.advice(graph)``.
    """
    from flowrl.graph.advice import warn_about
    from flowrl.runtime.fsdp import check_backend
    from flowrl.runtime.names import check_names
    from flowrl.runtime.placement import resolve_device
    from flowrl.runtime.preflight import check_engines, check_fits_in_memory

    device = resolve_device(config.device)  # refuse --device cuda without CUDA before any work
    backend = create_backend(config.backend)
    check_backend(graph, backend.name, skip=config.programs)  # sharding="fsdp" runs under torchrun only
    check_fits_in_memory(graph, skip=frozenset(config.programs))  # user programs allocate what they like
    check_engines(graph, backend=config.backend, device=device, skip=frozenset(config.programs))
    if config.eval_every:
        from flowrl.runtime.evaluation import check_eval_data

        check_eval_data(graph, str(config.eval_data))  # a missing file or column: refused before any work
    check_names(graph)  # tasks, objectives, transports: the registries of this process, where the run starts
    warn_about(graph)  # legal but most likely a mistake (n_samples=1 with a group baseline): GraphWarning
    return backend.run(graph, config, on_step=on_step)
