"""The critic node kind in graphs: the builder, JSON, the rules it keeps and the planner's role."""

from __future__ import annotations

import json
import re

import pytest

from flowrl.errors import ConfigError, GraphError
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import HFModelConfig, ModelConfig
from flowrl.graph.critic import CriticNode
from flowrl.graph.serialize import from_json, to_json

MODEL = ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=32)


def _ppo(*, objective: str = "ppo", list_critic: bool = True, **critic: object):
    b = GraphBuilder("ppo", model=MODEL)
    gen = b.generator("gen", b.source("prompts", task="copy", batch_size=2), n_samples=2, max_new_tokens=4)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    c = b.critic("critic", gen, lr=1e-3, **critic)
    policy = b.policy("policy", b.loss("loss", gen, reward, *([c] if list_critic else []), objective=objective), lr=1e-3)
    b.weights(policy, gen)
    return b


def test_a_ppo_graph_builds_prints_and_round_trips():
    graph = _ppo().build()
    critic = graph.node("critic")
    assert isinstance(critic, CriticNode) and critic.rewards == ("rewards",)  # the scorer declared before it
    assert critic.keeps_state() and critic.version_needed(3, 2) == 6
    text = str(graph)
    assert "critic = critic(model=1L32d, lr=0.001, value_clip=0.2, rewards=rewards) <- gen[" in text
    assert "loss = loss(ppo, eps=0.2, gamma=1, lam=0.95) <- critic[value_version,values] " in text
    assert str(from_json(to_json(graph))) == text


def test_the_builder_refuses_ppo_without_a_critic_and_a_critic_with_another_objective():
    b = GraphBuilder("x", model=MODEL)
    gen = b.generator("gen", b.source("prompts", task="copy"))
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    with pytest.raises(ConfigError, match=r"loss 'loss': objective='ppo' takes its advantages from a critic's values, and none is listed; declare one, critic = b.critic\('critic', 'gen'"):
        b.loss("loss", gen, reward, objective="ppo")
    critic = b.critic("critic", gen)
    with pytest.raises(ConfigError, match=r"objective='grpo' does not use a learned value, but critic 'critic' is listed; set objective='ppo'"):
        b.loss("loss", gen, reward, critic, objective="grpo")


def test_a_critic_that_no_loss_uses_is_refused_at_build():
    with pytest.raises(GraphError, match=r"critic 'critic' feeds 0 losses \[\]; its values serve exactly one loss with objective='ppo'"):
        _ppo(objective="grpo", list_critic=False).build()


def _graph_dict() -> dict:
    return json.loads(to_json(_ppo().build()))


def test_a_ppo_loss_without_a_critic_in_a_graph_file_is_refused():
    data = _graph_dict()
    data["nodes"] = [n for n in data["nodes"] if n["kind"] != "critic"]
    data["edges"] = [e for e in data["edges"] if "critic" not in (e["src"], e["dst"])]
    with pytest.raises(GraphError, match=r"loss 'loss' has objective='ppo'.*no critic feeds it; add one: critic = b.critic\('critic', 'gen'"):
        from_json(json.dumps(data))


def test_a_critic_reading_other_rewards_than_its_loss_is_refused():
    data = _graph_dict()
    for n in data["nodes"]:
        if n["kind"] == "loss":
            n["loss"]["reward_weights"] = {"rewards": 1.0, "env_rewards": 0.5}
    with pytest.raises(GraphError, match=r"critic 'critic' reads the reward fields \['rewards'\] but its loss 'loss' combines \['env_rewards', 'rewards'\]"):
        from_json(json.dumps(data))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(value_clip=0.0), r"critic 'critic': value_clip=0.0 must be > 0"),
        (dict(num_mini_batches=2), r"critic 'critic': num_mini_batches=2: a critic takes one mini-batch a pass"),
        (dict(lora=dict(r=4)), r"critic 'critic': lora= adapts a Hugging Face model"),
        (dict(learning_rate=1e-3), r"learning_rate"),
    ],
    ids=["value-clip", "mini-batches", "lora-builtin", "unknown-option"],
)
def test_bad_critic_options_are_refused(options, match):
    with pytest.raises(ConfigError, match=match):
        _ppo(**options)


