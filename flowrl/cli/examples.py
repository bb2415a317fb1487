"""``flowrl examples``: list the built-in example pipelines."""

from __future__ import annotations

import argparse

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("examples", help="list the built-in example pipelines", description="List the built-in example pipelines (usable as GRAPH in run, plan and viz).")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from flowrl.examples import DEFAULT_EXAMPLE, describe_examples

    for name, desc in describe_examples():
        mark = " (default)" if name == DEFAULT_EXAMPLE else ""
        print(f"{name:<14}{desc}{mark if '(the default)' not in desc else ''}")
    return 0
