"""The kinds table (``flowrl.graph.kinds``) and each layer's table keyed by kind: every kind has every
part, and every part reads its table."""

from __future__ import annotations

import pytest

from flowrl.pictures import KIND_STYLES
from flowrl.graph.kinds import KINDS
from flowrl.graph.nodes import DEVICE_KINDS, NODE_KINDS, TRAINABLE_KINDS, WEIGHT_HOLDING_KINDS
from flowrl.graph.refs import resolve


def test_the_table_lists_every_kind_in_order():
    assert tuple(KINDS) == NODE_KINDS
    assert {k for k, spec in KINDS.items() if spec.runs_on == "devices"} == DEVICE_KINDS


@pytest.mark.parametrize("kind", NODE_KINDS)
def test_every_part_of_a_kind_exists(kind):
    spec = KINDS[kind]
    node = resolve(spec.node)
    assert node.__struct_config__.tag == kind, f"{spec.node} is not the node struct of kind {kind!r}"
    assert spec.span and KIND_STYLES[kind] is spec.style


def test_every_layer_table_has_every_kind():
    """The runtime's programs, the planner's roles and estimators: one entry per kind that needs one, and no other."""
    from flowrl.planners.kind_table import ESTIMATORS, PLAN_ROLES
    from flowrl.runtime.backends.torchrun.rank_programs import RANK_PROGRAMS
    from flowrl.runtime.programs.table import PROGRAMS

    on = {where: {k for k, s in KINDS.items() if s.runs_on == where} for where in ("devices", "cpu", "policy")}
    assert set(PROGRAMS) == on["devices"] | on["cpu"], "a kind that runs inside its policy has no program of its own; every other kind has one"
    assert set(PLAN_ROLES) == on["devices"], "a device kind has a planner role (flowrl.planners.roles); no other kind does"
    assert set(ESTIMATORS) == on["cpu"] | on["policy"], "a kind beside the devices or inside its policy has an estimator"
    assert set(RANK_PROGRAMS) <= on["devices"]
    assert all(callable(f) for table in (PROGRAMS, PLAN_ROLES, ESTIMATORS, RANK_PROGRAMS) for f in table.values())


@pytest.mark.parametrize("kind", [k for k in NODE_KINDS if KINDS[k].runs_on != "policy"])
def test_measured_and_predicted_spans_share_the_table_names(kind):
    from flowrl.planners.schedule import _WHAT
    from flowrl.runtime.control.controller import SPAN_NAMES

    assert SPAN_NAMES[kind] == _WHAT[kind] == KINDS[kind].span


def test_programs_are_built_through_the_table(monkeypatch):
    """A kind's program comes from its entry in the runtime's table: pointing the entry elsewhere changes what is built."""
    from flowrl.examples.llamarl import build_llamarl
    from flowrl.runtime.programs.table import PROGRAMS, build_program
    from flowrl.runtime.programs.nodes import ProgramEnv, SharedTransports

    monkeypatch.setitem(PROGRAMS, "scorer", _fake_program)
    graph = build_llamarl()
    program = build_program(graph, "reward", ProgramEnv(), SharedTransports(()))
    assert program == ("fake", "reward")


def _fake_program(node, graph, env, transports):
    return ("fake", node.name)


#: What both scripts below start with: ``flowrl/graph/kinds.py`` loaded before ``flowrl.graph``, so
#: the entry the script adds is there as if written in the file (the ``Node`` union graph files
#: decode into is built when ``flowrl.graph.nodes`` loads). The runtime's and the planner's tables
#: take their entries after it.
_LOAD_THE_TABLE = '''
import importlib.util, json, sys

spec = importlib.util.spec_from_file_location("flowrl.graph.kinds", "flowrl/graph/kinds.py")
kinds = importlib.util.module_from_spec(spec)
sys.modules["flowrl.graph.kinds"] = kinds
spec.loader.exec_module(kinds)
'''


