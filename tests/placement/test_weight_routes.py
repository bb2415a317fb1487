"""The direct weight route's rule (``flowrl.placement.weight_routes``): which edges take it, and the torchrun
runtime's ``direct_channels`` naming exactly the edges the rule (and so the planner) sends direct."""

from __future__ import annotations

import pytest

from flowrl.examples.hf_copy import ASSETS
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig
from flowrl.placement.weight_routes import DIRECT, HOP, direct_edges, route_of
from tests.runtime.test_vllm_torchrun import vllm_fsdp_graph

APART = {"gen": (0,), "policy": (1, 2)}


def _graph(*, lora: bool = False, batching: str = "lockstep", in_flight: bool = False, engine: str = "vllm"):
    b = GraphBuilder("routes", model=HFModelConfig(path=str(ASSETS), init="random", seed=0))
    prompts = b.source("prompts", data=str(ASSETS / "prompts.jsonl"), prompt_field="prompt", batch_size=2)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=4, engine=engine, batching=batching)
    score = b.scorer("reward", gen, fn="flowrl.examples.hf_copy:reward", inputs="text")
    aipo = b.loss("aipo", gen, score, objective="aipo", rho=4.0)
    policy = b.policy("policy", aipo, lr=1e-5, **({"lora": dict(r=4, alpha=8, target_modules=["q_proj", "v_proj"])} if lora else {}))
    b.weights(policy, gen, in_flight=in_flight)
    return b.build()


CASES = [
    (lambda: vllm_fsdp_graph(str(ASSETS)), APART, {}, True),
    (lambda: vllm_fsdp_graph(str(ASSETS)), {"gen": (0,), "policy": (0, 1)}, {}, False),  # colocated
    (lambda: vllm_fsdp_graph(str(ASSETS)), APART, {"gen": "tests.somewhere:program"}, False),  # a user program
    (lambda: vllm_fsdp_graph(str(ASSETS), transport="collective"), APART, {}, False),  # a named transport: the hop
    (lambda: vllm_fsdp_graph(str(ASSETS), sharding="replicate"), APART, {}, True),
    (lambda: _graph(), APART, {}, True),
    (lambda: _graph(lora=True), APART, {}, False),
    (lambda: _graph(batching="continuous"), APART, {}, False),
    (lambda: _graph(batching="continuous", in_flight=True), APART, {}, False),
    (lambda: _graph(engine="builtin"), APART, {}, False),  # no hop to skip
    (lambda: vllm_fsdp_graph(str(ASSETS)), {"gen": (0, 1), "policy": (2, 3)}, {}, True),  # two engines (replicas or vLLM tp=2)
    (lambda: vllm_fsdp_graph(str(ASSETS)), {"gen": (0, 1), "policy": (1, 2)}, {}, False),  # one rank shared
    (lambda: vllm_fsdp_graph(str(ASSETS)), {"policy": (1, 2)}, {}, False),  # the generator unplaced
]
IDS = ["fsdp-apart", "colocated", "program", "collective", "replicated", "apart", "lora", "continuous", "in-flight", "builtin",
       "two-generator-ranks", "one-rank-shared", "generator-unplaced"]


@pytest.mark.parametrize("build, ranks, programs, direct", CASES, ids=IDS)
def test_the_rule_decides_each_edges_route(build, ranks, programs, direct):
    g = build()
    (edge,) = g.weight_edges
    assert route_of(g, edge, ranks, programs) == (DIRECT if direct else HOP)
    assert direct_edges(g, ranks, programs) == ({("policy", "gen")} if direct else set())


@pytest.mark.parametrize("build, ranks, programs, direct", CASES, ids=IDS)
def test_the_runtime_opens_exactly_the_edges_the_rule_sends_direct(build, ranks, programs, direct):
    """``direct_channels`` (what a torchrun job opens) agrees with ``direct_edges`` (what the planner prices)."""
    from flowrl.runtime.weights.direct_route import direct_channels

    g = build()
    assert direct_channels(g, ranks, programs) == {f"{s}->{d}" for s, d in direct_edges(g, ranks, programs)}


def test_the_rule_reads_the_planners_device_ranges_as_ranks():
    g = _graph()
    assert direct_edges(g, {"gen": range(0, 1), "policy": range(1, 3)}) == {("policy", "gen")}
    assert direct_edges(g, {"gen": range(0, 1), "policy": range(0, 3)}) == set()
    assert direct_edges(g, {"gen": range(4, 5), "policy": range(0, 4)}) == {("policy", "gen")}
    assert direct_edges(g, {"gen": range(4, 8), "policy": range(0, 4)}) == {("policy", "gen")}
    assert direct_edges(g, {"gen": range(3, 8), "policy": range(0, 4)}) == set()
