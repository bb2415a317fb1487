"""Fixtures for runtime tests: synthetic graphs and a guard that no executor thread outlives a test."""

from __future__ import annotations

import threading

import pytest

from flowrl.examples.llamarl import build_llamarl
from flowrl.graph.ir import Graph


@pytest.fixture
def graph_k():
    """A factory: the default pipeline with weight edge staleness k and the given transport."""

    def make(k: int = 1, transport: str = "inprocess") -> Graph:
        return build_llamarl(max_staleness=k, transport=transport)

    return make


@pytest.fixture(autouse=True)
def no_leftover_threads():
    yield
    alive = [t.name for t in threading.enumerate() if t.name.startswith("flowrl-") and t.is_alive()]
    assert not alive, f"executor threads left running: {alive}"
