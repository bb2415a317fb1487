"""Graph exporters: free functions to DOT (Graphviz), Mermaid and JSON, and SVG/PNG through Graphviz's ``dot``.

The graph knows nothing of its pictures (dask's ``to_graphviz`` style): each exporter reads a
``Graph`` and returns text. DOT and Mermaid draw the same picture:

- one node per graph node, its shape and colour by kind (``KIND_STYLES``), labelled
  ``name (kind)`` over a one-line summary of its config (``flowrl.graph.nodes.describe``) and, when
  ``annotations`` names the node, one more line: the planner's ``Plan.node_label(name)``, e.g.
  ``devices 0-3 · dp2 tp2``; a picture of a plan also names the model each node was planned
  with (``models``, e.g. ``llama3-70b`` under ``flowrl plan --model``) and is titled with the
  cluster and model (``title``: ``Plan.picture_title()``);
- one solid edge per data edge, labelled with its fields, abbreviated by ``field_summary``;
- one dashed edge per weight edge, labelled with its transport and ``k<=max_staleness``.

Output is deterministic: the same graph gives byte-identical text, so pictures can be golden files.
``render`` pipes the DOT text through ``dot`` and writes the image atomically (temp file + rename);
``write_atomic`` does the same for any bytes.

Example:
    >>> from flowrl.examples import build_example
    >>> text = to_mermaid(build_example("llamarl"), annotations={"gen": "devices 0-1 · dp2"})
    >>> [line.strip() for line in text.splitlines() if line.strip().startswith("gen(")]
    ['gen("gen (generator)<br/>model=2L64d, n=16, max_new=5, T=1<br/>devices 0-1 · dp2")']
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path


from flowrl import fileio
from flowrl.errors import FlowrlError
from flowrl.graph.fields import ROLLOUT_FIELDS, SOURCE_FIELDS
from flowrl.graph.ir import Graph
from flowrl.graph.kinds import KINDS, KindStyle
from flowrl.graph.nodes import NODE_KINDS, Node, describe, signature
from flowrl.graph.serialize import to_json

__all__ = [
    "ExportError",
    "KindStyle",
    "KIND_STYLES",
    "WEIGHT_COLOR",
    "FORMATS",
    "TEXT_FORMATS",
    "IMAGE_FORMATS",
    "DIRECTIONS",
    "GRAPHVIZ_INSTALL",
    "field_summary",
    "node_label_lines",
    "to_dot",
    "to_mermaid",
    "to_json",
    "export_text",
    "render_bytes",
    "render",
    "write_atomic",
    "format_for_path",
    "SUFFIXES",
]


class ExportError(FlowrlError):
    """A graph cannot be exported: bad annotations, an unknown format, ``dot`` missing or failing, an unwritable path."""


#: Shape and colour of each node kind, from the kinds table (``flowrl.graph.kinds``).
KIND_STYLES: dict[str, KindStyle] = {kind: spec.style for kind, spec in KINDS.items()}
_FALLBACK_STYLE = KindStyle(dot_shape="box", dot_style="filled", mermaid_open="[", mermaid_close="]", fill="#ffffff", stroke="#000000")

#: Colour of weight edges (the policy's colour: weights leave the policy).
WEIGHT_COLOR = "#9673a6"

TEXT_FORMATS: tuple[str, ...] = ("mermaid", "dot", "json")
IMAGE_FORMATS: tuple[str, ...] = ("svg", "png", "pdf")
FORMATS: tuple[str, ...] = TEXT_FORMATS + IMAGE_FORMATS
DIRECTIONS: tuple[str, ...] = ("LR", "TB")

#: File suffixes that name a format (``format_for_path``).
SUFFIXES: dict[str, str] = {".mmd": "mermaid", ".mermaid": "mermaid", ".dot": "dot", ".gv": "dot", ".json": "json", ".svg": "svg", ".png": "png", ".pdf": "pdf"}

GRAPHVIZ_INSTALL = (
    "install Graphviz: 'apt-get install graphviz' (Debian/Ubuntu), 'brew install graphviz' (macOS) "
    "or 'conda install graphviz'"
)

#: Standard field bundles that name a long field list on an edge label.
_BUNDLES: dict[str, frozenset[str]] = {"rollout": frozenset(ROLLOUT_FIELDS), "prompts": frozenset(SOURCE_FIELDS)}

_FONT = "Helvetica,Arial,sans-serif"


# -- labels -----------------------------------------------------------------------------------------
def field_summary(fields: Iterable[str], *, max_items: int = 3) -> str:
    """A short, deterministic label for a list of field names.

    Fields sharing a prefix are brace-compressed (``completion_ids, completion_lens`` ->
    ``completion_{ids,lens}``); if more than ``max_items`` items remain, a standard bundle is named
    (``rollout (9 fields)``), else the first items are kept and the rest counted (``+4 more``).

    Example:
        >>> field_summary(["completion_ids", "completion_lens", "sample_prompt_ids"])
        'completion_{ids,lens}, sample_prompt_ids'
    """
    names = sorted(set(fields))
    if not names:
        return "(no fields)"
    groups: dict[tuple[str, bool], list[str]] = {}
    for name in names:
        head, sep, _ = name.rpartition("_")
        key = (head, True) if sep and head else (name, False)
        groups.setdefault(key, []).append(name)
    items: list[tuple[str, int]] = []  # (text, number of fields it stands for)
    for (head, grouped), members in sorted(groups.items()):
        if grouped and len(members) > 1:
            tails = ",".join(m[len(head) + 1 :] for m in members)
            items.append((f"{head}_{{{tails}}}", len(members)))
        else:
            items.extend((m, 1) for m in members)
    if len(items) <= max_items:
        return ", ".join(text for text, _ in items)
    for bundle, bundled in _BUNDLES.items():
        if set(names) == bundled:
            return f"{bundle} ({len(names)} fields)"
    keep = items[: max(max_items - 1, 1)]
    rest = len(names) - sum(n for _, n in keep)
    return ", ".join(text for text, _ in keep) + f", +{rest} more"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _check_annotations(graph: Graph, annotations: Mapping[str, str] | None, what: str = "annotations") -> dict[str, str]:
    if not annotations:
        return {}
    unknown = sorted(str(n) for n in annotations if n not in graph)
    if unknown:
        raise ExportError(
            f"{what} name node(s) {unknown} that graph {graph.name!r} does not have (its nodes: "
            f"{sorted(n.name for n in graph.nodes)}); was the plan made for another graph? Plan this graph again"
        )
    bad = sorted(n for n, v in annotations.items() if not isinstance(v, str))
    if bad:
        raise ExportError(f"{what} of node(s) {bad} are not strings; pass one short line of text per node")
    return {n: _one_line(v) for n, v in annotations.items()}


def node_label_lines(node: Node, annotation: str | None = None, model: str | None = None) -> list[str]:
    """The lines of a node's label: ``name (kind)``, its config summary, and the annotation if any.

    ``model`` (a plan's model for the node, e.g. ``llama3-70b`` under ``flowrl plan --model``)
    replaces the graph's own ``model=...`` in the summary, so a picture shows what was planned.
    """
    summary = describe(node)
    own = getattr(node, "model", None)
    if model and own is not None and summary.startswith(f"model={own.short()}"):
        summary = f"model={_one_line(model)}" + summary[len(f"model={own.short()}") :]
    lines = [f"{node.name} ({node.kind})", summary]
    if annotation:
        lines.append(annotation)
    return lines


def _weight_label(transport: str, max_staleness: int) -> list[str]:
    return [transport, f"k<={max_staleness}"]


def _check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ExportError(f"direction {direction!r} is not one of {list(DIRECTIONS)} (LR: left to right, TB: top to bottom)")


def _typed_fields(fields: Mapping[str, object]) -> str:
    return "\n".join(f"{name}: {ftype}" for name, ftype in sorted(fields.items()))


# -- DOT --------------------------------------------------------------------------------------------
def _dot_str(text: str) -> str:
    """A DOT double-quoted string; backslashes and quotes escaped, so no user text acts as an escape."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "") + '"'


def _dot_lines(lines: list[str]) -> str:
    return _dot_str("\n".join(_one_line(line) for line in lines))


def _dot_attrs(attrs: dict[str, str]) -> str:
    return "[" + ", ".join(f"{k}={v}" for k, v in attrs.items()) + "]"


def to_dot(
    graph: Graph,
    *,
    annotations: Mapping[str, str] | None = None,
    direction: str = "LR",
    title: str | None = None,
    models: Mapping[str, str] | None = None,
) -> str:
    """The graph as Graphviz DOT text (ends with a newline).

    Args:
        graph: the graph to draw.
        annotations: node name -> one more label line (e.g. ``Plan.node_label(name)``); every key
            must be a node of ``graph``.
        direction: ``"LR"`` (data flows left to right) or ``"TB"`` (top to bottom).
        title: the picture's title (default: the graph's name), e.g. ``Plan.picture_title()``.
        models: node name -> the model to name in its label instead of the graph's own
            (``Plan.node_model(name)``: the model a plan was made for).

    Raises:
        ExportError: for annotations or models naming unknown nodes, or an unknown direction.
    """
    notes = _check_annotations(graph, annotations)
    shown = _check_annotations(graph, models, "models")
    _check_direction(direction)
    out = [
        f"digraph {_dot_str(graph.name)} {{",
        f"  graph [rankdir={direction}, label={_dot_str(_one_line(title or graph.name))}, labelloc=t, fontname={_dot_str(_FONT)}, fontsize=14];",
        f"  node [fontname={_dot_str(_FONT)}, fontsize=11, penwidth=1.2];",
        f"  edge [fontname={_dot_str(_FONT)}, fontsize=9];",
    ]
    for node in graph.topological_order():
        style = KIND_STYLES.get(node.kind, _FALLBACK_STYLE)
        sig = signature(node)
        tooltip = f"{node.kind} {node.name}\nreads:\n{_typed_fields(sig.inputs) or '-'}\nwrites:\n{_typed_fields(sig.outputs) or '-'}"
        attrs = {
            "label": _dot_lines(node_label_lines(node, notes.get(node.name), shown.get(node.name))),
            "shape": style.dot_shape,
            "style": _dot_str(style.dot_style),
            "fillcolor": _dot_str(style.fill),
            "color": _dot_str(style.stroke),
            "tooltip": _dot_str(tooltip),
        }
        out.append(f"  {_dot_str(node.name)} {_dot_attrs(attrs)};")
    for e in graph.edges:
        attrs = {
            "label": _dot_str(field_summary(e.fields)),
            "tooltip": _dot_str(f"{e.src} -> {e.dst}\n{_typed_fields(e.fields)}"),
        }
        out.append(f"  {_dot_str(e.src)} -> {_dot_str(e.dst)} {_dot_attrs(attrs)};")
    for w in graph.weight_edges:
        attrs = {
            "label": _dot_lines(_weight_label(w.transport, w.max_staleness)),
            "style": "dashed",
            "color": _dot_str(WEIGHT_COLOR),
            "fontcolor": _dot_str(WEIGHT_COLOR),
            "penwidth": "1.5",
            "constraint": "false",
            "tooltip": _dot_str(f"weights {w.src} ~> {w.dst} over {w.transport}, max_staleness {w.max_staleness}"),
        }
        out.append(f"  {_dot_str(w.src)} -> {_dot_str(w.dst)} {_dot_attrs(attrs)};")
    out.append("}")
    return "\n".join(out) + "\n"


# -- Mermaid ----------------------------------------------------------------------------------------
_MERMAID_ID = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Words Mermaid's flowchart grammar reserves; a node called one of these gets a generated id.
_MERMAID_RESERVED = frozenset(
    {"end", "graph", "flowchart", "subgraph", "direction", "style", "class", "classdef", "click", "linkstyle",
     "default", "call", "href", "callback", "interpolate", "_self", "_blank", "_parent", "_top", "accdescr", "acctitle"}
)


def _mermaid_text(text: str) -> str:
    """Text for a quoted Mermaid label: entity codes for the characters Mermaid or HTML would read."""
    text = _one_line(text).replace("#", "#35;")
    for char, code in (('"', "#quot;"), ("<", "#lt;"), (">", "#gt;"), ("&", "#amp;"), ("`", "#96;")):
        text = text.replace(char, code)
    return text


def _mermaid_label(lines: list[str]) -> str:
    return '"' + "<br/>".join(_mermaid_text(line) for line in lines) + '"'


def _mermaid_ids(graph: Graph) -> dict[str, str]:
    """Node name -> Mermaid id: the name itself when Mermaid can read it, else ``n<i>``."""
    names: list[str] = []
    ends = [x for e in graph.edges for x in (e.src, e.dst)] + [x for w in graph.weight_edges for x in (w.src, w.dst)]
    for name in [n.name for n in graph.nodes] + ends:
        if name not in names:
            names.append(name)
    ids = {n: n for n in names if _MERMAID_ID.match(n) and n.lower() not in _MERMAID_RESERVED}
    taken = set(ids.values())
    for i, name in enumerate(names):
        if name not in ids:
            candidate = f"n{i}"
            while candidate in taken:
                candidate += "_"
            ids[name] = candidate
            taken.add(candidate)
    return ids


def to_mermaid(
    graph: Graph,
    *,
    annotations: Mapping[str, str] | None = None,
    direction: str = "LR",
    title: str | None = None,
    models: Mapping[str, str] | None = None,
) -> str:
    """The graph as a Mermaid flowchart (renders on GitHub inside a ```` ```mermaid ```` block; ends with a newline).

    Args and Raises: as ``to_dot``.
    """
    notes = _check_annotations(graph, annotations)
    shown = _check_annotations(graph, models, "models")
    _check_direction(direction)
    ids = _mermaid_ids(graph)
    out = ["---", f"title: {json.dumps(_one_line(title) if title else graph.name)}", "---", f"flowchart {direction}"]
    for node in graph.topological_order():
        style = KIND_STYLES.get(node.kind, _FALLBACK_STYLE)
        label = _mermaid_label(node_label_lines(node, notes.get(node.name), shown.get(node.name)))
        out.append(f"    {ids[node.name]}{style.mermaid_open}{label}{style.mermaid_close}")
    for e in graph.edges:
        out.append(f"    {ids[e.src]} -->|{_mermaid_label([field_summary(e.fields)])}| {ids[e.dst]}")
    for w in graph.weight_edges:
        out.append(f"    {ids[w.src]} -.->|{_mermaid_label(_weight_label(w.transport, w.max_staleness))}| {ids[w.dst]}")
    kinds_present = [k for k in NODE_KINDS if any(n.kind == k for n in graph.nodes)]
    for kind in kinds_present:
        style = KIND_STYLES[kind]
        out.append(f"    classDef {kind} fill:{style.fill},stroke:{style.stroke},color:#000")
    for kind in kinds_present:
        members = sorted({ids[n.name] for n in graph.nodes if n.kind == kind})
        out.append(f"    class {','.join(members)} {kind}")
    if graph.weight_edges:
        first = len(graph.edges)
        indices = ",".join(str(first + i) for i in range(len(graph.weight_edges)))
        out.append(f"    linkStyle {indices} stroke:{WEIGHT_COLOR},stroke-width:2px,color:{WEIGHT_COLOR}")
    return "\n".join(out) + "\n"


# -- dispatch, rendering, files ---------------------------------------------------------------------
def _check_format(fmt: str, allowed: tuple[str, ...]) -> None:
    if fmt not in allowed:
        raise ExportError(f"unknown export format {fmt!r}; formats: {', '.join(allowed)}")


def export_text(
    graph: Graph,
    fmt: str,
    *,
    annotations: Mapping[str, str] | None = None,
    direction: str = "LR",
    title: str | None = None,
    models: Mapping[str, str] | None = None,
) -> str:
    """The graph in text format ``fmt`` (``mermaid``, ``dot`` or ``json``), ending with a newline.

    ``annotations``, ``direction``, ``title`` and ``models`` label pictures, as in ``to_dot``.

    Raises:
        ExportError: for another format, or annotations with ``json`` (a graph file holds no placement).
    """
    _check_format(fmt, TEXT_FORMATS)
    if fmt == "json":
        if annotations or models:
            raise ExportError(
                "annotations (a plan) only label pictures; the json format is the graph itself and holds no "
                "placement. Save the plan with 'flowrl plan ... -o plan.json', or pick --format mermaid/dot/svg/png"
            )
        return to_json(graph) + "\n"
    exporter = to_mermaid if fmt == "mermaid" else to_dot
    return exporter(graph, annotations=annotations, direction=direction, title=title, models=models)


def render_bytes(
    graph: Graph,
    fmt: str,
    *,
    annotations: Mapping[str, str] | None = None,
    direction: str = "LR",
    title: str | None = None,
    models: Mapping[str, str] | None = None,
    dot_program: str = "dot",
    timeout_s: float = 60.0,
) -> bytes:
    """The graph drawn by Graphviz's ``dot`` as ``fmt`` (``svg`` or ``png``); labels as in ``to_dot``.

    Raises:
        ExportError: naming the package to install when ``dot`` is missing, or with dot's own
            message when it fails.
    """
    _check_format(fmt, IMAGE_FORMATS)
    text = to_dot(graph, annotations=annotations, direction=direction, title=title, models=models)
    program = shutil.which(dot_program)
    if program is None:
        raise ExportError(
            f"drawing {fmt} needs the Graphviz program {dot_program!r}, which is not on PATH; {GRAPHVIZ_INSTALL}. "
            "Or export text that needs nothing installed: --format mermaid (renders on GitHub) or --format dot"
        )
    try:
        done = subprocess.run([program, f"-T{fmt}"], input=text.encode(), capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise ExportError(f"Graphviz {dot_program!r} did not finish drawing {graph.name!r} within {timeout_s:g} s") from None
    except OSError as exc:
        raise ExportError(f"cannot run Graphviz {program!r}: {exc.strerror or exc}; {GRAPHVIZ_INSTALL}") from None
    if done.returncode != 0 or not done.stdout:
        message = _one_line(done.stderr.decode(errors="replace"))[:500] or "no output"
        raise ExportError(f"Graphviz {program!r} failed (exit status {done.returncode}) drawing {graph.name!r} as {fmt}: {message}")
    return done.stdout


def render(
    graph: Graph,
    fmt: str,
    path: str | os.PathLike[str],
    *,
    annotations: Mapping[str, str] | None = None,
    direction: str = "LR",
    title: str | None = None,
    models: Mapping[str, str] | None = None,
    dot_program: str = "dot",
) -> Path:
    """Draw the graph with Graphviz into ``path`` (``svg`` or ``png``), atomically; returns the path.

    Nothing is written when drawing fails: the file at ``path``, if any, is left as it was.

    Raises:
        ExportError: as ``render_bytes``, or when ``path`` cannot be written.
    """
    data = render_bytes(graph, fmt, annotations=annotations, direction=direction, title=title, models=models, dot_program=dot_program)
    return write_atomic(path, data)


def write_atomic(path: str | os.PathLike[str], data: bytes | str) -> Path:
    """Write ``data`` to ``path`` atomically (``flowrl.fileio.write_atomic``), failing with ``ExportError``."""
    return fileio.write_atomic(path, data, error=ExportError)


def format_for_path(path: str | os.PathLike[str]) -> str | None:
    """The format a file name's suffix names (``.svg`` -> ``svg``, ``.mmd`` -> ``mermaid``), or None."""
    return SUFFIXES.get(Path(path).suffix.lower())
