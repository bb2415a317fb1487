"""Every docstring example in the package runs and prints what it says (``doctest`` over flowrl/**/*.py)."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

import flowrl

__all__ = ["MODULES"]

_ROOT = Path(flowrl.__file__).parent


def _module_names() -> list[str]:
    names = []
    for path in sorted(_ROOT.rglob("*.py")):
        parts = ("flowrl", *path.relative_to(_ROOT).with_suffix("").parts)
        if parts[-1] == "__main__":  # importing it would run the CLI
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


MODULES = _module_names()


def _import(name: str) -> object:
    """The module; a missing optional extra (not a flowrl module) is a visible skip."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] == "flowrl":
            raise
        pytest.importorskip(exc.name, reason=f"{name} needs the optional package {exc.name}")
        raise


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    module = _import(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=True)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed (printed above)"


def test_walk_finds_the_package() -> None:
    assert {"flowrl.graph.ir", "flowrl.runtime.run", "flowrl.planners.plan", "flowrl.cli.main"} <= set(MODULES)
    assert "flowrl.__main__" not in MODULES
