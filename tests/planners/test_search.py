"""The search: which splits each strategy enumerates, and properties every returned plan keeps."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowrl.errors import PlanError
from flowrl.examples import build_example
from flowrl.planners.cluster import ClusterSpec, DEVICE_PRESETS, parse_cluster
from flowrl.modelspec import ModelSpec, model_preset
from flowrl.planners.plan import Plan, parse_plan, plan_graph, plan_to_json
from flowrl.planners.strategies import candidate_counts, device_splits
from flowrl.planners.workload import Workload

MID = ModelSpec(name="mid", n_layers=8, dim=1024, n_heads=16, n_kv_heads=4, ffn_dim=4096, vocab_size=32000)
WORK = Workload(prompts_per_step=16, samples_per_prompt=4, prompt_len=64, gen_len=64)
GRAPHS = {name: build_example(name) for name in ("llamarl", "llamarl_ref", "two_scorers")}


def h100s(hosts: int, per_host: int = 4) -> ClusterSpec:
    return ClusterSpec(name=f"{hosts}x{per_host}xH100", hosts=hosts, devices_per_host=per_host, device=DEVICE_PRESETS["H100"])


def test_candidate_counts_do_not_depend_on_cluster_size():
    small, large = candidate_counts(100), candidate_counts(1000)
    assert small == [c for c in large if c <= 100]
    assert candidate_counts(1024)[-1] == 1024 and 896 in candidate_counts(1024)  # 7 * 128


@pytest.mark.parametrize(
    "strategy, n, families, uses_all",
    [("colocated", 12, {"colocated"}, True), ("disaggregated", 12, {"disaggregated"}, True), ("search", 12, {"colocated", "disaggregated"}, False)],
    ids=["colocated", "disaggregated", "search"],
)
def test_device_splits_per_strategy(strategy, n, families, uses_all):
    splits = device_splits(strategy, n, devices_per_host=4)
    assert {s.family for s in splits} == families
    for s in splits:
        assert s.gen_devices.stop <= n and s.train_devices.stop <= n
        if s.family == "disaggregated":
            assert s.gen_devices.stop <= s.train_devices.start  # disjoint
    if uses_all:
        assert any(max(s.gen_devices.stop, s.train_devices.stop) == n for s in splits)


def test_disaggregated_split_also_tries_host_aligned_trainer():
    starts = {s.train_start for s in device_splits("disaggregated", 16, devices_per_host=8) if s.gen_count == 3}
    assert {3, 8} <= starts


def test_disaggregated_needs_two_devices():
    with pytest.raises(PlanError, match="needs at least 2 devices"):
        plan_graph(GRAPHS["llamarl"], "cpu:1", strategy="disaggregated")


@settings(max_examples=12)
@given(
    st.sampled_from(sorted(GRAPHS)),
    st.integers(1, 3),
    st.sampled_from([2, 4]),
    st.sampled_from(["search", "colocated", "disaggregated"]),
    st.integers(0, 2),
)
def test_plans_fit_and_share_devices_only_within_groups(graph_name, hosts, per_host, strategy, k):
    graph = GRAPHS[graph_name]
    cluster = h100s(hosts, per_host)
    try:
        plan = plan_graph(graph, cluster, strategy=strategy, model=MID, workload=WORK, max_staleness=k)
    except PlanError as exc:
        assert "needs at least 2 devices" in str(exc) or "no placement" in str(exc)
        return
    budget = cluster.device.memory_bytes * plan.tuning.memory_util
    groups = plan.colocation_groups()
    group_of = {n: i for i, g in enumerate(groups) for n in g}
    names = list(plan.placements)
    for p in plan.placements.values():
        assert p.memory_bytes <= budget
        assert all(0 <= d < cluster.n_devices for d in p.devices)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if set(plan.placements[a].devices) & set(plan.placements[b].devices):
                assert group_of[a] == group_of[b]
    # nodes of one colocation group never run at the same time in the predicted timeline
    by_resource: dict[str, list] = {}
    for span in plan.timeline:
        by_resource.setdefault(span.resource, []).append(span)
    for spans in by_resource.values():
        spans.sort(key=lambda s: s.start_s)
        for x, y in zip(spans, spans[1:]):
            assert y.start_s >= x.end_s - 1e-9
    assert plan.step_s == (plan.async_step_s if k >= 1 else plan.sync_step_s)
    # round trips: JSON keeps everything, the compact string keeps the placement
    assert msgspec.json.decode(plan_to_json(plan), type=Plan) == plan
    for name, p in parse_plan(str(plan)).items():
        assert (p.devices, p.dims) == (plan.placements[name].devices, plan.placements[name].dims)


@settings(max_examples=10)
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([2, 4]), st.integers(0, 1))
def test_more_devices_never_make_the_best_step_slower(hosts, extra, per_host, k):
    graph = GRAPHS["llamarl"]
    steps = []
    for h in (hosts, hosts + extra):
        try:
            steps.append(plan_graph(graph, h100s(h, per_host), model=MID, workload=WORK, max_staleness=k).step_s)
        except PlanError:
            steps.append(float("inf"))
    assert steps[1] <= steps[0] * (1 + 1e-9)


@settings(max_examples=6)
@given(st.integers(1, 5))
def test_more_cores_never_make_the_cpu_step_slower(cores):
    graph = GRAPHS["llamarl"]
    small = plan_graph(graph, parse_cluster(f"cpu:{cores}")).step_s
    large = plan_graph(graph, parse_cluster(f"cpu:{cores + 1}")).step_s
    assert large <= small * (1 + 1e-9)


def test_search_is_at_least_as_fast_as_each_family_on_aligned_clusters():
    graph = GRAPHS["llamarl"]
    cluster = h100s(2, 4)
    best = plan_graph(graph, cluster, model=MID, workload=WORK).step_s
    for strategy in ("colocated", "disaggregated"):
        assert best <= plan_graph(graph, cluster, model=MID, workload=WORK, strategy=strategy).step_s * (1 + 1e-9)


@pytest.mark.usefixtures("every_axis_runs")  # a search over tp/pp trainers (tests/planners/conftest.py)
def test_llama_on_1024_h100s_answers():
    plan = plan_graph(GRAPHS["llamarl"], "1024xH100", model=model_preset("llama3-70b"), gen_precision="bfloat16")
    assert plan.family == "disaggregated" and plan.speedup_vs_baseline > 1
    assert plan.workload.tokens_per_step == 256 * 8 * (512 + 2048)
    assert "gen" in plan.bottleneck or "policy" in plan.bottleneck


# -- tensor-parallel groups and hosts ------------------------------------------------------------
_WORK_TP = Workload(prompts_per_step=64, samples_per_prompt=4, prompt_len=256, gen_len=256)
#: one layer (no pipeline split) and 17B parameters: its trainer fits on H100s only with tp >= 2
WIDE = ModelSpec(name="wide", n_layers=1, dim=32768, n_heads=256, n_kv_heads=8, ffn_dim=131072, vocab_size=32000, max_seq_len=4096)


def test_tensor_parallel_groups_stay_within_a_host():
    """On one device per host every tp > 1 crosses hosts; the 8B model fits without, so no candidate uses it."""
    plan = plan_graph(GRAPHS["llamarl"], h100s(8, per_host=1), model=model_preset("llama3-8b"), workload=_WORK_TP, gen_precision="bfloat16")
    placements = [str(plan)] + [a.placement for a in plan.alternatives]
    assert len(placements) > 1
    for text in placements:
        assert all(p.dims.tp == 1 for p in parse_plan(text).values()), text
    assert plan.warnings == ()


@pytest.mark.usefixtures("every_axis_runs")  # a search over tp/pp trainers (tests/planners/conftest.py)
def test_tensor_parallel_across_hosts_only_where_nothing_else_fits_and_warned():
    from flowrl.planners.report import format_plan

    # one device per host: on the colocated split of 12 the sides fit alone but not together with tp within
    # a host, so both may span hosts there (a rule of the split alone); nothing faster fits elsewhere
    plan = plan_graph(GRAPHS["llamarl"], h100s(16, per_host=1), model=WIDE, workload=_WORK_TP, gen_precision="bfloat16")
    assert str(plan.placement()) == "gen:d3t4@0-11 | policy:d3t4@0-11"
    assert plan.warnings == tuple(
        f"node {n!r}: each tensor-parallel group of 4 devices spans 4 hosts, so its all-reduces (two per layer) cross hosts "
        "at 50 GB/s per device instead of 450 GB/s within a host (9x slower); on its devices the search found no dims that fit with tp within one host"
        for n in ("gen", "policy")
    )
    assert f"warning: {plan.warnings[0]}" in format_plan(plan)
    assert msgspec.json.decode(plan_to_json(plan), type=Plan).warnings == plan.warnings


def test_given_placement_across_hosts_is_warned():
    plan = plan_graph(GRAPHS["llamarl"], h100s(2, per_host=4), model=model_preset("llama3-8b"), workload=_WORK_TP, strategy="gen:t8@0-7 | policy:d8@0-7")
    assert len(plan.warnings) == 1 and plan.warnings[0].startswith("node 'gen': each tensor-parallel group of 8 devices spans 2 hosts")
    assert plan.warnings[0].endswith("; as the placement gives it")


def test_every_split_family_has_a_search_and_a_bound():
    """A split family the search does not know would have been costed as disaggregated (issue 13):
    each family of ``DeviceSplit`` has its own entry in both tables."""
    import typing

    from flowrl.planners import search
    from flowrl.planners.strategies import DeviceSplit

    families = set(typing.get_args(typing.get_type_hints(DeviceSplit)["family"]))
    assert families == set(search._SEARCH_SPLIT) == set(search._LOWER_BOUND)
    assert search._LOWER_BOUND["colocated"](1.0, 2.0) == 3.0 and search._LOWER_BOUND["disaggregated"](1.0, 2.0) == 2.0


def test_a_strategy_is_its_name_and_its_branch_in_strategies_py(monkeypatch):
    """The extension table's strategy row: a name in ``STRATEGIES`` and its branch in ``device_splits``,
    both in ``planners/strategies.py``, are all ``plan_graph`` needs (patched here on that module alone)."""
    from flowrl.planners import strategies
    from flowrl.planners.strategies import DeviceSplit

    known = strategies.device_splits

    def device_splits_with_halves(strategy, n_devices, *args, **kwargs):
        if strategy == "halves":  # the new branch: the generator on the first half, the trainer on the rest
            return [DeviceSplit(family="disaggregated", gen_start=0, gen_count=n_devices // 2, train_start=n_devices // 2, train_count=n_devices - n_devices // 2)]
        return known(strategy, n_devices, *args, **kwargs)

    with pytest.raises(PlanError, match="unknown strategy 'halves'"):
        plan_graph(GRAPHS["llamarl"], "cpu:4", strategy="halves")
    monkeypatch.setattr(strategies, "STRATEGIES", (*strategies.STRATEGIES, "halves"))
    monkeypatch.setattr(strategies, "device_splits", device_splits_with_halves)
    plan = plan_graph(GRAPHS["llamarl"], "cpu:4", strategy="halves")
    assert list(plan.placements["gen"].devices) == [0, 1] and list(plan.placements["policy"].devices) == [2, 3]
