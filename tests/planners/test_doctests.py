"""The examples in the planner's docstrings run and print what they say."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "flowrl.planners",
    "flowrl.planners.cluster",
    "flowrl.planners.modelspec",
    "flowrl.planners.parallel",
    "flowrl.planners.tuning",
    "flowrl.planners.workload",
    "flowrl.planners.strategies",
    "flowrl.planners.schedule",
    "flowrl.planners.plan",
    "flowrl.planners.plan_data",
    "flowrl.planners.forms",
    "flowrl.planners.timeline",
    "flowrl.planners.calibrate",
    "flowrl.planners.estimate.train",
    "flowrl.planners.estimate.generate",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0, f"{name} has no docstring example"
