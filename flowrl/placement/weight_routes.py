"""Which weight edges of a torchrun job take the direct route into vLLM's workers: one rule, pure.

A weight edge into an engine whose weights move on into worker processes of its own
(``ENGINE_CAPS[engine].weight_hop``: vLLM) goes one of two ways in a torchrun job:

- **direct**: the policy's ranks send straight into vLLM's workers over one weight-sync group; the
  generator's rank only coordinates and holds no staging copy (an FSDP2 policy: every rank gathers
  each bucket, the first broadcasts it; a replicated policy's first rank sends alone);
- **hop**: the edge's transport (the collective by default) into the generator rank's staging copy,
  then vLLM's weight-sync group from there.

:func:`direct_edges` is the rule: an edge takes the direct route when its transport is the default
(``inprocess``), it is not in flight, no user program runs either end, its generator has such an
engine and lock-step batching, the generator has ranks (any mesh: one engine, ``dp`` replicas, vLLM
``tp`` > 1; one group reaches every worker of every engine), the policy's ranks and the generator's
are apart, neither end's model has LoRA adapters, and the policy is not split into pipeline stages
(``pipelined``: each stage holds only its own layers, so none gathers a whole bucket; its stages send
their own layers over the hop's collective). Every other edge
takes the hop. The runtime opens the edges it names (``runtime/weights/direct_route.direct_channels``)
and the planner prices them (``planners/estimate/direct.py``), so both read this one function.

Example:
    >>> from flowrl.examples import build_example
    >>> direct_edges(build_example("llamarl"), {"gen": (0,), "policy": (1, 2)})  # the built-in engine: no hop to skip
    frozenset()
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from flowrl.graph.configs import HFModelConfig
from flowrl.graph.engines import ENGINE_CAPS
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import GeneratorNode
from flowrl.graph.structure import WeightEdge
from flowrl.placement.layout import share_devices

__all__ = ["DIRECT", "HOP", "direct_edges", "route_of"]

#: The route names :func:`route_of` returns.
DIRECT, HOP = "direct", "hop"


def _has_adapters(node: object) -> bool:
    model = getattr(node, "model", None)
    return model is None or (isinstance(model, HFModelConfig) and model.lora is not None)


def route_of(
    graph: Graph, edge: WeightEdge, ranks: Mapping[str, Sequence[int]], programs: Collection[str] = (), pipelined: Collection[str] = ()
) -> str:
    """:data:`DIRECT` or :data:`HOP` for weight ``edge`` of ``graph`` with the nodes on ``ranks`` (the
    rule in the module docstring); ``programs``: the nodes a user program runs (``RunConfig.programs``);
    ``pipelined``: the policies whose mesh has ``pp`` > 1."""
    src, dst = edge.src, edge.dst
    if edge.transport != "inprocess" or edge.in_flight or src in programs or dst in programs or src in pipelined:
        return HOP
    gen = graph.node(dst)
    if not isinstance(gen, GeneratorNode) or not ENGINE_CAPS[gen.engine].weight_hop or gen.sampling.batching == "continuous":
        return HOP  # only an engine whose weights move on into workers of its own has a hop to skip
    mine, theirs = ranks.get(dst, ()), ranks.get(src, ())
    if not mine or share_devices(theirs, mine):
        return HOP  # colocated: a policy rank would share a device with a vLLM worker
    if _has_adapters(graph.node(src)) or _has_adapters(gen):
        return HOP
    return DIRECT


def direct_edges(
    graph: Graph, ranks: Mapping[str, Sequence[int]], programs: Collection[str] = (), pipelined: Collection[str] = ()
) -> frozenset[tuple[str, str]]:
    """The ``(policy, generator)`` weight edges that take the direct route (module docstring).

    Args:
        graph: the pipeline.
        ranks: node -> its ranks (a torchrun job's ``Placement.devices``; the planner's layout's devices).
        programs: nodes a user program runs (their edges take the hop).
        pipelined: policies whose mesh has ``pp`` > 1 (their edges take the hop).
    """
    return frozenset((e.src, e.dst) for e in graph.weight_edges if route_of(graph, e, ranks, programs, pipelined) == DIRECT)
