"""The graph's structure: ``GraphSpec`` (plain data) and ``GraphStructure``, its typed accessors.

``GraphSpec`` is the serialisable form (msgspec structs only). ``GraphStructure`` wraps a spec with a
private networkx ``DiGraph`` of the data edges and answers questions about it: producers, users,
topological order, the RL loop. It checks nothing: it is what the rules of ``flowrl.graph.validate``
read, and ``flowrl.graph.ir.Graph`` is the same structure once validated (the one users hold).
"""


from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

import msgspec
import networkx as nx

from flowrl.graph.fields import FieldType
from flowrl.graph.configs import HFModelConfig
from flowrl.graph.defaults import DefaultUsed, defaults_line
from flowrl.graph.kinds import KINDS
from flowrl.graph.nodes import IN_POLICY_KINDS, GeneratorNode, Node, NodeBase, PolicyNode, SourceNode, describe

N = TypeVar("N", bound=NodeBase)

__all__ = ["DataEdge", "WeightEdge", "GraphSpec", "GraphStructure", "SCHEMA_VERSION", "generators_fed_by", "tokenizer_path"]

SCHEMA_VERSION = 1


class DataEdge(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Batches flow from ``src`` to ``dst``, carrying the named, typed ``fields``."""

    src: str
    dst: str
    fields: dict[str, FieldType]


class WeightEdge(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Parameters flow from a trainable node to a weight-holding node.

    Attributes:
        src: the node that owns trainable weights (a policy).
        dst: the node that consumes them (a generator or reference).
        transport: a registered weight transport (``flowrl.runtime.transports``).
        max_staleness: k in ``policy_version_at_consumption - rollout_version <= k``; 0 is
            synchronous on-policy training.
        in_flight: the consumer takes new weights between decode steps, not only between batches
            (partial rollouts; a generator with ``batching="continuous"`` only). Every token then
            records the version that drew it (``token_versions``), and the bound holds for a
            sample's oldest token.
    """

    src: str
    dst: str
    transport: str = "inprocess"
    max_staleness: int = 1
    in_flight: bool = False


class GraphSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The whole graph as plain data: what ``to_json`` writes and ``from_json`` reads."""

    name: str
    nodes: tuple[Node, ...]
    edges: tuple[DataEdge, ...] = ()
    weight_edges: tuple[WeightEdge, ...] = ()
    schema_version: int = SCHEMA_VERSION


class GraphStructure:
    """A ``GraphSpec`` with its data edges as a DAG and typed accessors; unchecked.

    Args:
        spec: the plain-data graph.
        defaults: the values ``GraphBuilder`` set from a model kind's defaults
            (``flowrl.graph.defaults``), named by ``str()``; not part of the spec (a graph file
            holds the values, and a graph read from one names none).
    """

    def __init__(self, spec: GraphSpec, *, defaults: tuple[DefaultUsed, ...] = ()) -> None:
        self._spec = spec
        self.defaults = defaults
        self._nodes: dict[str, Node] = {}
        for node in spec.nodes:
            self._nodes.setdefault(node.name, node)
        self._dag = nx.DiGraph()
        self._dag.add_nodes_from(self._nodes)
        for edge in spec.edges:
            self._dag.add_edge(edge.src, edge.dst)

    # -- plain data -----------------------------------------------------------------------------
    @property
    def spec(self) -> GraphSpec:
        return self._spec

    @property
    def name(self) -> str:
        return self._spec.name

    @property
    def nodes(self) -> tuple[Node, ...]:
        return self._spec.nodes

    @property
    def edges(self) -> tuple[DataEdge, ...]:
        return self._spec.edges

    @property
    def weight_edges(self) -> tuple[WeightEdge, ...]:
        return self._spec.weight_edges

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def __iter__(self) -> Iterator[Node]:
        return iter(self._spec.nodes)

    def __len__(self) -> int:
        return len(self._spec.nodes)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GraphStructure) and other._spec == self._spec

    __hash__ = None  # type: ignore[assignment]  # unhashable on purpose; typeshed types object.__hash__ as a method

    # -- typed accessors ------------------------------------------------------------------------
    def node(self, name: str) -> Node:
        """The node called ``name``; ``KeyError`` naming the known nodes if there is none."""
        try:
            return self._nodes[name]
        except KeyError:
            raise KeyError(f"no node {name!r} in graph {self.name!r}; nodes: {sorted(self._nodes)}") from None

    def nodes_of_kind(self, kind: str) -> list[Node]:
        return [n for n in self._spec.nodes if n.kind == kind]

    def node_of(self, name: str, struct: type[N]) -> N:
        """The node called ``name``, typed as ``struct``: ``TypeError`` when it is of another kind."""
        node = self.node(name)
        if not isinstance(node, struct):
            raise TypeError(f"node {name!r} of graph {self.name!r} is a {node.kind}, not a {struct.__struct_config__.tag}")
        return node

    def nodes_of(self, struct: type[N]) -> list[N]:
        """The nodes of one kind's struct, typed as it: its own fields (``policy.optimizer``) read without a cast."""
        return [n for n in self._spec.nodes if isinstance(n, struct)]

    def producers(self, name: str) -> list[Node]:
        """Nodes with a data edge into ``name`` (an edge from an undeclared node, which validation
        reports, names no node and is left out)."""
        return [self._nodes[p] for p in sorted(self._dag.predecessors(name)) if p in self._nodes]

    def users(self, name: str) -> list[Node]:
        """Nodes with a data edge out of ``name`` (edges to undeclared nodes left out, as in ``producers``)."""
        return [self._nodes[s] for s in sorted(self._dag.successors(name)) if s in self._nodes]

    def in_edges(self, name: str) -> list[DataEdge]:
        return [e for e in self._spec.edges if e.dst == name]

    def out_edges(self, name: str) -> list[DataEdge]:
        return [e for e in self._spec.edges if e.src == name]

    def weight_edges_into(self, name: str) -> list[WeightEdge]:
        return [e for e in self._spec.weight_edges if e.dst == name]

    def weight_edges_from(self, name: str) -> list[WeightEdge]:
        return [e for e in self._spec.weight_edges if e.src == name]

    def find_cycle(self) -> list[str] | None:
        """A cycle among data edges as ``[a, b, ..., a]``, or None if they form a DAG."""
        try:
            cycle = nx.find_cycle(self._dag)
        except nx.NetworkXNoCycle:
            return None
        return [u for u, _ in cycle] + [cycle[0][0]]

    def topological_order(self) -> list[Node]:
        """Nodes so that every producer comes before its users; ties broken by declaration order."""
        position = {n.name: i for i, n in enumerate(self._spec.nodes)}
        try:
            order = list(nx.lexicographical_topological_sort(self._dag, key=position.__getitem__))
        except nx.NetworkXUnfeasible:  # only an invalid graph (a data cycle) gets here
            order = list(self._nodes)
        return [self._nodes[n] for n in order]

    def rl_loop(self, weight_edge: WeightEdge) -> list[str]:
        """The data path that a weight edge closes into a loop: ``dst`` ... ``src`` (generator to policy)."""
        try:
            return list(nx.shortest_path(self._dag, weight_edge.dst, weight_edge.src))
        except (nx.NetworkXNoPath, nx.NodeNotFound):
            return []

    def updates_per_batch(self) -> int:
        """Policy versions per trainer step (batch): the policies' ``num_iterations * num_mini_batches``
        (validation keeps them equal); 1 without a policy."""
        return max((n.optimizer.updates_per_batch for n in self.nodes_of(PolicyNode)), default=1)

    def max_staleness(self, override: int | None = None) -> int:
        """The run's effective staleness bound k: ``override`` when given (``--max-staleness``), else
        the smallest ``max_staleness`` of the weight edges into nodes gated on the version clock
        (``KindSpec.waits_for_weights``: generators; a syncing reference's edge takes the version its
        sync names, not one within a bound), the tightest one binds; 0 without any."""
        if override is not None:
            return override
        return min((e.max_staleness for e in self.gated_weight_edges()), default=0)

    def gated_weight_edges(self) -> list[WeightEdge]:
        """The weight edges into nodes whose steps wait on the version clock (``KindSpec.waits_for_weights``)."""
        return [e for e in self.weight_edges if e.dst in self._nodes and KINDS[self._nodes[e.dst].kind].waits_for_weights]

    def loss_of(self, policy: str) -> Node | None:
        """The loss node feeding ``policy``, if any: the node of a kind that runs inside its policy's step."""
        losses = [n for n in self.producers(policy) if n.kind in IN_POLICY_KINDS]
        return losses[0] if losses else None

    # -- text form ------------------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [f"graph {self.name}"]
        for node in self.topological_order():
            line = f"  {node.name} = {node.kind}({describe(node)})"
            ins = [f"{e.src}[{','.join(sorted(e.fields))}]" for e in sorted(self.in_edges(node.name), key=lambda e: e.src)]
            if ins:
                line += " <- " + " ".join(ins)
            lines.append(line)
        for w in self._spec.weight_edges:
            lines.append(f"  {w.src} ~> {w.dst}  weights(transport={w.transport}, max_staleness={w.max_staleness})")
        return "\n".join(lines + defaults_line(self.defaults))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, nodes={len(self)}, edges={len(self.edges)}, weight_edges={len(self.weight_edges)})"


def generators_fed_by(graph: GraphStructure, source: str) -> list[GeneratorNode]:
    """The generators reading prompts from ``source``."""
    return [n for n in graph.users(source) if isinstance(n, GeneratorNode)]


def tokenizer_path(graph: GraphStructure, source: str) -> str:
    """The tokenizer directory of data source ``source`` ('' when it names none and feeds no HF model)."""
    node = graph.node(source)
    if isinstance(node, SourceNode) and node.source.tokenizer:
        return node.source.tokenizer
    for gen in generators_fed_by(graph, source):
        if isinstance(gen.model, HFModelConfig):
            return gen.model.tokenizer_path
    return ""
