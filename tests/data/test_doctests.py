"""The examples in flowrl.data's docstrings (and the rewards') run and print what they say."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["flowrl.operators.rewards", "flowrl.data.files", "flowrl.data.dataset", "flowrl.data.encode", "flowrl.data.order", "flowrl.data.stream", "flowrl.data.wiring"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0, f"{name} has no docstring example"
