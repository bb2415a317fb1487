"""The search's counts agree with the example it prints: the closest miss is one of the node meshes
counted as not fitting, so a plan never says "0 did not fit" and then shows one that did not."""

from __future__ import annotations

import re

import pytest

from flowrl.examples import build_example
from flowrl.examples.hf_copy import build_hf_copy
from flowrl.modelspec import model_preset
from flowrl.planners.plan import plan_graph
from flowrl.planners.report import format_plan

LORA = dict(r=8, alpha=16, target_modules=["q_proj", "v_proj"])


@pytest.mark.parametrize(
    ("graph", "cluster", "model", "strategy"),
    [
        (build_hf_copy(engine="vllm", lora=LORA), "8xH100", "qwen2.5-7b", "colocated"),  # printed "0 did not fit" with an example
        (build_hf_copy(engine="vllm", lora=LORA), "8xH100", "qwen2.5-7b", "search"),
        (build_example("llamarl"), "8xH100", "llama3-8b", "search"),
        (build_example("llamarl"), "cpu:2", None, "search"),
    ],
)
def test_the_count_and_the_example_agree(graph, cluster, model, strategy):
    plan = plan_graph(graph, cluster, model=model_preset(model) if model else None, strategy=strategy)
    stats = plan.search
    text = format_plan(plan)
    (line,) = [s for s in text.splitlines() if s.startswith("search: ")]
    counted = int(re.search(r"(\d+) node mesh(?:es)? *$", line).group(1))
    assert counted == stats.node_misses
    example = [s for s in text.splitlines() if "the closest miss" in s]
    assert bool(example) == bool(stats.closest_miss) == (counted > 0)
    if example:
        assert f"one of the {counted} node mesh" in example[0] and "over" in example[0]
    assert stats.infeasible == 0 or counted > 0  # a placement that did not fit had a node that did not
