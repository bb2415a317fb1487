"""Find a graph from what a user typed: a built-in example, a ``.json`` file, a ``.py`` file or ``module:attr``.

Only the ``.py`` and ``module:attr`` forms run code, the user's own; a ``.json`` graph file is parsed
as data and never imports anything.
"""

from __future__ import annotations

import difflib
import importlib
import traceback
from pathlib import Path

from flowrl.errors import FlowrlError, GraphError
from flowrl.graph.ir import Graph
from flowrl.graph.refs import REF_RE, load_file_module
from flowrl.graph.serialize import from_json

__all__ = ["load_graph", "GRAPH_FORMS"]

GRAPH_FORMS = (
    "GRAPH is one of: a built-in example name (see 'flowrl examples'); a .json graph file "
    "(written by 'flowrl viz GRAPH --format json'); a .py file defining `graph` or `build_graph()`; "
    "or a 'package.module:attr' reference to a Graph or a function returning one."
)


def _user_code_error(exc: BaseException, what: str) -> GraphError:
    """A one-paragraph ``GraphError`` for an exception raised by the user's own code, naming where."""
    if isinstance(exc, SyntaxError):
        return GraphError(f"{what}: syntax error at {exc.filename}, line {exc.lineno}: {exc.msg}")
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    return GraphError(f"{what} raised {type(exc).__name__}: {exc}{where}")


def _from_object(obj: object, where: str) -> Graph:
    if callable(obj) and not isinstance(obj, Graph):
        try:
            obj = obj()
        except FlowrlError:
            raise
        except Exception as exc:
            raise _user_code_error(exc, f"calling {where}()") from exc
    if not isinstance(obj, Graph):
        raise GraphError(f"{where} is a {type(obj).__name__}, not a flowrl Graph; return GraphBuilder(...).build()")
    return obj


def _from_py(path: Path) -> Graph:
    """Run the user's script as a module (``refs.load_file_module``) and take its ``graph`` (or ``build_graph()``).

    Functions the script defines are referenced as ``<its absolute path>:<qualname>``, so they resolve
    in every process of a run and survive the JSON round trip.
    """
    try:
        module = load_file_module(path, fresh=True)
    except FlowrlError:
        raise
    except Exception as exc:
        raise _user_code_error(exc, f"graph script {str(path)!r}") from exc
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
        if not path.exists():
            raise GraphError(f"graph file {text!r} does not exist. {GRAPH_FORMS}")
        if not path.is_file():
            raise GraphError(f"graph file {text!r} is not a file")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise GraphError(f"cannot read graph file {text!r}: {exc.strerror}") from None
        try:
            return from_json(data)
        except GraphError as exc:
            raise GraphError(f"{text}: {exc}") from None
    if text.endswith(".py"):
        if not path.exists():
            raise GraphError(f"graph script {text!r} does not exist. {GRAPH_FORMS}")
        if not path.is_file():
            raise GraphError(f"graph script {text!r} is not a file")
        return _from_py(path)
    if REF_RE.match(text):
        module_name, attr = text.split(":")
        try:
            obj: object = importlib.import_module(module_name)
        except ImportError as exc:
            raise GraphError(f"cannot load {text!r}: {exc}; is the module on PYTHONPATH?") from None
        except FlowrlError:
            raise
        except Exception as exc:
            raise _user_code_error(exc, f"importing module {module_name!r}") from exc
        for part in attr.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise GraphError(f"cannot load {text!r}: module {module_name!r} has no attribute {attr!r}") from None
        return _from_object(obj, text)
    close = difflib.get_close_matches(text, list(EXAMPLES), n=1)
    hint = f" Did you mean the example {close[0]!r}?" if close else ""
    raise GraphError(f"cannot find graph {text!r}.{hint} {GRAPH_FORMS}")
