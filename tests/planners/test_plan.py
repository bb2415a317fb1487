"""``plan_graph`` end to end: every node placed, strategies, JSON and string round trips, errors, runtime use."""

from __future__ import annotations

import json

import msgspec
import pytest

from flowrl.errors import PlanError
from flowrl.examples import build_example
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import ModelConfig
from flowrl.planners.baseline import BaselineSystem
from flowrl.planners.cluster import parse_cluster
from flowrl.modelspec import model_preset
from flowrl.planners.plan import Plan, load_plan, parse_plan, plan_graph, plan_to_json, save_plan
from flowrl.planners.report import format_plan
from flowrl.planners.workload import Workload

LLAMARL = build_example("llamarl")
CPU2 = parse_cluster("cpu:2")


@pytest.mark.parametrize("strategy, family", [("colocated", "colocated"), ("disaggregated", "disaggregated"), ("search", None)])
def test_default_example_plans_on_two_cores(strategy, family):
    plan = plan_graph(LLAMARL, CPU2, strategy=strategy)
    assert set(plan.placements) == {n.name for n in LLAMARL.nodes}
    assert family is None or plan.family == family
    # the loss runs on its policy's mesh; CPU nodes hold no devices
    assert plan.placements["aipo"].devices == plan.placements["policy"].devices
    assert plan.placements["prompts"].devices == () and plan.placements["reward"].devices == ()
    assert plan.step_s == plan.async_step_s  # the example's weight edge has k = 1
    assert plan.sync_step_s >= plan.async_step_s > 0
    source, gen = LLAMARL.nodes_of_kind("source")[0], LLAMARL.nodes_of_kind("generator")[0]
    assert plan.workload == Workload(
        prompts_per_step=source.source.batch_size,
        samples_per_prompt=gen.sampling.n_samples,
        prompt_len=gen.model.max_seq_len - gen.sampling.max_new_tokens,  # no prompt length in a graph: the bound
        prompt_len_from="the upper bound max_seq_len - max_new_tokens of generator 'gen'",
        gen_len=gen.sampling.max_new_tokens,
    )
    text = format_plan(plan)
    assert "predicted step: sync (k=0)" in text and "memory/device" in text


def test_disaggregated_on_cpu_pins_one_core_each():
    plan = plan_graph(LLAMARL, CPU2, strategy="disaggregated")
    assert str(plan) == "gen:d1@0 | policy:d1@1"
    assert plan.colocation_groups() == [["aipo", "policy"], ["gen"]]
    placement = plan.placement()  # what 'flowrl run --plan' runs
    assert placement.devices == {"gen": (0,), "policy": (1,)} and placement.pin  # a CPU plan's ids are cores
    assert placement.groups() == [["gen"], ["policy"]]


def test_colocated_is_one_group_and_sync_equals_a_baseline_with_its_choices():
    """A baseline system that makes flowrl's colocated choices (its own dims per phase, the
    transport's reshard, no recompute under AIPO) is the colocated plan's synchronous step; the
    default, DeepSpeed-Chat-like system (shared layout, gather, recompute) is slower."""
    same = BaselineSystem(name="flowrl-colocated", shared_layout=False, weight_sync="reshard", recompute_logprobs=False)
    plan = plan_graph(LLAMARL, CPU2, strategy="colocated", baseline=same)
    assert plan.colocation_groups() == [["aipo", "gen", "policy"]]
    assert plan.baseline_step_s == pytest.approx(plan.sync_step_s)
    assert plan.baseline_system == "flowrl-colocated"
    default = plan_graph(LLAMARL, CPU2, strategy="colocated")
    assert default.baseline_step_s > plan.sync_step_s


def test_k0_graph_ranks_by_synchronous_step():
    plan = plan_graph(build_example("llamarl"), CPU2, max_staleness=0)
    assert plan.max_staleness == 0 and plan.step_s == plan.sync_step_s
    span = {s.node: s for s in plan.timeline}  # the synchronous timeline: one phase after another
    assert span["policy"].start_s >= span["gen"].end_s and span["policy~>gen"].start_s >= span["policy"].end_s


def test_json_round_trip(tmp_path):
    plan = plan_graph(build_example("llamarl_ref"), CPU2)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    back = load_plan(path)
    assert back == plan
    assert json.loads(path.read_text())["placements"]["ref"]["axes"] == ["pp", "dp", "tp"]
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temp file left behind


