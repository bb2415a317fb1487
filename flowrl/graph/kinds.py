"""The node kinds in one table: per kind, the pure facts of it (its node struct, where it runs, its
side of a split, how it treats weights, its trace span and picture style).

Every part of flowrl that treats kinds differently reads these facts: the controller names its trace
spans and the planner its predicted spans with ``span`` (so a measured and a predicted timeline line
up), placement and the planner's search read ``runs_on`` and ``side``, the exporters draw with
``style``. What each layer does with a kind lives in that layer, in a table keyed by kind name:
the runtime's programs (``flowrl.runtime.programs.table.PROGRAMS``, on several ranks
``flowrl.runtime.backends.torchrun.rank_programs.RANK_PROGRAMS``) and the planner's estimators and roles
(``flowrl.planners.kind_table``). ``tests/graph/test_kinds.py`` checks every table has every kind.

The node struct is a ``module:qualname`` string (resolved once, when ``flowrl.graph.nodes`` builds
the ``Node`` union, so a kind's module may import ``NodeBase`` from there); it names a module of
graph/ or a user's. To add a kind: one module with its node struct (a ``flowrl.graph.nodes.NodeBase``
subclass with its ``signature()`` and ``describe()``), its program and estimator (a device kind: its
planner role), one entry here and one in each layer's table
(``tests/graph/test_kinds.py::test_a_kind_is_one_module_and_one_entry`` does exactly that for a CPU
kind, ``test_a_device_kind_is_one_module_and_one_entry`` for a device kind).

Example:
    >>> KINDS["generator"].span, KINDS["loss"].runs_on
    ('generate', 'policy')
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
    """The pure facts of one node kind (what each layer does with it is in that layer's table: module docstring).

    Attributes:
        node: ``module:qualname`` of its node struct (which holds its config), in graph/ or a user's module.
        runs_on: ``"devices"`` (placed on a mesh of its own, with a program and a planner role), ``"cpu"``
            (the CPU of its machine, beside them, with a program) or ``"policy"`` (inside its policy's
            step, on its mesh: no program of its own).
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
        trains: it takes optimizer steps on each batch without publishing weights (a critic): the
            planner prices its forward and training like a policy's (``publishes_weights`` implies it).
    """

    node: str
    runs_on: Literal["devices", "cpu", "policy"]
    span: str
    style: KindStyle
    side: Literal["generator", "trainer", "cpu"] = "cpu"
    waits_for_weights: bool = False
    publishes_weights: bool = False
    holds_weights: bool = False
    trains: bool = False


#: Every node kind, in ``NODE_KINDS`` order. Data comes from cylinders, models are boxes, rules
#: hexagons (the loss is an octagon in DOT, where a parallelogram grows too wide for its label).
KINDS: dict[str, KindSpec] = {
    "source": KindSpec(
        node="flowrl.graph.nodes:SourceNode", runs_on="cpu", span="prompts",
        style=KindStyle(dot_shape="cylinder", dot_style="filled", mermaid_open="[(", mermaid_close=")]", fill="#fff2cc", stroke="#d6b656"),
    ),
    "generator": KindSpec(
        node="flowrl.graph.nodes:GeneratorNode", runs_on="devices", span="generate", side="generator", waits_for_weights=True, holds_weights=True,
        style=KindStyle(dot_shape="box", dot_style="rounded,filled", mermaid_open="(", mermaid_close=")", fill="#dae8fc", stroke="#6c8ebf"),
    ),
    "scorer": KindSpec(
        node="flowrl.graph.nodes:ScorerNode", runs_on="cpu", span="score",
        style=KindStyle(dot_shape="hexagon", dot_style="filled", mermaid_open="{{", mermaid_close="}}", fill="#d5e8d4", stroke="#82b366"),
    ),
    "reference": KindSpec(
        node="flowrl.graph.nodes:ReferenceNode", runs_on="devices", span="reference", side="trainer", holds_weights=True,
        style=KindStyle(dot_shape="box", dot_style="dashed,filled", mermaid_open="[[", mermaid_close="]]", fill="#f5f5f5", stroke="#666666"),
    ),
    "reward_model": KindSpec(
        node="flowrl.graph.nodes:RewardModelNode", runs_on="devices", span="reward model", side="trainer",
        style=KindStyle(dot_shape="box", dot_style="rounded,dashed,filled", mermaid_open="([", mermaid_close="])", fill="#d5e8d4", stroke="#82b366"),
    ),
    "critic": KindSpec(
        node="flowrl.graph.critic:CriticNode", runs_on="devices", span="critic", side="trainer", trains=True,
        style=KindStyle(dot_shape="box3d", dot_style="dashed,filled", mermaid_open="[", mermaid_close="]", fill="#ffe6cc", stroke="#d79b00"),
    ),
    "teacher": KindSpec(
        node="flowrl.graph.teacher:TeacherNode", runs_on="devices", span="teacher", side="trainer",
        style=KindStyle(dot_shape="box", dot_style="dashed,filled", mermaid_open="[[", mermaid_close="]]", fill="#e6f0ff", stroke="#4a6fa5"),
    ),
    "loss": KindSpec(
        node="flowrl.graph.nodes:LossNode", runs_on="policy", span="loss", side="trainer",
        style=KindStyle(dot_shape="octagon", dot_style="filled", mermaid_open="[/", mermaid_close="/]", fill="#f8cecc", stroke="#b85450"),
    ),
    "policy": KindSpec(
        node="flowrl.graph.nodes:PolicyNode", runs_on="devices", span="train", side="trainer", publishes_weights=True, holds_weights=True,
        style=KindStyle(dot_shape="box3d", dot_style="filled", mermaid_open="[", mermaid_close="]", fill="#e1d5e7", stroke="#9673a6"),
    ),
}
