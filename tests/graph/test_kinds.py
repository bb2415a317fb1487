"""The kinds table (``flowrl.graph.kinds``): every kind has every part, and every part reads the table."""

from __future__ import annotations

import pytest

from flowrl.graph.export import KIND_STYLES
from flowrl.graph.kinds import KINDS
from flowrl.graph.nodes import DEVICE_KINDS, NODE_KINDS
from flowrl.graph.refs import resolve


def test_the_table_lists_every_kind_in_order():
    assert tuple(KINDS) == NODE_KINDS
    assert {k for k, spec in KINDS.items() if spec.runs_on == "devices"} == DEVICE_KINDS


@pytest.mark.parametrize("kind", NODE_KINDS)
def test_every_part_of_a_kind_exists(kind):
    spec = KINDS[kind]
    node = resolve(spec.node)
    assert node.__struct_config__.tag == kind, f"{spec.node} is not the node struct of kind {kind!r}"
    assert callable(resolve(spec.estimator))
    if spec.runs_on == "policy":
        assert spec.program == "", "a kind that runs inside its policy has no program of its own"
    else:
        assert callable(resolve(spec.program))
    assert spec.span and KIND_STYLES[kind] is spec.style


@pytest.mark.parametrize("kind", [k for k in NODE_KINDS if KINDS[k].program])
def test_measured_and_predicted_spans_share_the_table_names(kind):
    from flowrl.planners.schedule import _WHAT
    from flowrl.runtime.controller import SPAN_NAMES

    assert SPAN_NAMES[kind] == _WHAT[kind] == KINDS[kind].span


def test_programs_are_built_through_the_table(monkeypatch):
    """A kind's program comes from its table entry: pointing the entry elsewhere changes what is built."""
    import msgspec

    from flowrl.examples.llamarl import build_llamarl
    from flowrl.graph import kinds
    from flowrl.runtime.programs import ProgramEnv, SharedTransports, build_program

    monkeypatch.setitem(kinds.KINDS, "scorer", msgspec.structs.replace(KINDS["scorer"], program="tests.graph.test_kinds:_fake_program"))
    graph = build_llamarl()
    program = build_program(graph, "reward", ProgramEnv(), SharedTransports(()))
    assert program == ("fake", "reward")


def _fake_program(node, graph, env, transports):
    return ("fake", node.name)