def test_string_round_trip_keeps_the_placement():
    plan = plan_graph(LLAMARL, "16xH100", model=model_preset("llama3-8b"), strategy="disaggregated", workload=_SMALL)
    parsed = parse_plan(str(plan))
    assert set(parsed) == {"gen", "policy"}
    for name, p in parsed.items():
        assert (p.devices, p.dims) == (plan.placements[name].devices, plan.placements[name].dims)
    again = plan_graph(LLAMARL, "16xH100", model=model_preset("llama3-8b"), strategy=str(plan), workload=_SMALL)
    assert again.strategy == "manual" and again.family == "manual"
    assert again.async_step_s == pytest.approx(plan.async_step_s)


_SMALL = Workload(prompts_per_step=32, samples_per_prompt=4, prompt_len=128, gen_len=128)


@pytest.mark.parametrize(
    "strategy, match",
    [
        ("gen:d2@0-1", r"leaves out 'policy'"),
        ("gen:d2@0-1 | policy:d2@2-3 | ghost:d1@4", r"'ghost', which are not device nodes"),
        ("gen:d2@0-2 | policy:d1@3", r"dp\(2\) \* tp\(1\) \* pp\(1\) = 2 != devices\(3\)"),
        ("gen:d1@0 | policy:d1@99", r"device 99, but cluster '16xH100' has devices 0-15"),
        ("gen:t3@0-2 | policy:d1@3", r"tp\(3\) must divide the attention heads"),
        ("gen=d1@0", r"unknown strategy"),
        ("gen:d1@3-1 | policy:d1@4", r"runs backwards"),
        ("fast", r"unknown strategy 'fast'; strategies: colocated, disaggregated, search"),
    ],
    ids=["missing", "unknown-node", "product", "out-of-range", "heads", "no-colon", "backwards", "unknown"],
)
def test_bad_placements(strategy, match):
    with pytest.raises(PlanError, match=match):
        plan_graph(LLAMARL, "16xH100", model=model_preset("llama3-8b"), strategy=strategy, workload=_SMALL)


def test_nothing_fits_names_node_memory_and_excess():
    with pytest.raises(PlanError, match=r"no placement of graph 'llamarl' fits on 8xH100 .*closest miss: node '(policy|gen)' .*GiB per device.*GiB over"):
        plan_graph(LLAMARL, "8xH100", model=model_preset("llama3-405b"))


@pytest.mark.usefixtures("every_axis_runs")  # a search over tp/pp trainers (tests/planners/conftest.py)
@pytest.mark.parametrize(
    "tuning, suggested, left_out",
    [
        ({"gen_precision": "bfloat16"}, ["--gen-precision float8", "the disaggregated strategy", "--set memory_util=0.95"], []),
        ({"gen_precision": "float8"}, ["the disaggregated strategy", "--set memory_util=0.95"], ["float8"]),
        ({"gen_precision": "bfloat16", "memory_util": 0.95}, ["--gen-precision float8"], ["memory_util"]),
    ],
    ids=["nothing-set", "float8-set", "memory-util-set"],
)
def test_hint_suggests_only_what_is_not_set(tuning, suggested, left_out):
    with pytest.raises(PlanError, match="no split fits them all at once") as info:
        plan_graph(LLAMARL, "2xH100", model=model_preset("llama3-8b"), strategy="colocated", **tuning)
    hint = str(info.value).split("try: ", 1)[1]
    assert all(s in hint for s in suggested), hint
    assert not any(s in hint for s in left_out), hint


@pytest.mark.usefixtures("every_axis_runs")  # a search over tp/pp trainers (tests/planners/conftest.py)
def test_hint_leaves_out_a_strategy_the_search_already_tried():
    with pytest.raises(PlanError, match="no split fits them all at once") as info:
        plan_graph(LLAMARL, "2xH100", model=model_preset("llama3-8b"), gen_precision="float8")
    assert "disaggregated" not in str(info.value).split("try: ", 1)[1]


