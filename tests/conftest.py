"""Shared test setup: the ``--runslow`` option, a hypothesis profile, and fixtures for the built-in example graphs."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from flowrl.examples import EXAMPLES, build_example
from flowrl.graph.ir import Graph

__all__ = ["EXAMPLE_NAMES"]

pytest_plugins = ["tests.hf_fixtures", "tests.runtime.ep_fixtures"]  # tiny Hugging Face model directories for every HF test; the expert-parallel run

EXAMPLE_NAMES: tuple[str, ...] = tuple(sorted(EXAMPLES))

# No per-example deadline: this machine's cores are shared, so timing varies by 10x between runs,
# and speed is measured in benches/, not tests. Example counts stay hypothesis's (or each test's own).
settings.register_profile("flowrl", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("flowrl")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long variants, skipped unless --runslow is given")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=EXAMPLE_NAMES)
def example_name(request: pytest.FixtureRequest) -> str:
    """Each built-in example's name in turn."""
    return request.param


@pytest.fixture
def example_graph(example_name: str) -> Graph:
    """Each built-in example graph in turn."""
    return build_example(example_name)


@pytest.fixture
def runnable_example_graph(example_name: str, request: pytest.FixtureRequest) -> Graph:
    """Each built-in example graph in turn, ready to run here: ``qwen_math`` (a real model's shape,
    no weights shipped) pointed at a tiny random Qwen2 with a chat template, as its docstring says."""
    if example_name == "qwen_math":
        from flowrl.examples.qwen_math import build_qwen_math

        return build_qwen_math(model_dir=request.getfixturevalue("hf_qwen2_chat_dir"))
    return build_example(example_name)
