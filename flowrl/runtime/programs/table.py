"""The runtime's table of node programs: kind name -> the builder of its program, and ``build_program``.

``PROGRAMS[kind](node, graph, env, transports) -> NodeProgram`` builds what an executor runs for a
node of that kind (``flowrl.runtime.programs.nodes``, the critic's ``flowrl.runtime.programs.critic``). A
kind that runs inside its policy's step (``runs_on="policy"``: a loss) has none. A new kind adds its
builder here (``PROGRAMS[kind] = build``), beside its entry in ``flowrl.graph.kinds.KINDS``;
``tests/graph/test_kinds.py`` checks every kind that needs a program has one. On a mesh of several
ranks, ``flowrl.runtime.backends.torchrun.rank_programs.RANK_PROGRAMS`` says which kinds run on every rank.

Example:
    >>> sorted(PROGRAMS) == sorted(k for k, s in KINDS.items() if s.runs_on != "policy")
    True
"""

from __future__ import annotations

from collections.abc import Callable

from flowrl.errors import ConfigError, NodeBuildError
from flowrl.graph.ir import Graph
from flowrl.graph.kinds import KINDS
from flowrl.graph.nodes import Node
from flowrl.graph.refs import resolve
from flowrl.runtime.programs.critic import build_critic
from flowrl.runtime.programs.nodes import (
    NodeProgram,
    ProgramEnv,
    SharedTransports,
    build_error,
    build_generator,
    build_policy,
    build_reference,
    build_reward_model,
    build_scorer,
    build_source,
    build_teacher,
)

__all__ = ["PROGRAMS", "ProgramBuilder", "build_program"]

#: Takes its kind's own node struct (the table's key picks it; ``Callable[[Node, ...]]`` would refuse
#: ``build_source(node: SourceNode, ...)``, parameters being contravariant), the graph, env and transports.
ProgramBuilder = Callable[..., NodeProgram]

#: Kind name -> its program builder (every kind that does not run inside its policy).
PROGRAMS: dict[str, ProgramBuilder] = {
    "source": build_source,
    "generator": build_generator,
    "scorer": build_scorer,
    "reference": build_reference,
    "reward_model": build_reward_model,
    "critic": build_critic,
    "teacher": build_teacher,
    "policy": build_policy,
}


def build_program(graph: Graph, name: str, env: ProgramEnv, transports: SharedTransports) -> NodeProgram:
    """The program for node ``name``: a user factory from ``env.programs`` or its kind's from ``PROGRAMS``.

    Raises:
        NodeBuildError: naming the node, whatever the factory or operator raised (``__cause__``).
    """
    from flowrl.runtime.programs.offload import wrap_program

    try:
        role = None if name in env.programs else env.offload.get(name)  # a user's program moves its own state
        return wrap_program(_build_program(graph, name, env, transports), role)  # type: ignore[arg-type]  # ProgramEnv.offload holds Roles typed as str
    except NodeBuildError:
        raise
    except Exception as exc:
        raise build_error(graph, name, exc) from exc


def _build_program(graph: Graph, name: str, env: ProgramEnv, transports: SharedTransports) -> NodeProgram:
    node: Node = graph.node(name)
    if name in env.programs:  # a user's factory: a reference named in the run's config
        factory: Callable[..., NodeProgram] = resolve(env.programs[name])
        return factory(node, graph, env, transports)
    if node.kind not in PROGRAMS:
        runs_in_policy = node.kind in KINDS and KINDS[node.kind].runs_on == "policy"
        raise ConfigError(
            f"node {name!r} of kind {node.kind!r} has no program "
            + ("(loss nodes run inside their policy)" if runs_in_policy else "; add its builder to flowrl.runtime.programs.table.PROGRAMS")
        )
    return PROGRAMS[node.kind](node, graph, env, transports)
