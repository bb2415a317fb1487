"""A critic in real graph runs: its metrics and versions in the rows, exact checkpoints, the Hugging Face
critic, and (slow) a value that is learnt while PPO trains.

A resumed run repeats an uninterrupted one bit for bit (k = 0, one seed): the generator samples from
seeds of (run seed, step), the critic and the policy resume their exact state, so the critic's
checkpoint at the end of both runs must be equal tensor for tensor, with no tolerance.
"""

from __future__ import annotations

import pytest
import torch

from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import ModelConfig
from flowrl.runtime.config import RunConfig
from flowrl.runtime.run import run_graph

MODEL = ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=2, max_seq_len=32)


def _graph(*, k: int = 0, iterations: int = 1, **loss):
    b = GraphBuilder("ppo", model=MODEL)
    gen = b.generator("gen", b.source("prompts", task="copy", batch_size=2), n_samples=4, max_new_tokens=4)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    critic = b.critic("critic", gen, reward, lr=1e-2, num_iterations=iterations)
    policy = b.policy("policy", b.loss("loss", gen, reward, critic, objective="ppo", **loss), lr=1e-2)
    b.weights(policy, gen, max_staleness=k)
    return b.build()


CRITIC_KEYS = ("critic/value_loss", "critic/explained_variance", "critic/clip_frac", "critic/grad_norm", "critic/lr",
               "critic/value_mean", "critic/return_mean", "critic/version")  # fmt: skip


@pytest.mark.parametrize(
    ("k", "iterations", "backend"),
    [(1, 1, "local"), (1, 2, "local"), pytest.param(1, 1, "process", marks=pytest.mark.slow)],
    ids=["k1", "k1-two-updates", "process"],
)
def test_rows_carry_the_critic_and_the_version_that_computed_its_values(k, iterations, backend):
    rows = run_graph(_graph(k=k, iterations=iterations), RunConfig(steps=4, backend=backend)).rows
    for row in rows:
        assert all(key in row for key in CRITIC_KEYS), sorted(row)
        assert row["critic/version"] == iterations * (row["step"] - 1)  # batch s's values by critic version U_c * s
        assert 0 <= row["staleness"] <= k
        assert "ppo/clip_frac" in row
    assert rows[0]["critic/value_mean"] == 0.0  # the zero-initialised head
    assert rows[-1]["critic/value_mean"] != 0.0  # and it trains


def test_a_checkpoint_holds_and_resumes_the_critic_exactly(tmp_path):
    graph = _graph()  # k = 0: the rollouts do not depend on timing
    whole = run_graph(graph, RunConfig(steps=3, checkpoint_dir=str(tmp_path / "a"), checkpoint_every=1))
    run_graph(graph, RunConfig(steps=1, checkpoint_dir=str(tmp_path / "b"), checkpoint_every=1))
    resumed = run_graph(graph, RunConfig(steps=3, checkpoint_dir=str(tmp_path / "b"), checkpoint_every=1, resume=True))
    assert [r["step"] for r in resumed.rows] == [2, 3]
    for step in (1, 2):  # the critic of the checkpoint after step s trained on batches 0 .. s-1, no more
        assert torch.load(tmp_path / "a" / f"step-{step:08d}" / "critic-critic.pt", weights_only=True)["version"] == step
    a = torch.load(tmp_path / "a" / "step-00000003" / "critic-critic.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "step-00000003" / "critic-critic.pt", weights_only=True)
    assert a["version"] == b["version"] == 3
    assert sorted(a["weights"]) == sorted(b["weights"]) and "output.weight" in a["weights"]
    for name in a["weights"]:
        assert torch.equal(a["weights"][name], b["weights"][name]), name
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values(), strict=True):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
    for key in CRITIC_KEYS:
        assert [r[key] for r in resumed.rows] == [r[key] for r in whole.rows[1:]], key


def test_the_hugging_face_example_trains_with_a_critic():
    from flowrl.examples import build_example

    rows = run_graph(build_example("hf_copy_ppo"), RunConfig(steps=2)).rows
    assert [r["critic/version"] for r in rows] == [0.0, 1.0]
    assert rows[-1]["critic/grad_norm"] > 0


@pytest.mark.slow
def test_the_critic_learns_the_value_while_ppo_trains():
    """On the default example the copy reward is learnable from the prompt and the prefix: the critic's
    explained variance, near 0 at the start, rises well above it as the policy improves."""
    from flowrl.examples import build_example

    rows = run_graph(build_example("llamarl_ppo"), RunConfig(steps=150, seed=0)).rows
    ev = [r["critic/explained_variance"] for r in rows]
    first, last = sum(ev[:20]) / 20, sum(ev[-50:]) / 50
    assert first < 0.05 and last > 0.2, (first, last)  # benches/critic.py: ~0 at first, 0.2-0.45 over steps 100-150
    reward = [r["reward_mean"] for r in rows]
    assert sum(reward[-20:]) / 20 > sum(reward[:20]) / 20 + 0.2


def test_a_ppo_batch_trains_on_the_values_of_the_critic_version_its_row_names(monkeypatch):
    """The "ppo" row reads a critic's values: the values in each batch the policy trains on are, bit
    for bit, those the critic's weights at the version its row names (``critic/version``, the batch's
    ``value_version``) compute for that batch's rows; with ``correction="icepop"`` its rows report what
    the correction masked."""
    from flowrl.operators.critic import Critic
    from flowrl.operators.trainer import Trainer

    snapshots: dict[int, dict[str, torch.Tensor]] = {}  # critic version -> its weights
    trained: list[dict[str, torch.Tensor]] = []  # the batches the policy trained on
    critic_train, policy_train = Critic.train_step, Trainer.train_step

    def snapshot(self, batch):
        snapshots[self.version] = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return critic_train(self, batch)

    def record(self, batch):
        trained.append({k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})
        return policy_train(self, batch)

    monkeypatch.setattr(Critic, "train_step", snapshot)
    monkeypatch.setattr(Trainer, "train_step", record)
    graph = _graph(k=1, iterations=2, correction="icepop")  # a correction on PPO with a critic: its rows say what it masked
    rows = run_graph(graph, RunConfig(steps=3)).rows
    assert [int(b["value_version"]) for b in trained] == [int(r["critic/version"]) for r in rows] == [0, 2, 4]
    for r in rows:  # a sequence is touched exactly when one of its tokens is
        assert 0 <= r["correction/token_frac"] <= 1 and (r["correction/token_frac"] > 0) == (r["correction/seq_frac"] > 0)
        assert r["correction/weight_max"] > 0
    fresh = Critic(graph.node("critic"), graph.node("loss").loss)
    for batch in trained:
        fresh.model.load_state_dict(snapshots[int(batch["value_version"])])
        assert torch.equal(fresh.values(batch), batch["values"])
    # not vacuous: another version's weights give other values for the same rows
    fresh.model.load_state_dict(snapshots[0])
    assert not torch.equal(fresh.values(trained[-1]), trained[-1]["values"])
