"""Parallel dims: the equation in errors, head/layer divisibility, the compact form, mesh groups and host spans."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.errors import PlanError
from flowrl.modelspec import ModelSpec
from flowrl.planners.parallel import AXES, ParallelDims, axis_groups, divisors, enumerate_dims, spans_hosts, stage_fraction, stage_layers

MODEL = ModelSpec(name="m", n_layers=6, dim=64, n_heads=8, n_kv_heads=2, ffn_dim=128, vocab_size=100)


@pytest.mark.parametrize(
    "dims, devices, match",
    [
        (ParallelDims(dp=2, tp=4, pp=2), 8, r"dp\(2\) \* tp\(4\) \* pp\(2\) = 16 != devices\(8\)"),
        (ParallelDims(dp=1, tp=3), 3, r"tp\(3\) must divide the attention heads of m \(n_heads=8, 8 % 3 = 2\)"),
        (ParallelDims(dp=1, pp=8), 8, r"pp\(8\) is more pipeline stages than m has layers \(n_layers=6\); pick pp <= 6"),
    ],
    ids=["product", "heads", "layers"],
)
def test_check_states_the_equation(dims, devices, match):
    with pytest.raises(PlanError, match=match):
        dims.check(devices, MODEL, node="policy")


@pytest.mark.parametrize("layers, pp, largest", [(6, 4, 2), (126, 32, 4), (80, 16, 5), (7, 7, 1)], ids=str)
def test_uneven_stages(layers, pp, largest):
    assert stage_layers(layers, pp) == largest
    assert stage_fraction(layers, pp) == pytest.approx(largest / layers)
    ParallelDims(pp=pp).check(pp, msgspec.structs.replace(MODEL, n_layers=layers))  # pp need not divide the layers


def test_nonpositive_axis():
    with pytest.raises(PlanError, match=r"tp=0 must be an integer >= 1"):
        ParallelDims(tp=0)


@pytest.mark.parametrize("text, dims", [("d4t2p2", (4, 2, 2)), ("t8", (1, 8, 1)), ("d1", (1, 1, 1)), ("p3", (1, 1, 3))], ids=str)
def test_parse(text, dims):
    d = ParallelDims.parse(text)
    assert (d.dp, d.tp, d.pp) == dims


@pytest.mark.parametrize("text", ["", "x4", "t2d4", "d-1"], ids=repr)
def test_parse_rejects(text):
    with pytest.raises(PlanError, match="cannot parse parallel dims"):
        ParallelDims.parse(text)


@given(st.integers(1, 64), st.integers(1, 64), st.integers(1, 64))
def test_short_round_trips(dp, tp, pp):
    d = ParallelDims(dp=dp, tp=tp, pp=pp)
    assert ParallelDims.parse(d.short()) == d


@given(st.integers(1, 96))
def test_enumerate_dims_is_exactly_the_valid_set(n):
    found = set(enumerate_dims(n, MODEL))
    brute = {
        ParallelDims(dp=dp, tp=tp, pp=n // (dp * tp))
        for dp in divisors(n) for tp in divisors(n // dp)
        if MODEL.n_heads % tp == 0 and n // (dp * tp) <= MODEL.n_layers  # stages may be uneven
    }
    assert found == brute
    for d in found:
        d.check(n, MODEL)


def test_axis_groups_megatron_order():
    d = ParallelDims(dp=2, tp=2, pp=2)
    assert axis_groups(range(8), d, "tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert axis_groups(range(8), d, "dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert axis_groups(range(8), d, "pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]


@settings(max_examples=150)
@given(
    st.sampled_from([1, 2, 3, 4, 8]), st.sampled_from([1, 2, 3, 4, 5]), st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([1, 2, 3]), st.integers(0, 30), st.sampled_from(AXES), st.booleans(),
)
def test_spans_hosts_matches_brute_force(per_host, dp, tp, pp, start, axis, as_tuple):
    d = ParallelDims(dp=dp, tp=tp, pp=pp)
    devices = range(start, start + d.size)
    hosts = (np.asarray(list(devices)) // per_host).reshape(d.mesh_shape)
    along = AXES.index(axis)
    expected = bool((hosts.max(axis=along) != hosts.min(axis=along)).any())
    assert spans_hosts(tuple(devices) if as_tuple else devices, d, axis, per_host) == expected
