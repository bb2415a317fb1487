"""The graph IR users hold: ``Graph``, a validated ``GraphStructure`` (``flowrl.graph.structure``).

``GraphSpec`` is the serialisable form (msgspec structs only); ``Graph`` wraps a spec with typed
accessors (producers, users, topological order, the RL loop) once every rule of
``flowrl.graph.validate`` holds. A ``Graph`` is immutable; build one with
``flowrl.graph.builder.GraphBuilder`` or ``Graph(spec)``, which validates. Which task, objective,
transport or backend a name refers to is the run's business: ``flowrl.runtime.names`` consults the
registries at run start, so building a graph imports no torch.

``str(graph)`` is a stable one-line-per-node form, in topological order, that tests compare against:

    >>> from flowrl.examples import build_example
    >>> print(build_example("llamarl"))  # doctest: +ELLIPSIS
    graph llamarl
      prompts = source(task=copy, batch=16)
      gen = generator(model=2L64d, n=16, max_new=5, T=1) <- prompts[prompt_ids,prompt_index,prompt_lens]
      ...
      policy = policy(model=2L64d, lr=0.001) <- aipo[objective]
      policy ~> gen  weights(transport=inprocess, max_staleness=1)

Pictures of a graph come from the free functions of ``flowrl.pictures`` (DOT, Mermaid, SVG).
"""

from __future__ import annotations

from flowrl.graph.defaults import DefaultUsed
from flowrl.graph.structure import SCHEMA_VERSION, DataEdge, GraphSpec, GraphStructure, WeightEdge
from flowrl.graph.validate import validate_graph

__all__ = ["DataEdge", "WeightEdge", "GraphSpec", "Graph", "SCHEMA_VERSION"]


class Graph(GraphStructure):
    """A validated RL pipeline.

    Args:
        spec: the plain-data graph.
        validate: check every rule (``flowrl.graph.validate``) and raise ``GraphError`` on the first
            broken one. Only tests that study invalid graphs turn this off.
        defaults: the values a model kind's defaults set (``GraphBuilder`` passes them;
            ``flowrl.graph.defaults``), which ``str(graph)`` names.

    Example:
        >>> from flowrl.examples import build_example
        >>> g = build_example("llamarl")
        >>> [n.name for n in g.topological_order()]
        ['prompts', 'gen', 'reward', 'aipo', 'policy']
    """

    def __init__(self, spec: GraphSpec, *, validate: bool = True, defaults: tuple[DefaultUsed, ...] = ()) -> None:
        super().__init__(spec, defaults=defaults)
        if validate:
            validate_graph(self)