def _run_with_entry(script: str) -> dict:
    """Run ``script`` (which adds one ``KINDS`` entry, then builds, plans and runs) in a fresh
    interpreter at the repository root; its last printed line, as JSON."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", _LOAD_THE_TABLE + script], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_ADD_A_KIND = '''
kinds.KINDS["length_bonus"] = kinds.KindSpec(
    node="tests.graph.kind_module:LengthBonusNode", runs_on="cpu", span="length_bonus", style=kinds.KINDS["scorer"].style,
)

from flowrl.planners.kind_table import ESTIMATORS
from flowrl.runtime.programs.table import PROGRAMS
from tests.graph.kind_module import build_length_bonus, estimate_length_bonus

PROGRAMS["length_bonus"] = build_length_bonus
ESTIMATORS["length_bonus"] = estimate_length_bonus

import flowrl
from flowrl.examples.llamarl import DEFAULT_MODEL
from flowrl.graph.builder import GraphBuilder
from flowrl.pictures import to_dot, to_mermaid
from flowrl.graph.serialize import from_json, to_json
from flowrl.planners.plan import plan_graph
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph
from tests.graph.kind_module import LengthBonusNode

b = GraphBuilder("bonus", model=DEFAULT_MODEL)
prompts = b.source("prompts", task="copy", batch_size=4)
gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=5)
reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
bonus = b.add(LengthBonusNode(name="bonus"), (gen,))
loss = b.loss("aipo", gen, reward, bonus, reward_weights={"rewards": 1.0, "reward_short": 0.1})
b.weights(b.policy("policy", loss), gen)
g = b.build()
plan = plan_graph(g, "cpu")
rows = run_graph(g, RunConfig(steps=2)).rows
print(json.dumps({
    "round_trip": from_json(to_json(g)) == g,
    "printed": str(g),
    "dot": to_dot(g),
    "mermaid": to_mermaid(g),
    "planned": {n: p.time_s for n, p in plan.placements.items()},
    "rewards": [r["reward/reward_short"] for r in rows],
}))
'''


def test_a_kind_is_one_module_and_one_entry():
    """``tests/graph/kind_module.py`` plus one entry in each table (the kinds, the runtime's programs, the
    planner's estimators): graph files, pictures, the planner and a run take it."""
    out = _run_with_entry(_ADD_A_KIND)
    assert out["round_trip"], "a graph with the new kind does not survive to_json/from_json"
    assert "bonus = length_bonus(max_len=5) <- gen[completion_lens]" in out["printed"]
    assert "max_len=5" in out["dot"] and "max_len=5" in out["mermaid"]
    assert out["planned"]["bonus"] == pytest.approx(4 * 4 * 1e-6), "the planner did not cost it with its estimator"
    assert len(out["rewards"]) == 2 and all(0.0 <= r <= 1.0 for r in out["rewards"])


def test_a_device_kind_is_placed_by_its_side(monkeypatch):
    """A device kind registered with its roles goes to its half of a ``halves`` split: placement code reads the table."""
    from types import SimpleNamespace

    import msgspec

    from flowrl.graph import kinds
    from flowrl.placement.default import default_placement

    monkeypatch.setitem(kinds.KINDS, "scorer_model", msgspec.structs.replace(KINDS["reference"], span="score model", side="trainer"))
    monkeypatch.setitem(kinds.KINDS, "drafter", msgspec.structs.replace(KINDS["reference"], span="draft", side="generator"))
    nodes = [("prompts", "source"), ("gen", "generator"), ("draft", "drafter"), ("critic", "scorer_model"), ("policy", "policy")]
    graph = SimpleNamespace(nodes=[SimpleNamespace(name=n, kind=k) for n, k in nodes])
    placement = default_placement(graph, 1, 4)
    assert {n: m.devices for n, m in placement.nodes.items()} == {"gen": (0, 1), "draft": (0, 1), "critic": (2, 3), "policy": (2, 3)}


def test_roles_are_table_fields():
    """Which kinds wait for weights, publish them and go on which side: read from the table, not kind names."""
    assert [k for k, s in KINDS.items() if s.waits_for_weights] == ["generator"]
    assert [k for k, s in KINDS.items() if s.publishes_weights] == ["policy"]
    assert {k for k, s in KINDS.items() if s.runs_on == "devices" and s.side == "trainer"} == {"policy", "reference", "reward_model", "critic", "teacher"}
    assert [k for k, s in KINDS.items() if s.trains] == ["critic"]
    assert all(s.side == "cpu" for s in KINDS.values() if s.runs_on == "cpu")
    assert TRAINABLE_KINDS == {"policy"} and WEIGHT_HOLDING_KINDS == {"generator", "reference", "policy"}


_ADD_A_DEVICE_KIND = '''
kinds.KINDS["likelihood"] = kinds.KindSpec(
    node="tests.graph.device_kind_module:LikelihoodNode", runs_on="devices", side="trainer", span="likelihood",
    style=kinds.KINDS["reference"].style,
)

from flowrl.planners.kind_table import PLAN_ROLES
from flowrl.runtime.programs.table import PROGRAMS
from tests.graph.device_kind_module import build_likelihood, likelihood_role

PROGRAMS["likelihood"] = build_likelihood
PLAN_ROLES["likelihood"] = likelihood_role

from flowrl.examples.llamarl import DEFAULT_MODEL
from flowrl.graph.builder import GraphBuilder
from flowrl.pictures import to_dot
from flowrl.graph.serialize import from_json, to_json
from flowrl.modelspec import model_preset
from flowrl.planners.cluster import parse_cluster
from flowrl.planners.estimate.common import Context
from flowrl.planners.plan import plan_graph
from flowrl.planners.report import format_plan
from flowrl.planners.search import resolve_roles
from flowrl.planners.tuning import make_tuning
from flowrl.planners.workload import default_workload
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph
from tests.graph.device_kind_module import LikelihoodNode

b = GraphBuilder("likelihood", model=DEFAULT_MODEL)
prompts = b.source("prompts", task="copy", batch_size=4)
gen = b.generator("gen", prompts, n_samples=4, max_new_tokens=5)
reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
lik = b.add(LikelihoodNode(name="lik", model=DEFAULT_MODEL), (gen,))
loss = b.loss("aipo", gen, reward, lik, reward_weights={"rewards": 1.0, "reward_likelihood": 0.1})
b.weights(b.policy("policy", loss), gen)
g = b.build()
ctx = Context(cluster=parse_cluster("cpu:2"), workload=default_workload(g), tuning=make_tuning())
roles = resolve_roles(g, ctx)
big = plan_graph(g, "64xH100", model=model_preset("llama3-8b"), strategy="disaggregated")
small = plan_graph(g, "cpu:2", strategy="disaggregated")
rows = run_graph(g, RunConfig(steps=2)).rows
print(json.dumps({
    "round_trip": from_json(to_json(g)) == g,
    "dot": to_dot(g),
    "roles": {"refs": roles.refs, "trainers": roles.trainers, "gens": roles.gens, "model": roles.models["lik"].name},
    "placed": {n: list(p.devices) for n, p in big.placements.items()},
    "lik": {"time_s": big.placements["lik"].time_s, "memory": big.placements["lik"].memory_bytes, "model": big.placements["lik"].model},
    "placement": str(small.placement()),
    "report": format_plan(big),
    "rewards": [r["reward/reward_likelihood"] for r in rows],
    "values": [r["likelihood/mean"] for r in rows],
}))
'''


def test_a_device_kind_is_one_module_and_one_entry():
    """``tests/graph/device_kind_module.py`` plus one entry in each table (the kinds, the runtime's
    programs, the planner's roles): a kind on devices of its own is
    placed on its side, costed by the planner's search with the role its module gives, reported and run."""
    import re

    out = _run_with_entry(_ADD_A_DEVICE_KIND)
    assert out["round_trip"] and "likelihood" in out["dot"]
    assert out["roles"] == {"refs": ["lik"], "trainers": ["policy"], "gens": ["gen"], "model": "2L64d"}
    placed = out["placed"]
    assert placed["lik"] and not set(placed["lik"]) & set(placed["gen"]), "it goes with the trainer's side, apart from the generator"
    assert out["lik"]["time_s"] > 0 and out["lik"]["memory"] > 0 and out["lik"]["model"] == "llama3-8b"
    assert re.search(r"^lik +likelihood +\d+ ", out["report"], re.M), out["report"]  # one device: a torchrun plan, its program runs on one rank
    assert re.search(r"lik:d1@\d", out["placement"]), "what the runtime executes of the plan places it"
    assert len(out["rewards"]) == 2 and all(r < 0 for r in out["values"]), "mean log-probs of completions are negative"


def _drafter_role(node, graph, ctx, model):
    from flowrl.modelspec import model_from_config
    from flowrl.planners.roles import NodeRole

    return NodeRole(model=model or model_from_config(node.model), dtype="bfloat16")


def test_a_generator_side_kind_is_costed_as_generation(monkeypatch):
    """The search costs a device kind by its table entry's side and its planner role, with no branch of its own:
    the reference of ``llamarl_ref`` re-registered as a generator-side kind is priced as generation."""
    import msgspec

    from flowrl.examples import build_example
    from flowrl.graph import kinds
    from flowrl.modelspec import model_preset
    from flowrl.planners.kind_table import PLAN_ROLES
    from flowrl.planners.plan import plan_graph

    monkeypatch.setitem(kinds.KINDS, "reference", msgspec.structs.replace(KINDS["reference"], side="generator"))
    monkeypatch.setitem(PLAN_ROLES, "reference", _drafter_role)
    plan = plan_graph(build_example("llamarl_ref"), "16xH100", model=model_preset("llama3-8b"), strategy="disaggregated")
    gen, ref, policy = (plan.placements[n] for n in ("gen", "ref", "policy"))
    assert {"builtin engine", "bfloat16 weights"} <= set(ref.notes), ref.notes  # estimate_generate's notes, its role's dtype
    assert set(ref.devices) & set(gen.devices) and not set(ref.devices) & set(policy.devices), "it went with the generators"


def test_a_device_kind_without_a_plan_role_is_refused_by_the_planner(monkeypatch):
    from flowrl.errors import PlanError
    from flowrl.examples import build_example
    from flowrl.planners.kind_table import PLAN_ROLES
    from flowrl.planners.plan import plan_graph

    monkeypatch.delitem(PLAN_ROLES, "reference")
    with pytest.raises(PlanError, match=r"node 'ref': kind 'reference' runs on devices but has no planner role; add its .* to flowrl.planners.kind_table.PLAN_ROLES"):
        plan_graph(build_example("llamarl_ref"), "cpu:2")


def test_node_is_every_kinds_struct_at_run_time_and_nodes_of_reads_one_kind_typed():
    """``Node`` is ``NodeBase`` to a type checker and the tagged union of the kinds table's structs at run
    time (what ``GraphSpec.nodes`` decodes into); ``nodes_of``/``node_of`` hand a kind's own struct out
    typed, which is how code reads a kind's fields without ``type: ignore``."""
    import typing

    from flowrl.examples import build_example
    from flowrl.graph.critic import CriticNode
    from flowrl.graph.nodes import GeneratorNode, Node, PolicyNode, SourceNode

    assert set(typing.get_args(Node)) == {resolve(spec.node) for spec in KINDS.values()}
    assert CriticNode in typing.get_args(Node)
    g = build_example("llamarl")
    assert g.nodes_of(PolicyNode) == g.nodes_of_kind("policy") and g.nodes_of(PolicyNode)
    source = g.nodes_of(SourceNode)[0]
    assert g.node_of(source.name, SourceNode) is g.node(source.name)
    with pytest.raises(TypeError, match=f"node '{source.name}' of graph .* is a source, not a generator"):
        g.node_of(source.name, GeneratorNode)