@pytest.mark.usefixtures("every_axis_runs")  # a search over tp/pp trainers (tests/planners/conftest.py)
def test_baseline_that_does_not_fit_says_why(tmp_path):
    # uneven pipeline stages let the default baseline fit on 3 devices (p3); one sampling in float32 does not
    fp32 = BaselineSystem(name="fp32-sampler", gen_precision="float32")
    plan = plan_graph(LLAMARL, "3xH100", model=model_preset("llama3-8b"), gen_precision="bfloat16", baseline=fp32, memory_util=0.7, offload="off")
    assert plan.baseline_step_s is None and plan.step_s > 0
    # the shared layout puts the generator's float32 weights beside the policy's state
    assert plan.baseline_problem.startswith("closest miss: node 'gen' (llama3-8b generation on p3, float32 weights) needs ")
    assert "held by colocated nodes; a H100 has 80.0 GiB x memory_util 0.7 = 56.0 GiB" in plan.baseline_problem
    text = format_plan(plan)
    assert f"baseline {plan.baseline_system} on 3 devices or fewer: does not fit: {plan.baseline_problem}" in text
    save_plan(plan, tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").baseline_problem == plan.baseline_problem


@pytest.mark.usefixtures("every_axis_runs")  # a search over tp/pp trainers (tests/planners/conftest.py)
def test_every_memory_figure_fits_the_budget():
    plan = plan_graph(LLAMARL, "64xH100", model=model_preset("llama3-70b"), workload=_SMALL, gen_precision="bfloat16")
    budget = plan.cluster_spec.device.memory_bytes * plan.tuning.memory_util
    for p in plan.placements.values():
        assert p.memory_bytes <= budget
    assert plan.alternatives and all(a.step_s >= plan.step_s for a in plan.alternatives)
    assert all(a.reason.startswith("step ") for a in plan.alternatives)


def test_preset_in_graph_uses_llm_workload():
    b = GraphBuilder("big", model=ModelConfig(preset="llama3-8b"))
    prompts = b.source("prompts", task="copy", batch_size=8)
    gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=6)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    policy = b.policy("policy", b.loss("aipo", gen, reward))
    b.weights(policy, gen)
    plan = plan_graph(b.build(), "64xH100", gen_precision="bfloat16")
    assert plan.workload.prompt_len == 512 and plan.models["gen"].name == "llama3-8b"


@pytest.mark.parametrize(
    "content, match",
    [
        (b"nope", r"plan file .* is not valid JSON"),
        (b'{"graph": "g"}', r"does not match the flowrl plan schema"),
        (None, r"does not exist; write one with 'flowrl plan"),
    ],
    ids=["not-json", "schema", "missing"],
)
def test_load_plan_errors(tmp_path, content, match):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(PlanError, match=match):
        load_plan(path)


def test_load_plan_rejects_inconsistent_mesh(tmp_path):
    data = json.loads(plan_to_json(plan_graph(LLAMARL, CPU2, strategy="colocated")))
    data["placements"]["gen"]["mesh_shape"] = [1, 1, 1]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"expected axes \('pp', 'dp', 'tp'\) and shape \(1, 2, 1\)"):
        load_plan(path)
    data["placements"]["gen"]["mesh_shape"] = [1, 2, 1]
    data["placements"]["gen"]["devices"] = [0, 7]
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"device 7, but cluster 'cpu:2' has devices 0-1"):
        load_plan(path)


def test_save_plan_to_missing_folder_writes_nothing(tmp_path):
    plan = plan_graph(LLAMARL, CPU2)
    with pytest.raises(PlanError, match="does not exist"):
        save_plan(plan, tmp_path / "no" / "plan.json")


def test_node_labels():
    plan = plan_graph(LLAMARL, CPU2, strategy="disaggregated")
    assert plan.node_label("gen").startswith("devices 0 · dp1 · ")
    assert plan.node_label("aipo") == "in policy's step · devices 1"
    assert plan.node_label("reward").startswith("host CPU · ")
    with pytest.raises(PlanError, match=r"no node 'x'; nodes: prompts, gen"):
        plan.node_label("x")


def test_unknown_tuning_name():
    with pytest.raises(PlanError, match=r"unknown tuning parameter\(s\) 'mfu'; known: mfu_train"):
        plan_graph(LLAMARL, CPU2, mfu=0.5)
    with pytest.raises(PlanError, match=r"tuning mfu_train=2.0 must be in \(0, 1\]"):
        plan_graph(LLAMARL, CPU2, mfu_train=2.0)


def test_plan_is_plain_msgspec():
    plan = plan_graph(LLAMARL, CPU2)
    assert msgspec.json.decode(plan_to_json(plan), type=Plan) == plan
