"""A short learning run: the operators in a plain loop learn to copy two digits far above chance in seconds."""

from __future__ import annotations

import pytest
import torch

from flowrl.graph.configs import ModelConfig
from flowrl.operators.generation import Generator
from flowrl.operators.scoring import Scorer
from flowrl.operators.source import PromptSource
from flowrl.operators.trainer import Trainer

from tests.tolerances import ratio_atol, rollout_logprob_atol

from .helpers import loss_node, scorer_node, source_node, tiny_generator_node, tiny_policy_node

MODEL = ModelConfig(vocab_size=16, dim=64, n_layers=2, n_heads=4, n_kv_heads=4, max_seq_len=16)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same arithmetic, hence the same run, on any machine
    yield
    torch.set_num_threads(threads)


def test_reward_rises_well_above_chance(one_thread):
    source = PromptSource(source_node("tests.operators.userfns:task_factory", batch_size=8))  # copy 2 digits
    generator = Generator(tiny_generator_node(MODEL, n_samples=16, max_new_tokens=4), seed=0)
    scorer = Scorer(scorer_node())
    trainer = Trainer(tiny_policy_node(MODEL, lr=3e-3), loss_node(normalize_std=True))
    rewards = []
    for _ in range(80):
        rollout = generator.generate(source.next_batch())
        tol = ratio_atol(rollout_logprob_atol(trainer.model, rollout))  # float32 rounding of mu and pi
        metrics = trainer.train_step({**rollout, **scorer.score(rollout)})
        generator.load_weights(trainer.weights(), trainer.version)
        rewards.append(metrics["reward_mean"])
        assert metrics["staleness"] == 0 and metrics["aipo/ratio_mean"] == pytest.approx(1.0, abs=tol)
    chance = 1 / 16  # a uniform policy over 16 tokens gets each position right with p = 1/16
    assert sum(rewards[:5]) / 5 < 2 * chance
    assert sum(rewards[-10:]) / 10 > 5 * chance, rewards
