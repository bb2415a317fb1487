"""The ``flowrl plan`` command a message suggests, naming the graph as the user named it.

A plan records its graph's *name* (``Graph.name``, e.g. ``'hf_copy'``), which is not what a user
passes on the command line for a graph of their own (``mine_grpo.py``, a ``.json`` file, a
``package.module:attr`` reference), and may even be a built-in example's name that would plan
another graph. A message that suggests re-planning therefore takes the ``GRAPH`` argument of the
command that failed (``graph_arg``), quoted for a POSIX shell so that the line pastes as it is;
without one (a library call, no command line) it writes ``GRAPH``, as ``flowrl plan --help`` does.

Example:
    >>> plan_command("runs/mine grpo.py", "--cluster cpu", "-o plan.json")
    "flowrl plan 'runs/mine grpo.py' --cluster cpu -o plan.json"
    >>> plan_command(None, "--cluster cpu")
    'flowrl plan GRAPH --cluster cpu'
"""

from __future__ import annotations

import shlex

__all__ = ["plan_command"]


def plan_command(graph_arg: str | None, *args: str) -> str:
    """``flowrl plan GRAPH_ARG ARGS...`` with ``graph_arg`` shell-quoted (module docstring)."""
    return " ".join(("flowrl plan", shlex.quote(graph_arg) if graph_arg else "GRAPH", *args))
