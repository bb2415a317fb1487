"""Defaults per model kind (``flowrl.graph.defaults``): what the builder fills in, what wins over it,
what ``print(graph)`` says, and that a graph file keeps the values it stored."""

from __future__ import annotations

from pathlib import Path

from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig, ModelConfig, OptimizerConfig, SamplingConfig
from flowrl.graph.defaults import KIND_DEFAULTS, model_kind
from flowrl.graph.ir import WeightEdge
from flowrl.graph.nodes import GeneratorNode, PolicyNode
from flowrl.graph.serialize import from_json, to_json

PRETRAINED = HFModelConfig(path="/models/qwen")
RANDOM = HFModelConfig(path="/models/qwen", init="random")
OLD_FILE = Path(__file__).parent / "golden" / "hf_pretrained_before_kind_defaults.json"


def _grpo(model, *, gen_options=None, policy_options=None, edge_options=None, critic=False):
    b = GraphBuilder("grpo", model=model)
    gen = b.generator("gen", b.source("prompts", task="copy", batch_size=2), n_samples=2, **(gen_options or {}))
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    inputs = [gen, reward]
    if critic:
        inputs.append(b.critic("critic", gen, reward))
    loss = b.loss("loss", *inputs, objective="ppo" if critic else "aipo")
    policy = b.policy("policy", loss, **(policy_options or {}))
    b.weights(policy, gen, **(edge_options or {}))
    return b.build()


def _values(graph):
    gen, policy = graph.node_of("gen", GeneratorNode), graph.node_of("policy", PolicyNode)
    return policy.optimizer.lr, gen.sampling.max_new_tokens, graph.weight_edges[0].max_staleness


def test_the_scratch_kinds_take_the_configs_own_defaults():
    """The built-in model and a randomly initialised HF model keep what the configs say, and
    ``print(graph)`` adds no line: nothing changed for them."""
    configs = (OptimizerConfig().lr, SamplingConfig().max_new_tokens, WeightEdge(src="a", dst="b").max_staleness)
    for model in (ModelConfig(), RANDOM):
        graph = _grpo(model)
        assert _values(graph) == configs
        assert graph.defaults == () and "defaults of" not in str(graph)


def test_a_pretrained_hf_model_starts_from_trls_defaults_and_print_names_them():
    graph = _grpo(PRETRAINED, critic=True)
    kind = KIND_DEFAULTS["hf-pretrained"]
    assert model_kind(PRETRAINED) == "hf-pretrained"
    assert _values(graph) == (1e-6, 256, 0) == (kind.lr, kind.max_new_tokens, kind.max_staleness)
    assert graph.node("critic").optimizer.lr == 1e-6
    last = str(graph).splitlines()[-1]
    assert last == (
        "  defaults of a pretrained Hugging Face model (init='pretrained'): gen.max_new_tokens=256, critic.lr=1e-06, "
        "policy.lr=1e-06, policy~>gen.max_staleness=0 (flowrl.graph.defaults)"
    )


def test_an_explicit_value_always_wins_and_is_not_named_a_default():
    """A keyword argument wins, even one equal to the toy default; so does a whole config."""
    graph = _grpo(PRETRAINED, gen_options={"max_new_tokens": 8}, policy_options={"lr": 1e-3}, edge_options={"max_staleness": 1})
    assert _values(graph) == (1e-3, 8, 1)
    assert graph.defaults == () and "defaults of" not in str(graph)
    whole = _grpo(PRETRAINED, gen_options={"sampling": SamplingConfig(n_samples=2)}, policy_options={"optimizer": OptimizerConfig()})
    assert _values(whole)[:2] == (OptimizerConfig().lr, SamplingConfig().max_new_tokens)
    assert [u.option for u in whole.defaults] == ["max_staleness"]  # the one value its caller left out


def test_an_edge_into_a_reference_keeps_the_edges_own_default():
    """k bounds what a generator samples with; a syncing reference takes the version its sync names,
    so its edge keeps ``WeightEdge``'s default and is not named."""
    b = GraphBuilder("kl", model=PRETRAINED)
    gen = b.generator("gen", b.source("prompts", task="copy", batch_size=2), n_samples=2, max_new_tokens=4)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    ref = b.reference("ref", gen, sync_steps=2)
    policy = b.policy("policy", b.loss("loss", gen, reward, ref, kl_coef=0.1), lr=1e-5)
    b.weights(policy, gen)
    b.weights(policy, ref)
    graph = b.build()
    assert [(e.dst, e.max_staleness) for e in graph.weight_edges] == [("gen", 0), ("ref", 1)]
    assert [(u.node, u.option) for u in graph.defaults] == [("policy~>gen", "max_staleness")]


def test_an_old_graph_file_keeps_the_numbers_it_stored():
    """A file the builder wrote before per-kind defaults (a pretrained HF model at lr 1e-3,
    max_new_tokens 8, k = 1) reads back with those numbers, names no default, and writes back the same graph."""
    text = OLD_FILE.read_text(encoding="utf-8")
    graph = from_json(text)
    assert _values(graph) == (1e-3, 8, 1)
    assert model_kind(graph.node("policy").model) == "hf-pretrained"
    assert graph.defaults == () and "defaults of" not in str(graph)
    assert from_json(to_json(graph)) == graph  # and writes back the same graph (new fields at their defaults)


def test_a_built_graph_round_trips_with_its_values():
    """The defaults the builder set are plain values in the file: read back, the same numbers, equal graphs."""
    graph = _grpo(PRETRAINED)
    again = from_json(to_json(graph))
    assert again == graph and _values(again) == (1e-6, 256, 0)



def test_the_guides_state_the_defaults_the_code_applies():
    """docs/trl.md's "Defaults" table and the line it shows agree with ``KIND_DEFAULTS`` and with
    what ``print(graph)`` writes."""
    import re

    text = (Path(__file__).parents[2] / "docs" / "trl.md").read_text(encoding="utf-8")
    pretrained, scratch = KIND_DEFAULTS["hf-pretrained"], KIND_DEFAULTS["builtin"]
    for option in ("lr", "max_new_tokens", "max_staleness"):
        row = re.search(rf"^\| `{option}` on [^|]*\| ([^|]+) \| ([^|]+) \|", text, re.MULTILINE)
        assert row, f"docs/trl.md's Defaults table has no row for {option}"
        assert (float(row[1]), float(row[2])) == (getattr(pretrained, option), getattr(scratch, option)), row[0]
    graph = _grpo(PRETRAINED)
    assert str(graph).splitlines()[-1] in text
