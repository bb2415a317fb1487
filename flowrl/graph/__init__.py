"""The graph: node kinds and their configs, the IR, validation and serialisation (its pictures: ``flowrl.pictures``)."""

from flowrl.graph.builder import GraphBuilder
from flowrl.graph.critic import CriticNode
from flowrl.graph.configs import LossConfig, ModelConfig, OptimizerConfig, SamplingConfig, SourceConfig
from flowrl.graph.fields import FIELDS, FieldType
from flowrl.graph.ir import DataEdge, Graph, GraphSpec, WeightEdge
from flowrl.graph.objectives import ObjectiveRow, register_objective
from flowrl.graph.nodes import (
    NODE_KINDS,
    GeneratorNode,
    LossNode,
    Node,
    PolicyNode,
    ReferenceNode,
    ScorerNode,
    SourceNode,
    signature,
)
from flowrl.graph.serialize import from_json, references, to_json

__all__ = [
    "GraphBuilder",
    "Graph",
    "GraphSpec",
    "DataEdge",
    "WeightEdge",
    "Node",
    "NODE_KINDS",
    "SourceNode",
    "GeneratorNode",
    "ScorerNode",
    "ReferenceNode",
    "CriticNode",
    "LossNode",
    "PolicyNode",
    "signature",
    "FieldType",
    "FIELDS",
    "ModelConfig",
    "SamplingConfig",
    "LossConfig",
    "OptimizerConfig",
    "SourceConfig",
    "to_json",
    "from_json",
    "references",
    "ObjectiveRow",
    "register_objective",
]
