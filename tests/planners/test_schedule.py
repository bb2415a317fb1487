"""Step times from node times: synchronous makespan, asynchronous busiest resource, timelines, colocation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flowrl.examples import build_example
from flowrl.planners.estimate.sync import SyncEstimate
from flowrl.planners.schedule import step_times
from flowrl.placement import colocation_groups, device_ranges

GRAPH = build_example("llamarl")  # prompts -> gen -> reward -> aipo -> policy, policy ~> gen
TIMES = {"prompts": 0.1, "gen": 1.0, "reward": 0.5, "aipo": 0.0, "policy": 2.0}
SYNC = [SyncEstimate(src="policy", dst="gen", transport="inprocess", bytes=1, time_s=0.25)]


def _devices(gen, policy):
    return {"prompts": (), "reward": (), "gen": gen, "policy": policy, "aipo": policy}


def test_colocated_sync_and_async_by_hand():
    s = step_times(GRAPH, _devices((0, 1), (0, 1)), TIMES, SYNC)
    assert s.sync_step_s == pytest.approx(0.1 + 1.0 + 0.5 + 2.0 + 0.25)
    # one colocation group: generation, training and the sync cannot overlap
    assert s.async_step_s == pytest.approx(1.0 + 2.0 + 0.25)
    assert "policy" in s.bottleneck and "devices 0-1" in s.bottleneck


def test_disaggregated_async_is_the_busiest_side():
    s = step_times(GRAPH, _devices((0,), (1,)), TIMES, SYNC)
    assert s.sync_step_s == pytest.approx(3.85)
    assert s.async_step_s == pytest.approx(max(1.0 + 0.25, 2.0 + 0.25))
    half = step_times(GRAPH, _devices((0,), (1,)), TIMES, SYNC, sync_overlap=0.5)
    assert half.async_step_s == pytest.approx(2.0 + 0.125)


def test_the_generators_own_hop_into_vllm_keeps_only_the_generator_busy():
    """A vLLM generator's last hop (``dst_only_s``: into its workers) is the generator side's alone:
    disaggregated, the trainer's busy time counts only the transfer (2.0 + 0.25, not + 0.75); colocated,
    the group waits for all of it."""
    hop = [SyncEstimate(src="policy", dst="gen", transport="collective", bytes=1, time_s=0.75, dst_only_s=0.5)]
    apart = step_times(GRAPH, _devices((0,), (1,)), TIMES, hop)
    assert sorted(t for r, t in apart.busy_s.items() if not r.startswith("host")) == pytest.approx([1.0 + 0.75, 2.0 + 0.25])
    assert apart.async_step_s == pytest.approx(2.0 + 0.25)
    together = step_times(GRAPH, _devices((0, 1), (0, 1)), TIMES, hop)
    assert together.async_step_s == pytest.approx(1.0 + 2.0 + 0.75)


def test_sync_timeline_respects_data_dependencies():
    s = step_times(GRAPH, _devices((0,), (1,)), TIMES, SYNC)
    span = {sp.node: sp for sp in s.sync_timeline if sp.what != "weight sync"}
    assert span["gen"].start_s == pytest.approx(span["prompts"].end_s)
    assert span["policy"].start_s == pytest.approx(span["reward"].end_s)
    syncs = [sp for sp in s.sync_timeline if sp.what == "weight sync"]
    assert {sp.resource for sp in syncs} == {"devices 0", "devices 1"}
    assert all(sp.start_s == pytest.approx(span["policy"].end_s) for sp in syncs)


@given(
    st.dictionaries(st.sampled_from(sorted(TIMES)), st.floats(0, 10), min_size=5, max_size=5),
    st.floats(0, 5),
    st.booleans(),
)
def test_spans_of_one_resource_never_overlap(times, w, colocated):
    devices = _devices((0, 1), (0, 1)) if colocated else _devices((0,), (1,))
    sync = [SyncEstimate(src="policy", dst="gen", transport="inprocess", bytes=1, time_s=w)]
    s = step_times(GRAPH, devices, times, sync)
    for timeline in (s.sync_timeline, s.async_timeline):
        by_resource: dict[str, list] = {}
        for sp in timeline:
            by_resource.setdefault(sp.resource, []).append(sp)
        for spans in by_resource.values():
            spans.sort(key=lambda sp: sp.start_s)
            for a, b in zip(spans, spans[1:]):
                assert b.start_s >= a.end_s - 1e-9
    assert s.async_step_s <= s.sync_step_s + 1e-9  # overlap never makes a step slower


def test_colocation_groups_and_ranges():
    assert colocation_groups({"a": range(0, 4), "b": range(3, 6), "c": range(6, 8), "d": ()}) == [["a", "b"], ["c"]]
    assert colocation_groups({"a": (0, 2), "b": (1, 3)}) == [["a"], ["b"]]
    assert device_ranges([0, 1, 2, 3, 8, 9, 11]) == "0-3,8-9,11"
