"""The node kinds in one table: per kind, its node struct (config), program, planner estimator and roles, trace span and picture style.

Every part of flowrl that treats kinds differently reads this table: the runtime builds a node's
program with ``program`` (``flowrl.runtime.programs``), the controller names its trace spans and the
planner names its predicted spans with ``span`` (so a measured and a predicted timeline line up),
the planner costs a node with ``estimator`` (and learns a device node's model and options from
``plan_role``), and the exporters draw it with ``style``.
``tests/graph/test_kinds.py`` walks the table, so a kind missing from any part fails loudly.

References are ``module:qualname`` strings, so this module imports neither torch nor the planner.
To add a kind: one module with its node struct (a ``flowrl.graph.nodes.NodeBase`` subclass with its
``signature()`` and ``describe()``), program and estimator (a device kind: its ``plan_role``), and
one entry here: ``NODE_KINDS`` and the ``Node`` union graph files decode into are built from this
table (``tests/graph/test_kinds.py::test_a_kind_is_one_module_and_one_entry`` does exactly that for
a CPU kind, ``test_a_device_kind_is_one_module_and_one_entry`` for a device kind).

Example:
    >>> KINDS["generator"].span, KINDS["loss"].program
    ('generate', '')
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["KindSpec", "KindStyle", "KINDS"]


class KindStyle(msgspec.Struct, frozen=True, kw_only=True):
    """How one node kind is drawn.

    Attributes:
        dot_shape: Graphviz node shape.
        dot_style: Graphviz node style (always includes ``filled``).
        mermaid_open: the opening bracket of Mermaid's node shape, e.g. ``[(`` for a cylinder.
        mermaid_close: the matching closing bracket.
        fill: fill colour.
        stroke: border colour.
    """

    dot_shape: str
    dot_style: str
    mermaid_open: str
    mermaid_close: str
    fill: str
    stroke: str


class KindSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Everything flowrl needs to know about one node kind.

    Attributes:
        node: ``module:qualname`` of its node struct (which holds its config).
        program: ``module:qualname`` of its program builder ``(node, graph, env, transports) -> NodeProgram``;
            ``""`` for a kind that runs inside another node's program (the loss, in its policy's step).
        estimator: ``module:qualname`` of the planner's estimate of one step. For a kind that runs on
            the CPU or inside its policy it is called as ``estimator(kind, ctx) -> NodeEstimate``
            (``flowrl.planners.estimate.cpu.estimate_source``); a device kind's estimate is chosen by its
            side of the search (generation, training or a forward pass) from what its ``plan_role`` says,
            so the search does not call this (it names the estimate that side uses).
        runs_on: ``"devices"`` (placed on a mesh of its own), ``"cpu"`` (the CPU of its machine, beside them) or
            ``"policy"`` (inside its policy's step, on its mesh).
        span: the name of one step's span in the measured trace and the predicted timeline.
        style: how pictures draw it.
        side: which half of a split it goes to: ``"generator"`` (with the generators), ``"trainer"``
            (with the policies: ``halves`` puts it on the second half) or ``"cpu"`` (neither: it runs
            on the CPU beside them).
        waits_for_weights: the controller gates its step ``s`` on the version clock (weights of
            version >= ``updates * (s - k)``), and its step's ``fetch_s`` is traced as a weight fetch.
        publishes_weights: it trains and publishes its weights (a policy): the controller hands its
            steps to the trainer's bookkeeping and traces its ``publish_s`` as a weight publish.
        holds_weights: it holds a model of its policy's architecture, so a weight edge may end at it
            (``graph.nodes.WEIGHT_HOLDING_KINDS``; a reward model's frozen classifier or judge does not).
        rank_program: ``module:qualname`` of its program on a mesh of several ranks (torchrun),
            ``(node, graph, env, transports, *, group, ranks, mesh) -> program``, built on every rank
            of its mesh; ``""``: its own ``program`` runs on the mesh's lead rank and the others idle.
        plan_role: ``module:qualname`` of the planner's facts about one node of a device kind,
            ``(node, graph, ctx, model) -> flowrl.planners.roles.NodeRole`` (its model shape, a
            generator-side node's dtype and engine, a trainer's recompute and iterations ...);
            ``planners.search.resolve_roles`` calls it for every node of the kind, and which side of
            the search costs the node comes from ``side`` and ``publishes_weights``. ``""`` for a
            kind that does not run on devices of its own.
        trains: it takes optimizer steps on each batch without publishing weights (a critic): the
            planner prices its forward and training like a policy's (``publishes_weights`` implies it).
    """

    node: str
    program: str
    estimator: str
    runs_on: Literal["devices", "cpu", "policy"]
    span: str
    style: KindStyle
    side: Literal["generator", "trainer", "cpu"] = "cpu"
    waits_for_weights: bool = False
    publishes_weights: bool = False
    holds_weights: bool = False
    rank_program: str = ""
    plan_role: str = ""
    trains: bool = False


