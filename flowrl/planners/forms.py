"""Reading ``--plan``: a plan file or a JSON placement, into the ``Placement`` the runtime executes.

``--plan FILE`` takes either form, and :func:`read_placement` turns both into a
``flowrl.placement.Placement`` (the one reader of ``--plan`` for every backend; the CLI calls it
and hands the result to ``run_graph``):

- a plan file from ``flowrl plan -o`` (``load_plan``: the whole struct, with its predictions),
  read here because only the planner knows a ``Plan``; its ``Plan.placement()`` is what runs;
- a *placement*: JSON naming each device node's devices, ``{"gen": [0], "policy": [1, 2]}``
  (``flowrl.placement.forms``, where its form is described).

Either way every device node of the graph (``DEVICE_KINDS``) must be placed, and only those.

Example:
    >>> import json, tempfile
    >>> from flowrl.examples import build_example
    >>> with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
    ...     _ = f.write(json.dumps({"gen": [0], "policy": [1, 2]})); f.flush()
    ...     str(read_placement(f.name, build_example("llamarl")))
    'gen:d1@0 | policy:d2@1-2'
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from flowrl.errors import PlanError
from flowrl.fileio import read_bounded
from flowrl.graph.ir import Graph
from flowrl.graph.nodes import DEVICE_KINDS
from flowrl.placement.layout import Placement
from flowrl.placement.forms import EXAMPLE, decode_placement
from flowrl.planners.plan_data import MAX_PLAN_BYTES, load_plan
from flowrl.replan import plan_command

__all__ = ["read_placement"]


def read_placement(path: str | os.PathLike[str], graph: Graph, *, graph_arg: str | None = None) -> Placement:
    """The placement a ``--plan`` file gives for ``graph``: a plan file's or a JSON placement (module
    docstring); ``graph_arg``: the graph as the user named it, which a suggested ``flowrl plan`` names.

    Raises:
        PlanError: naming the file: missing, unreadable, neither form, made for another graph, or
            not placing exactly the graph's device nodes.
    """
    where = f"--plan {path}"
    p = Path(path)
    data = read_bounded(
        p, limit=MAX_PLAN_BYTES, what="plan file", error=PlanError,
        missing_hint=f"write one with `{plan_command(graph_arg, '--cluster cpu', '-o', shlex.quote(str(p)))}` or a placement like {EXAMPLE}",
    )
    try:
        raw = json.loads(data)
    except ValueError as exc:  # UnicodeDecodeError included
        raise PlanError(f"plan file {str(p)!r} is not valid JSON: {exc}") from None
    if not (isinstance(raw, dict) and "placements" in raw):
        return decode_placement(data, graph, where=where)
    plan = load_plan(p)
    if plan.graph != graph.name:
        raise PlanError(f"plan {str(path)!r} was made for graph {plan.graph!r}, not {graph.name!r}; re-plan with `{plan_command(graph_arg, '--cluster cpu', '-o', shlex.quote(str(path)))}` (or the cluster it runs on)")
    for node in graph.nodes:
        if node.kind in DEVICE_KINDS and not (node.name in plan.placements and plan.placements[node.name].devices):
            raise PlanError(f"plan {str(path)!r} places no devices for node {node.name!r}; re-plan this graph")
    return plan.placement(source=f"plan:{path}")