def test_a_critic_without_a_reward_to_learn_is_refused():
    b = GraphBuilder("x", model=MODEL)
    gen = b.generator("gen", b.source("prompts", task="copy"))
    with pytest.raises(ConfigError, match=r"critic 'critic': no reward to learn the value of: declare the scorer first"):
        b.critic("critic", gen)


def test_a_hugging_face_critic_with_lora_builds():
    b = GraphBuilder("x", model=HFModelConfig(path="/models/x"))
    gen = b.generator("gen", b.source("prompts", task="copy"))
    b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    critic = b.critic("critic", gen, lora=dict(r=4, target_modules=["q_proj"]))
    assert critic.model.lora is not None and critic.model.lora.r == 4


def test_the_planner_prices_a_critic_as_training():
    from flowrl.examples import build_example
    from flowrl.planners.cluster import parse_cluster
    from flowrl.planners.estimate.common import Context
    from flowrl.planners.plan import plan_graph
    from flowrl.planners.search import resolve_roles
    from flowrl.planners.tuning import make_tuning
    from flowrl.planners.workload import default_workload

    graph = build_example("llamarl_ppo")
    ctx = Context(cluster=parse_cluster("cpu:2"), workload=default_workload(graph), tuning=make_tuning())
    roles = resolve_roles(graph, ctx)
    assert roles.trainers == ("critic", "policy") and "critic" not in roles.refs
    assert roles.recompute["critic"] and roles.iterations["critic"] == (1, 1)
    plan = plan_graph(graph, "cpu:1")  # one device each (a critic runs on one rank: flowrl.mesh_support), the same dims
    critic, policy = plan.placements["critic"], plan.placements["policy"]
    assert critic.dims == policy.dims
    # the same model and batch: the critic's forward + backward plus its own values pass (a forward
    # without gradients, 2 of the 6 flops per parameter and token) cost 4/3 of the policy's step, which
    # at one update per batch recomputes nothing (flowrl.graph.objectives.recomputes_logprobs)
    assert critic.time_s == pytest.approx(policy.time_s * 4 / 3, rel=0.05)
    assert critic.memory.optimizer > 0


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ("drop-critic", r"loss 'ppo' has objective='ppo'.*no critic feeds it"),
        ("lam", r"lam=1.5 must be in \[0, 1\]"),
        ("gamma", r"gamma=-0.5 must be in \[0, 1\]"),
    ],
)
def test_flowrl_run_refuses_a_bad_ppo_graph_file_before_any_work(tmp_path, capsys, edit, match):
    from flowrl.cli.main import main
    from flowrl.examples import build_example

    data = json.loads(to_json(build_example("llamarl_ppo")))
    if edit == "drop-critic":
        data["nodes"] = [n for n in data["nodes"] if n["kind"] != "critic"]
        data["edges"] = [e for e in data["edges"] if "critic" not in (e["src"], e["dst"])]
    for n in data["nodes"]:
        if n["kind"] == "loss" and edit != "drop-critic":
            n["loss"][edit] = 1.5 if edit == "lam" else -0.5
    path = tmp_path / "g.json"
    path.write_text(json.dumps(data))
    code = main(["run", str(path), "--steps", "1", "--metrics", str(tmp_path / "m.jsonl")])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err
    assert re.search(match, " ".join(err.split()))
    assert not (tmp_path / "m.jsonl").exists()  # refused before any step


def test_gae_settings_on_an_objective_without_gae_advantages_are_refused_by_name():
    """``gamma`` / ``lam`` discount a critic's GAE advantages: on a group-baseline objective they would
    be accepted and ignored, so off their defaults they are refused."""
    from flowrl.errors import ConfigError
    from flowrl.graph.configs import LossConfig

    with pytest.raises(ConfigError, match=r"\{'gamma': 0.9\} discount a critic's GAE advantages, which objective 'grpo' does not take"):
        LossConfig(objective="grpo", gamma=0.9)
    assert LossConfig(objective="ppo", gamma=0.9, lam=0.5).gamma == 0.9
