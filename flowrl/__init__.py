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
    register_objective,
    to_json,
)

__version__ = "0.1.0"

import os as _os

if _os.environ.get("FLOWRL_QUIET_VLLM") == "1":  # a process vLLM spawned for flowrl: filter vLLM's import-time noise
    from flowrl.operators.engines.vllm_logging import quiet_import_noise as _quiet_import_noise

    _quiet_import_noise()

# The runtime (torch) loads on first use, so that building a graph imports no torch.
_LAZY = {
    "run_graph": "flowrl.runtime.run",
    "RunConfig": "flowrl.runtime.config",
    "RunResult": "flowrl.runtime.control.controller",
    "Placement": "flowrl.placement.layout",
}


def __getattr__(name: str):
    """``from flowrl import run_graph, RunConfig, RunResult, Placement`` imports the runtime (or the placement) only then."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'flowrl' has no attribute {name!r}")

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
    "register_objective",
    "FlowrlError",
    "GraphError",
    "ConfigError",
    "PlanError",
    "NodeExecutionError",
    "run_graph",
    "RunConfig",
    "RunResult",
    "Placement",
]