_EST = "flowrl.planners.estimate"
_PROG = "flowrl.runtime.programs"
_RANKS = "flowrl.runtime.backends.rank_programs"
_ROLE = "flowrl.planners.roles"

#: Every node kind, in ``NODE_KINDS`` order. Data comes from cylinders, models are boxes, rules
#: hexagons (the loss is an octagon in DOT, where a parallelogram grows too wide for its label).
KINDS: dict[str, KindSpec] = {
    "source": KindSpec(
        node="flowrl.graph.nodes:SourceNode", program=f"{_PROG}:build_source", estimator=f"{_EST}.cpu:estimate_source",
        runs_on="cpu", span="prompts",
        style=KindStyle(dot_shape="cylinder", dot_style="filled", mermaid_open="[(", mermaid_close=")]", fill="#fff2cc", stroke="#d6b656"),
    ),
    "generator": KindSpec(
        node="flowrl.graph.nodes:GeneratorNode", program=f"{_PROG}:build_generator", estimator=f"{_EST}.generate:estimate_generate",
        runs_on="devices", span="generate", side="generator", waits_for_weights=True, holds_weights=True,
        rank_program=f"{_RANKS}:ParallelGenerator", plan_role=f"{_ROLE}:generator_role",
        style=KindStyle(dot_shape="box", dot_style="rounded,filled", mermaid_open="(", mermaid_close=")", fill="#dae8fc", stroke="#6c8ebf"),
    ),
    "scorer": KindSpec(
        node="flowrl.graph.nodes:ScorerNode", program=f"{_PROG}:build_scorer", estimator=f"{_EST}.cpu:estimate_scorer",
        runs_on="cpu", span="score",
        style=KindStyle(dot_shape="hexagon", dot_style="filled", mermaid_open="{{", mermaid_close="}}", fill="#d5e8d4", stroke="#82b366"),
    ),
    "reference": KindSpec(
        node="flowrl.graph.nodes:ReferenceNode", program=f"{_PROG}:build_reference", estimator=f"{_EST}.train:estimate_train",
        runs_on="devices", span="reference", side="trainer", holds_weights=True,
        plan_role=f"{_ROLE}:reference_role",
        style=KindStyle(dot_shape="box", dot_style="dashed,filled", mermaid_open="[[", mermaid_close="]]", fill="#f5f5f5", stroke="#666666"),
    ),
    "reward_model": KindSpec(
        node="flowrl.graph.nodes:RewardModelNode", program=f"{_PROG}:build_reward_model", estimator=f"{_EST}.train:estimate_train",
        runs_on="devices", span="reward model", side="trainer", plan_role=f"{_ROLE}:reward_model_role",
        style=KindStyle(dot_shape="box", dot_style="rounded,dashed,filled", mermaid_open="([", mermaid_close="])", fill="#d5e8d4", stroke="#82b366"),
    ),
    "critic": KindSpec(
        node="flowrl.graph.critic:CriticNode", program="flowrl.runtime.critic_program:build_critic", estimator=f"{_EST}.train:estimate_train",
        runs_on="devices", span="critic", side="trainer", trains=True, plan_role=f"{_ROLE}:critic_role",
        style=KindStyle(dot_shape="box3d", dot_style="dashed,filled", mermaid_open="[", mermaid_close="]", fill="#ffe6cc", stroke="#d79b00"),
    ),
    "loss": KindSpec(
        node="flowrl.graph.nodes:LossNode", program="", estimator=f"{_EST}.cpu:estimate_in_policy",
        runs_on="policy", span="loss", side="trainer",
        style=KindStyle(dot_shape="octagon", dot_style="filled", mermaid_open="[/", mermaid_close="/]", fill="#f8cecc", stroke="#b85450"),
    ),
    "policy": KindSpec(
        node="flowrl.graph.nodes:PolicyNode", program=f"{_PROG}:build_policy", estimator=f"{_EST}.train:estimate_train",
        runs_on="devices", span="train", side="trainer", publishes_weights=True, holds_weights=True,
        rank_program=f"{_RANKS}:policy_ranks", plan_role=f"{_ROLE}:policy_role",
        style=KindStyle(dot_shape="box3d", dot_style="filled", mermaid_open="[", mermaid_close="]", fill="#e1d5e7", stroke="#9673a6"),
    ),
}
