"""Helpers shared by the runtime tests."""

from __future__ import annotations

from flowrl.graph.ir import Graph
from flowrl.runtime.config import RunConfig
from flowrl.runtime.synthetic import synthetic_programs


def synthetic_config(graph: Graph, **overrides) -> RunConfig:
    """A run of ``graph`` with every operator synthetic (2 ms steps unless ``options`` say otherwise)."""
    options = {"gen_s": 0.002, "train_s": 0.002, **overrides.pop("options", {})}
    return RunConfig(programs=synthetic_programs(graph), options=options, stall_timeout_s=30, **overrides)
