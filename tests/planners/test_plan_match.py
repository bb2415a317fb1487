"""Is a plan this graph's: other nodes, kinds or model shapes are another graph's; another step is named field by field."""

from __future__ import annotations

import msgspec
import pytest

from flowrl.errors import PlanError
from flowrl.examples import build_example
from flowrl.modelspec import model_from_config, model_preset
from flowrl.planners.plan import plan_graph
from flowrl.planners.plan_match import check_plan_graph, graph_differences, planned_for, step_differences
from flowrl.planners.workload import workload_from_graph


@pytest.fixture(scope="module")
def llamarl():
    return build_example("llamarl")


def test_a_plan_of_the_graph_itself_matches(llamarl):
    plan = plan_graph(llamarl, "cpu:3", strategy="gen:d1@0 | policy:d2@1-2")
    assert graph_differences(plan, llamarl) == [] and step_differences(plan, llamarl) == []
    assert planned_for(plan, llamarl).endswith("(the graph's own)")
    check_plan_graph(plan, llamarl, where="--plan p.json", replan="flowrl plan llamarl --cluster cpu:3 -o p.json")  # no error


def test_a_shape_of_another_name_is_the_same_model(llamarl):
    """A preset and a model directory of the same figures are one model: names are not compared."""
    same = msgspec.structs.replace(model_from_config(llamarl.node("policy").model), name="my-copy")
    plan = plan_graph(llamarl, "cpu:2", model=same, workload=workload_from_graph(llamarl))
    assert plan.models["policy"].name == "my-copy" and graph_differences(plan, llamarl) == []


def test_a_plan_of_another_model_is_another_graphs(llamarl):
    plan = plan_graph(llamarl, "64xH100", model=model_preset("qwen2.5-7b"))
    with pytest.raises(PlanError) as err:
        check_plan_graph(plan, llamarl, where="--plan big.json", replan="flowrl plan llamarl --cluster 64xH100 -o big.json")
    text = str(err.value)
    assert text.startswith("--plan big.json was made for another graph than this run's: node 'gen' was planned as model qwen2.5-7b ")
    assert "node 'policy' was planned as model qwen2.5-7b (n_layers 28, dim 3584, n_heads 28), but runs 2L64d here (n_layers 2, dim 64, n_heads 4)" in text
    assert text.endswith("; re-plan for this graph: flowrl plan llamarl --cluster 64xH100 -o big.json")


def test_other_nodes_are_named(llamarl):
    with_ref = build_example("llamarl_ref")
    plan = plan_graph(llamarl, "cpu:2")
    assert graph_differences(plan, with_ref) == [
        "the plan was made for graph 'llamarl', not 'llamarl_ref'",
        "the plan places no devices for node 'ref' of graph 'llamarl_ref'",
    ]
    assert graph_differences(plan_graph(with_ref, "cpu:3"), llamarl)[1] == "the plan places ['ref'], which graph 'llamarl' does not have as device nodes"


def test_another_step_is_named_with_its_flag(llamarl):
    ours = workload_from_graph(llamarl)
    bigger = msgspec.structs.replace(ours, prompts_per_step=2 * ours.prompts_per_step, gen_len=ours.gen_len - 1, batching="continuous")
    plan = plan_graph(llamarl, "cpu:2", workload=bigger, gen_precision="bfloat16")
    assert graph_differences(plan, llamarl) == []  # the same graph: it runs, with other times
    assert step_differences(plan, llamarl) == [
        f"prompts per step: {2 * ours.prompts_per_step} in the plan, {ours.prompts_per_step} here (--prompts-per-step {ours.prompts_per_step})",
        f"completion length (max_new_tokens): {ours.gen_len - 1} in the plan, {ours.gen_len} here (--gen-len {ours.gen_len})",
        "batching: continuous in the plan, lockstep here (--batching lockstep)",
        "generator 'gen' weights: bfloat16 in the plan, float32 here (--gen-precision float32)",
    ]
    assert f"(not the graph's own: {ours.prompts_per_step} prompts x" in planned_for(plan, llamarl)


def test_another_engine_or_sharding_is_another_graphs(llamarl):
    """What --engine / --sharding change is recorded in the plan and compared: the same nodes and models, another program."""
    from flowrl.graph.rewrite import with_sharding

    plan = plan_graph(with_sharding(llamarl, "fsdp"), "cpu:3", strategy="gen:d1@0 | policy:d2@1-2")
    assert plan.engines == {"gen": "builtin"} and plan.shardings == {"policy": "fsdp"}
    assert graph_differences(plan, with_sharding(llamarl, "fsdp")) == []
    assert graph_differences(plan, llamarl) == ["policy 'policy' was planned with sharding 'fsdp', but holds its state as 'replicate' here (--sharding)"]
    vllm = msgspec.structs.replace(plan, engines={"gen": "vllm"})  # as a plan of a graph whose generator is vLLM's records it
    assert graph_differences(vllm, with_sharding(llamarl, "fsdp")) == [
        "generator 'gen' was planned with the vllm engine, but runs the builtin engine here (--engine)"
    ]
