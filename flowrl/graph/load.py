"""Find a graph from what a user typed: a built-in example, a ``.json`` file, a ``.py`` file or ``module:attr``.

Only the ``.py`` and ``module:attr`` forms run code, the user's own; a ``.json`` graph file is parsed
as data and never imports anything.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from flowrl.errors import GraphError
from flowrl.graph.ir import Graph
from flowrl.graph.refs import REF_RE
from flowrl.graph.serialize import from_json

__all__ = ["load_graph", "GRAPH_FORMS"]

GRAPH_FORMS = (
    "GRAPH is one of: a built-in example name (see 'flowrl examples'); a .json graph file "
    "(written by 'flowrl viz GRAPH --format json'); a .py file defining `graph` or `build_graph()`; "
    "or a 'package.module:attr' reference to a Graph or a function returning one."
)


def _from_object(obj: object, where: str) -> Graph:
    if callable(obj) and not isinstance(obj, Graph):
        obj = obj()
    if not isinstance(obj, Graph):
        raise GraphError(f"{where} is a {type(obj).__name__}, not a flowrl Graph; return GraphBuilder(...).build()")
    return obj


def _from_py(path: Path) -> Graph:
    module_name = f"_flowrl_user_graph_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise GraphError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent.resolve()))
    for attr in ("graph", "build_graph"):
        if hasattr(module, attr):
            return _from_object(getattr(module, attr), f"{path}:{attr}")
    raise GraphError(f"{path} defines neither `graph` nor `build_graph()`; define one of them")


def load_graph(text: str | None) -> Graph:
    """The graph named by ``text`` (None: the default example).

    Raises:
        GraphError: naming the form it tried and what went wrong.
    """
    from flowrl.examples import DEFAULT_EXAMPLE, EXAMPLES, build_example

    if text is None:
        return build_example(DEFAULT_EXAMPLE)
    if text in EXAMPLES:
        return build_example(text)
    path = Path(text)
    if text.endswith(".json"):
        if not path.is_file():
            raise GraphError(f"graph file {text!r} does not exist")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise GraphError(f"cannot read graph file {text!r}: {exc.strerror}") from None
        return from_json(data)
    if text.endswith(".py"):
        if not path.is_file():
            raise GraphError(f"graph script {text!r} does not exist")
        return _from_py(path)
    if REF_RE.match(text):
        module_name, attr = text.split(":")
        try:
            obj: object = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise GraphError(f"cannot load {text!r}: {exc}") from None
        return _from_object(obj, text)
    raise GraphError(f"cannot find graph {text!r}. {GRAPH_FORMS}")
