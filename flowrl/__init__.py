"""flowrl: declare an RL pipeline as a graph, plan it onto devices, run it asynchronously."""

from flowrl.errors import ConfigError, FlowrlError, GraphError, NodeExecutionError, PlanError
from flowrl.graph import (
    Graph,
    GraphBuilder,
    LossConfig,
    ModelConfig,
    OptimizerConfig,
    SamplingConfig,
    SourceConfig,
    from_json,
    to_json,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "Graph",
    "GraphBuilder",
    "ModelConfig",
    "SamplingConfig",
    "LossConfig",
    "OptimizerConfig",
    "SourceConfig",
    "to_json",
    "from_json",
    "FlowrlError",
    "GraphError",
    "ConfigError",
    "PlanError",
    "NodeExecutionError",
]
