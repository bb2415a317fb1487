"""Graphs to and from JSON through msgspec: an exact round trip that never imports or runs code.

Decoding is typed (``GraphSpec``): unknown fields, wrong types and unknown node kinds are errors
naming the JSON path, and user functions stay reference strings (``module:qualname``, ``file.py:qualname``) until the graph runs.
"""

from __future__ import annotations

import msgspec

from flowrl.errors import ConfigError, GraphError
from flowrl.fileio import decode_errors
from flowrl.graph.ir import Graph, GraphSpec
from flowrl.graph.nodes import GeneratorNode, LossNode, ScorerNode, SourceNode
from flowrl.graph.refs import is_reference

__all__ = ["to_json", "from_json", "references", "MAX_GRAPH_BYTES"]

#: Graph files larger than this are refused before parsing (a real pipeline is a few kilobytes).
MAX_GRAPH_BYTES = 16 * 1024 * 1024

_encoder = msgspec.json.Encoder(order="deterministic")


def to_json(graph: Graph, *, indent: int = 2) -> str:
    """The graph as JSON text (deterministic key order); ``from_json(to_json(g)) == g``."""
    raw = _encoder.encode(graph.spec)
    return msgspec.json.format(raw, indent=indent).decode() if indent else raw.decode()


def _decode_spec(data: bytes | str) -> GraphSpec:
    if isinstance(data, str):
        data = data.encode("utf-8", errors="surrogateescape")
    if len(data) > MAX_GRAPH_BYTES:
        raise GraphError(f"graph file is {len(data)} bytes, over the {MAX_GRAPH_BYTES}-byte limit; is it really a flowrl graph?")
    try:
        with decode_errors(GraphError, mismatch="graph JSON does not match the flowrl schema", invalid="graph file is not valid JSON"):
            return msgspec.convert(_with_model_family(msgspec.json.decode(data)), GraphSpec)
    except ConfigError as exc:
        raise GraphError(f"graph JSON holds a bad config: {exc}") from None
    except RecursionError:
        raise GraphError("graph JSON is nested too deeply to be a flowrl graph") from None


def _with_model_family(raw: object) -> object:
    """Graphs written before models had a ``family`` tag hold built-in models: say so explicitly."""
    if isinstance(raw, dict) and isinstance(raw.get("nodes"), list):
        for node in raw["nodes"]:
            model = node.get("model") if isinstance(node, dict) else None
            if isinstance(model, dict) and "family" not in model:
                model["family"] = "builtin"
    return raw


def from_json(data: bytes | str, *, validate: bool = True) -> Graph:
    """Parse a graph written by ``to_json``; raises ``GraphError`` naming what is wrong."""
    return Graph(_decode_spec(data), validate=validate)


def references(data: bytes | str | Graph) -> list[str]:
    """Every reference (``module:qualname`` or ``file.py:qualname``) a graph would import when run, read without importing anything."""
    spec = data.spec if isinstance(data, Graph) else _decode_spec(data)
    refs = {n.fn for n in spec.nodes if isinstance(n, ScorerNode)}
    refs |= {n.source.task for n in spec.nodes if isinstance(n, SourceNode) and is_reference(n.source.task)}
    refs |= {n.env.env for n in spec.nodes if isinstance(n, GeneratorNode) and n.env is not None}  # environments
    refs |= {n.loss.row.fn for n in spec.nodes if isinstance(n, LossNode) and n.loss.row is not None}  # a user's objective
    return sorted(refs)
