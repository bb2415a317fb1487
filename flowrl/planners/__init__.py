"""The planner: cluster and model specs, cost and memory estimates, placement search, the ``Plan``.

A pipeline of pure functions: enumerate candidates (``strategies``) -> estimate time and memory
(``estimate``) -> search (``search``) -> emit a ``Plan`` (``plan``). A dry-run needs no hardware::

    >>> from flowrl.examples import build_example
    >>> from flowrl.planners import plan_graph
    >>> plan = plan_graph(build_example("llamarl"), "1024xH100", model=model_preset("llama3-8b"))
    >>> plan.family
    'disaggregated'
"""

from flowrl.planners.cluster import ClusterSpec, DeviceSpec, parse_cluster
from flowrl.modelspec import ModelSpec, model_from_config, model_from_hf_config, model_preset, resolve_model
from flowrl.planners.parallel import AXES, ParallelDims
from flowrl.planners.plan import NodePlacement, Plan, load_plan, parse_plan, plan_graph, plan_to_json, save_plan
from flowrl.planners.tuning import Tuning
from flowrl.planners.workload import LLM_DEFAULTS, Workload

__all__ = [
    "ClusterSpec",
    "DeviceSpec",
    "parse_cluster",
    "ModelSpec",
    "model_preset",
    "model_from_config",
    "model_from_hf_config",
    "resolve_model",
    "AXES",
    "ParallelDims",
    "Plan",
    "NodePlacement",
    "plan_graph",
    "parse_plan",
    "save_plan",
    "load_plan",
    "plan_to_json",
    "Tuning",
    "Workload",
    "LLM_DEFAULTS",
]
