"""The planner's table of node kinds: kind name -> how the search costs a node of it.

- ``PLAN_ROLES[kind](node, graph, ctx, model) -> NodeRole`` for every kind that runs on devices of its
  own (``flowrl.planners.roles``): its model's shape, a generator-side node's dtype and engine, a
  trainer's recompute and iterations. ``search.resolve_roles`` calls it for every node of the kind;
  which side of the search costs the node comes from the kind's facts (``flowrl.graph.kinds``:
  ``side``, ``publishes_weights``, ``trains``).
- ``ESTIMATORS[kind](kind, ctx) -> NodeEstimate`` for every other kind (on the CPU beside the devices,
  or inside its policy's step: ``flowrl.planners.estimate.cpu``).

A new kind adds its function to one of them, beside its entry in ``flowrl.graph.kinds.KINDS``;
``tests/graph/test_kinds.py`` checks every kind has one.

Example:
    >>> sorted(PLAN_ROLES) == sorted(k for k, s in KINDS.items() if s.runs_on == "devices")
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flowrl.graph.ir import Graph
from flowrl.graph.kinds import KINDS
from flowrl.modelspec import ModelSpec
from flowrl.planners.estimate.common import Context, NodeEstimate
from flowrl.planners.estimate.cpu import estimate_in_policy, estimate_scorer, estimate_source
from flowrl.planners.roles import NodeRole, critic_role, generator_role, policy_role, reference_role, reward_model_role

__all__ = ["PLAN_ROLES", "ESTIMATORS", "PlanRole", "Estimator"]

PlanRole = Callable[[Any, Graph, Context, "ModelSpec | None"], NodeRole]
Estimator = Callable[[str, Context], NodeEstimate]

#: Device kind -> the planner's facts about one node of it.
PLAN_ROLES: dict[str, PlanRole] = {
    "generator": generator_role,
    "reference": reference_role,
    "reward_model": reward_model_role,
    "critic": critic_role,
    "teacher": reference_role,  # a frozen model's forward pass over each sequence, its own model's shape
    "policy": policy_role,
}

#: Every other kind -> its estimate of one step (a CPU thread's seconds; no device memory).
ESTIMATORS: dict[str, Estimator] = {
    "source": estimate_source,
    "scorer": estimate_scorer,
    "loss": estimate_in_policy,
}
