"""What differs between two graphs: the paths of their JSON forms that differ, with both values.

A checkpoint stores the graph that wrote it (``graph.json``) and its fingerprint; a resume into a
changed graph is refused, and ``graph_diff`` says what changed. Paths name nodes and edges by
name, not by position (``nodes['gen'].sampling.temperature: 1.0 -> 0.7``), so a node added in the
middle shows as one addition.

Example:
    >>> graph_diff({"nodes": [{"name": "gen", "sampling": {"temperature": 1.0}}]},
    ...            {"nodes": [{"name": "gen", "sampling": {"temperature": 0.7}}]})
    ["nodes['gen'].sampling.temperature: 1.0 -> 0.7"]
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["graph_diff"]

_ABSENT = object()


def _key(item: Any, index: int) -> str:
    """How a list item is named in a path: by its node name, by its edge ends, else by position."""
    if isinstance(item, dict):
        if "name" in item:
            return repr(item["name"])
        if "src" in item and "dst" in item:
            return repr(f"{item['src']}->{item['dst']}")
    return str(index)


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "(absent)"
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def _walk(old: Any, new: Any, path: str, out: list[str]) -> None:
    if isinstance(old, dict) and isinstance(new, dict):
        for k in list(dict.fromkeys([*old, *new])):
            _walk(old.get(k, _ABSENT), new.get(k, _ABSENT), f"{path}.{k}" if path else str(k), out)
    elif isinstance(old, list) and isinstance(new, list):
        a = {_key(x, i): x for i, x in enumerate(old)}
        b = {_key(x, i): x for i, x in enumerate(new)}
        for k in list(dict.fromkeys([*a, *b])):
            _walk(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{path}[{k}]", out)
    elif old != new or type(old) is not type(new) and not (isinstance(old, (int, float)) and isinstance(new, (int, float))):
        out.append(f"{path}: {_show(old)} -> {_show(new)}")


def graph_diff(old: Any, new: Any) -> list[str]:
    """Each differing path of two graphs' JSON objects (parsed), ``"path: old -> new"``, in document order."""
    out: list[str] = []
    _walk(old, new, "", out)
    return out
