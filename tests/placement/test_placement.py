"""``flowrl.placement``: the struct's checks, the run strategies, the JSON form's round trip."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.errors import PlanError
from flowrl.examples.llamarl import build_llamarl, build_llamarl_ref
from flowrl.placement import NodeMesh, Placement, decode_placement, default_placement, placement_to_json

LLAMARL = build_llamarl(max_staleness=1)


@pytest.mark.parametrize(
    ("devices", "shape", "match"),
    [
        ((1, 1), (), r"devices \[1, 1\]: devices must be distinct and >= 0"),
        ((-1,), (), r"devices \[-1\]: devices must be distinct and >= 0"),
        ((), (), r"devices \[\]: .*at least one"),
        ((0, 1, 2), (1, 1, 2), r"pp\(1\) \* dp\(1\) \* tp\(2\) = 2 != devices\(3\) \[0, 1, 2\]"),
        ((0, 1), (2, 1), r"mesh shape \(2, 1\): give one size >= 1 per axis \('pp', 'dp', 'tp'\)"),
    ],
    ids=["duplicate", "negative", "empty", "product", "axes"],
)
def test_a_node_mesh_refuses_what_cannot_be_a_mesh(devices, shape, match):
    with pytest.raises(PlanError, match=match):
        NodeMesh(devices=devices, mesh_shape=shape)


def test_a_node_mesh_without_a_shape_is_data_parallel():
    m = NodeMesh(devices=(4, 5, 6))
    assert m.mesh_shape == (1, 3, 1) and m.size("dp") == 3 and m.short() == "d3"


def test_asking_for_a_node_the_placement_does_not_place_names_the_placed_ones():
    p = Placement(nodes={"gen": NodeMesh(devices=(0,))}, source="test")
    with pytest.raises(PlanError, match=r"the placement \(test\) places no node 'policy'; it places gen"):
        p.mesh("policy")


@pytest.mark.parametrize(
    ("graph", "k", "n", "expect"),
    [
        (LLAMARL, 0, 4, {"gen": (0, 1, 2, 3), "policy": (0, 1, 2, 3)}),
        (LLAMARL, 1, 4, {"gen": (0, 1), "policy": (2, 3)}),
        (LLAMARL, 1, 1, {"gen": (0,), "policy": (0,)}),
        (build_llamarl_ref(), 2, 5, {"gen": (0, 1), "policy": (2, 3, 4), "ref": (2, 3, 4)}),
    ],
    ids=["k0-colocated", "k1-halves", "one-device", "reference-on-the-trainer-side"],
)
def test_the_default_placement_is_the_run_strategy(graph, k, n, expect):
    p = default_placement(graph, k, n)
    assert p.devices == expect and p.strategy == ("all-colocated" if k == 0 or n == 1 else "halves")
    assert p.groups() == ([sorted(expect)] if len({*expect.values()}) == 1 else [["gen"], sorted(set(expect) - {"gen"})])


def test_the_default_needs_a_device():
    with pytest.raises(PlanError, match="at least one device"):
        default_placement(LLAMARL, 1, 0)


_MESH = st.sampled_from([(1, 1, 1), (1, 2, 1), (1, 1, 2), (2, 1, 1), (1, 2, 2), (2, 2, 1), (2, 1, 2)])


@settings(max_examples=60, deadline=None)
@given(gen=_MESH, policy=_MESH, start=st.integers(0, 8))
def test_the_json_form_reads_back_equal(gen, policy, start):
    n_gen = gen[0] * gen[1] * gen[2]
    nodes = {
        "gen": NodeMesh(devices=tuple(range(start, start + n_gen)), mesh_shape=gen),
        "policy": NodeMesh(devices=tuple(range(start + n_gen, start + n_gen + policy[0] * policy[1] * policy[2]))[::-1], mesh_shape=policy),
    }
    placement = Placement(nodes=nodes, source="x")
    assert decode_placement(placement_to_json(placement).encode(), LLAMARL, where="x") == placement
