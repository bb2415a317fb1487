"""References to user code as ``module:qualname`` strings, resolved only when a graph runs.

A graph file never holds code: a scorer names its function. Loading a graph checks the reference's
syntax and nothing else; ``references(graph)`` lists them so that a user can read what a graph would
import before running it; ``resolve`` imports the module and walks the qualname.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

from flowrl.errors import GraphError

__all__ = ["reference_of", "check_reference", "resolve", "REF_RE"]

REF_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def check_reference(ref: str) -> str | None:
    """None if ``ref`` is a well-formed ``module:qualname``, else what is wrong with it."""
    if not REF_RE.match(ref):
        return f"reference {ref!r} is not of the form 'package.module:function' (a module-level function, named, not a lambda)"
    return None


def reference_of(fn: Callable[..., Any] | str) -> str:
    """The ``module:qualname`` of a module-level function (strings pass through, checked).

    Raises:
        GraphError: for a lambda, a nested function or anything without a importable name.
    """
    if isinstance(fn, str):
        ref = fn
    else:
        module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
        if not module or not qualname or "<" in qualname:
            raise GraphError(
                f"cannot reference {fn!r}: graphs store functions by name, so define it at module level "
                "(not a lambda or a nested function) and pass the function or its 'module:qualname'"
            )
        ref = f"{module}:{qualname}"
    message = check_reference(ref)
    if message:
        raise GraphError(message)
    return ref


def resolve(ref: str) -> Callable[..., Any]:
    """Import ``module`` and return ``qualname`` from it.

    Raises:
        GraphError: naming the reference when the module or the attribute cannot be found.
    """
    message = check_reference(ref)
    if message:
        raise GraphError(message)
    module_name, qualname = ref.split(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise GraphError(f"cannot import module {module_name!r} of reference {ref!r}: {exc}; is it on PYTHONPATH?") from exc
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise GraphError(f"module {module_name!r} has no attribute {qualname!r} (reference {ref!r})") from None
    if not callable(obj):
        raise GraphError(f"reference {ref!r} names {type(obj).__name__} object, not a function")
    return obj
