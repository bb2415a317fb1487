"""The names a graph uses, checked against this run's registries at run start.

A graph file holds names, not code: a built-in task (``TASKS``), an objective (``OBJECTIVES``; a user's
row travels in the file and its function is imported here), a
weight transport, a generator's environment. Building or validating a graph checks only their form (``flowrl.graph.validate``),
so the IR imports no torch; which names exist is known where the run starts, in the process that
registered them, and is checked here before any work.

Example:
    >>> from flowrl.examples import build_example
    >>> check_names(build_example("llamarl"))  # every name is known: nothing happens
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowrl.errors import ConfigError, GraphError
from flowrl.graph.refs import check_reference

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph

__all__ = ["check_names"]


def check_names(graph: Graph) -> None:
    """Refuse a task, objective or transport name that no registry of this process knows.

    Raises:
        ConfigError: an unknown task (listing the built-in ones).
        GraphError: an unknown objective (listing the known ones).
        ConfigError: a user's objective whose function cannot be imported.
        TransportError: an unknown transport (``check_transports``).
        ConfigError / GraphError: a generator's environment that does not resolve or lacks ``reset``/``step``.
    """
    from flowrl.graph.nodes import GeneratorNode, LossNode, SourceNode
    from flowrl.graph.objectives import OBJECTIVES, known_objectives
    from flowrl.operators.losses import objective_function
    from flowrl.operators.tasks import TASKS
    from flowrl.runtime.transports.registry import check_transports

    for node in graph.nodes_of(SourceNode):
        task = node.source.task
        if node.source.data or task in TASKS or check_reference(task) is None:
            continue
        raise ConfigError(
            f"source {node.name!r}: unknown task {task!r}; built-in tasks are {', '.join(sorted(TASKS))}, "
            "or name a factory (seed) -> Task as 'package.module:function' or 'path/to/file.py:function'"
        )
    for loss in graph.nodes_of(LossNode):
        config = loss.loss
        if config.row is None and config.objective not in OBJECTIVES:
            raise GraphError(f"loss {loss.name!r}: unknown objective {config.objective!r}; known objectives are {known_objectives()}")
        objective_function(config, owner=f"loss {loss.name!r}")  # a user's row: its function imports here, or ConfigError
    check_transports(e.transport for e in graph.weight_edges)
    for gen in graph.nodes_of(GeneratorNode):
        env = gen.env
        if env is not None:  # a multi-turn generator's environment: resolvable, with reset and step
            from flowrl.envs.environment import check_env
            from flowrl.graph.refs import resolve

            if env.agent:  # an agent program: a function (session, row) -> reward
                from flowrl.serve.check import check_program

                check_program(resolve(env.env), owner=f"generator {gen.name!r}")
            else:
                check_env(resolve(env.env), owner=f"generator {gen.name!r}")
