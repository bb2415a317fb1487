"""``flowrl viz [GRAPH]``: draw a pipeline as Mermaid, DOT, JSON, SVG, PNG or PDF, optionally labelled with a plan."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowrl.graph.ir import Graph

__all__ = ["register", "plan_annotations", "plan_labels", "DEFAULT_FORMAT"]

#: Mermaid by default: it is text a terminal shows, it renders on GitHub and in most Markdown
#: viewers, and it needs nothing installed (svg/png need Graphviz).
DEFAULT_FORMAT = "mermaid"

EPILOG = """\
formats:
  mermaid  text; paste into a ```mermaid block on GitHub (the default)
  dot      Graphviz text; 'dot -Tsvg' draws it
  json     the graph file itself; 'flowrl viz FILE.json' and 'flowrl run FILE.json' read it back
  svg/png/pdf  drawn by Graphviz's 'dot', a program pip does not install: apt-get install graphviz
               (Debian/Ubuntu) / brew install graphviz (macOS) / conda install graphviz

Text formats go to stdout unless -o is given; svg, png and pdf go to -o FILE, or to GRAPHNAME.svg/.png/.pdf.
With -o and no --format, the file's suffix picks the format (.mmd .dot .gv .json .svg .png .pdf);
another suffix is an error (a file without a suffix gets mermaid).
'-o -' writes any format to stdout.

examples:
  flowrl viz                                   the default pipeline, as Mermaid
  flowrl viz llamarl_ref --format dot          a built-in example as DOT
  flowrl viz my_graph.py -o pipeline.svg       a graph script, drawn by Graphviz
  flowrl viz llamarl --format json -o g.json   save the graph; edit it; 'flowrl viz g.json' reads it
  flowrl viz llamarl --plan plan.json -o p.svg each node labelled with its devices and parallel dims
"""


def register(sub: argparse._SubParsersAction) -> None:
    from flowrl.pictures import DIRECTIONS, FORMATS
    from flowrl.cli.graphs import GRAPH_FORMS

    p = sub.add_parser(
        "viz",
        help="draw a pipeline (mermaid, dot, json, svg, png, pdf)",
        description="Draw GRAPH (default: the built-in 'llamarl' example). " + GRAPH_FORMS,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("graph", nargs="?", metavar="GRAPH", help="what to draw (default: the built-in example 'llamarl')")
    p.add_argument(
        "--format", "-f", choices=FORMATS, default=None,
        help=f"output format (default: from -o's suffix, else {DEFAULT_FORMAT})",
    )
    p.add_argument("-o", "--output", metavar="FILE", help="write here (atomically) instead of stdout; '-' is stdout")
    p.add_argument("--plan", metavar="FILE", help="a plan from 'flowrl plan GRAPH -o FILE': label each node with its devices and parallel dims")
    p.add_argument("--direction", choices=DIRECTIONS, default="LR", help="LR: data flows left to right (default); TB: top to bottom")
    p.set_defaults(func=_run)


def plan_annotations(path: str, graph: Graph, *, graph_arg: str | None = None) -> dict[str, str]:
    """``{node: plan.node_label(node)}`` for the plan file at ``path``."""
    plan = _load_plan(path, graph, graph_arg=graph_arg)
    return {name: plan.node_label(name) for name in plan.placements}


def plan_labels(path: str, graph: Graph, *, graph_arg: str | None = None) -> dict[str, Any]:
    """The exporters' labelling keywords for the plan file at ``path``: ``annotations`` (devices
    and dims per node), ``models`` (the model each node was planned with) and ``title`` (graph,
    cluster, models, step, and the model and workload the plan's times are for, with the graph's
    own where they differ: ``flowrl.planners.plan_match.planned_for``).

    Raises:
        as ``_load_plan`` (``graph_arg``: the graph as the user named it, for the command it suggests).
    """
    plan = _load_plan(path, graph, graph_arg=graph_arg)
    title = plan.picture_title()
    if hasattr(plan, "workload"):  # a planner's Plan: which model and step its times are for, beside the graph's own
        from flowrl.planners.plan_match import planned_for

        title = f"{title}; {planned_for(plan, graph)}"
    return {
        "annotations": {name: plan.node_label(name) for name in plan.placements},
        "models": {name: m for name in plan.placements if (m := plan.node_model(name))},
        "title": title,
    }


def _load_plan(path: str, graph: Graph, *, graph_arg: str | None = None) -> Any:
    """The plan file at ``path``.

    Raises:
        ConfigError: when the file is missing or the planner is not installed;
        PlanError: from ``load_plan`` for a bad plan file.
    """
    from flowrl.errors import ConfigError

    if not os.path.isfile(path):
        from flowrl.replan import plan_command

        raise ConfigError(f"--plan {path}: no such file; make one with: {plan_command(graph_arg, '--cluster cpu', '-o', shlex.quote(path))}")
    try:
        from flowrl.planners.plan import load_plan
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if missing not in (None, "flowrl.planners", "flowrl.planners.plan") and "load_plan" not in str(exc):
            raise  # the planner exists but is broken: a bug, keep its traceback
        raise ConfigError(
            "--plan needs the planner (flowrl.planners.plan.load_plan), which this flowrl does not have yet; "
            "drop --plan to draw the graph without placements"
        ) from None
    return load_plan(path)


def _default_name(graph: Graph, fmt: str) -> str:
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", graph.name).lstrip(".") or "graph"
    return f"{stem}.{fmt}"


def _run(args: argparse.Namespace) -> int:
    from flowrl.errors import ConfigError
    from flowrl.pictures import FORMATS, IMAGE_FORMATS, SUFFIXES, export_text, format_for_path, render_bytes, write_atomic
    from flowrl.cli.graphs import load_graph

    out = args.output
    fmt = args.format
    if out and out != "-":
        implied = format_for_path(out)
        suffix = os.path.splitext(out)[1]
        if fmt is None and implied is None and suffix:
            raise ConfigError(
                f"-o {out}: the suffix {suffix!r} names no format flowrl writes; use one of "
                f"{' '.join(sorted(SUFFIXES))}, or say --format {{{','.join(FORMATS)}}}"
            )
        if fmt is None:
            fmt = implied or DEFAULT_FORMAT
        elif implied is not None and implied != fmt:
            raise ConfigError(
                f"-o {out} has the suffix of format {implied} but --format is {fmt}; change the suffix, "
                f"or drop --format to write {implied}"
            )
        folder = os.path.dirname(os.path.abspath(out))
        if not os.path.isdir(folder):
            raise ConfigError(f"-o {out}: folder {folder} does not exist; create it first")
    fmt = fmt or DEFAULT_FORMAT
    if fmt == "json" and args.plan:
        raise ConfigError(
            "--plan labels pictures, but --format json writes the graph itself, which holds no placement; "
            "pick --format mermaid, dot, svg or png, or drop --plan"
        )

    graph = load_graph(args.graph)
    from flowrl.examples import DEFAULT_EXAMPLE

    labels = plan_labels(args.plan, graph, graph_arg=args.graph or DEFAULT_EXAMPLE) if args.plan else {}

    if fmt in IMAGE_FORMATS:
        data: bytes = render_bytes(graph, fmt, direction=args.direction, **labels)
        if out is None:
            out = _default_name(graph, fmt)
    else:
        data = export_text(graph, fmt, direction=args.direction, **labels).encode()

    if out is None or out == "-":
        sys.stdout.flush()
        if hasattr(sys.stdout, "buffer"):
            sys.stdout.buffer.write(data)
        else:  # a text-only stream (some embedding): text formats only make sense there anyway
            sys.stdout.write(data.decode(errors="replace"))
        sys.stdout.flush()
        return 0
    write_atomic(out, data)
    print(f"flowrl viz: wrote {out} ({fmt}, {len(data)} bytes)", file=sys.stderr)
    return 0
