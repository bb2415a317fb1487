"""GAE, whitening, explained variance, PPO's clipped value loss and the "ppo" objective, against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import LossConfig
from flowrl.operators.critic import value_loss
from flowrl.operators.gae import explained_variance, gae, whiten
from flowrl.operators.losses import compute_loss, loss_advantages

U = torch.finfo(torch.float32).eps / 2  # float32's unit roundoff


def _gae_by_hand(reward: float, values: list[float], keep: list[bool], gamma: float, lam: float) -> list[float]:
    """GAE of one sample in float64 the textbook way: the masked tokens in order, reward at the last."""
    idx = [t for t, k in enumerate(keep) if k]
    v = [values[t] for t in idx] + [0.0]
    rewards = [0.0] * len(idx)
    if idx:
        rewards[-1] = reward
    adv, running = [0.0] * len(values), 0.0
    for j in range(len(idx) - 1, -1, -1):
        delta = rewards[j] + gamma * v[j + 1] - v[j]
        running = delta + gamma * lam * running
        adv[idx[j]] = running
    return adv


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (1.0, 0.95), (0.9, 0.0), (0.99, 0.5), (0.0, 1.0)])
def test_gae_matches_the_textbook_recursion(gamma, lam):
    g = torch.Generator().manual_seed(0)
    S, C = 5, 7
    values = torch.randn(S, C, generator=g)
    rewards = torch.rand(S, generator=g)
    lens = torch.tensor([7, 3, 1, 0, 5])
    mask = torch.arange(C)[None, :] < lens[:, None]
    mask[4, 2] = False  # a multi-turn sample: an environment token inside the completion is skipped
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    for i in range(S):
        want = _gae_by_hand(float(rewards[i]), values[i].tolist(), mask[i].tolist(), gamma, lam)
        # float32 recursion (the hand one is float64): each of the C steps does 4 roundings (delta = r +
        # gamma V' - V, A = delta + gamma lam A'), each at most u times the step's largest term
        terms = 3 * float(values[i].abs().max()) + float(rewards[i]) + max((abs(a) for a in want), default=0.0)
        assert adv[i].tolist() == pytest.approx(want, abs=4 * C * U * terms)
    assert torch.equal(ret, torch.where(mask, adv + values, 0.0))
    assert not adv[~mask].any() and not ret[~mask].any()


def test_gae_with_lambda_one_and_no_discount_returns_the_reward_everywhere():
    values = torch.tensor([[0.3, -0.2, 0.5, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    adv, ret = gae(torch.tensor([2.0]), values, mask, gamma=1.0, lam=1.0)
    assert ret[0].tolist() == pytest.approx([2.0, 2.0, 2.0, 0.0])
    assert adv[0].tolist() == pytest.approx([1.7, 2.2, 1.5, 0.0])


def test_gae_refuses_shapes_that_disagree():
    with pytest.raises(ConfigError, match=r"values \(2, 3\) and rewards \(2,\) must be"):
        gae(torch.zeros(2), torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool), gamma=1.0, lam=1.0)


def test_whiten_has_zero_mean_and_unit_std_on_the_mask():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    w = whiten(x, mask)
    kept, n = w[mask], int(mask.sum())
    # float32 sums of n terms: the mean's rounding (n u |x| / std) and the sum's (n u max |w|), each once
    scale = float(x[mask].abs().max()) / float(x[mask].std(unbiased=False)) + float(kept.abs().max())
    assert float(kept.mean()) == pytest.approx(0.0, abs=2 * n * U * scale)
    assert float(kept.pow(2).mean()) == pytest.approx(1.0, abs=4 * n * U * scale**2)
    assert not w[~mask].any()


def test_explained_variance_of_a_perfect_a_mean_and_a_useless_critic():
    g = torch.Generator().manual_seed(1)
    returns = torch.randn(4, 6, generator=g)
    mask = torch.ones(4, 6, dtype=torch.bool)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    n = int(mask.sum())  # two float32 variances over n terms: each relative error <= 2 n u
    assert explained_variance(torch.full_like(returns, float(returns.mean())), returns, mask) == pytest.approx(0.0, abs=4 * n * U)
    assert explained_variance(-returns, returns, mask) < -1
    assert explained_variance(returns, torch.ones_like(returns), mask) == 0.0  # returns that do not vary


def test_value_loss_takes_the_larger_of_the_clipped_and_unclipped_errors():
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0]])
    values = torch.tensor([[0.5, -0.5]], requires_grad=True)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, metrics = value_loss(values, old, returns, mask, clip=0.2)
    # token 0: V=0.5 moved past old+0.2 towards G: clipped 0.2 -> (0.8)^2 = 0.64 > 0.25; token 1: (1.5)^2 = 2.25 both ways
    assert float(loss.detach()) == pytest.approx(0.5 * (0.64 + 2.25) / 2)
    assert metrics["critic/clip_frac"] == pytest.approx(0.5)
    loss.backward()
    assert values.grad[0].tolist() == pytest.approx([0.0, 0.5 * 2 * -1.5 / 2])  # the clipped token gets no gradient
    unclipped, _ = value_loss(values.detach(), old, returns, mask, clip=None)
    assert float(unclipped) == pytest.approx(0.5 * (0.25 + 2.25) / 2)


def test_ppo_reads_token_advantages_from_the_values():
    g = torch.Generator().manual_seed(2)
    S, C = 4, 3
    mask = torch.ones(S, C, dtype=torch.bool)
    batch = {
        "behaviour_logprobs": -torch.rand(S, C, generator=g), "completion_mask": mask, "group_ids": torch.tensor([0, 0, 1, 1]),
        "rewards": torch.tensor([1.0, 0.0, 0.5, 0.2]), "values": torch.randn(S, C, generator=g),
    }  # fmt: skip
    config = LossConfig(objective="ppo", gamma=0.9, lam=0.8)
    adv = loss_advantages(config, batch["rewards"], batch)
    assert adv.shape == (S, C)
    raw, _ = gae(batch["rewards"], batch["values"], mask, gamma=0.9, lam=0.8)
    assert torch.allclose(adv, whiten(raw, mask))
    logprobs = batch["behaviour_logprobs"].clone().requires_grad_(True)
    loss, metrics = compute_loss(config, logprobs, batch)
    # ratio 1: the surrogate is A; two float32 means of S C terms, each off by <= S C u max |A|
    assert float(loss.detach()) == pytest.approx(-float(adv.mean()), abs=2 * S * C * U * float(adv.abs().max()))
    loss.backward()
    assert torch.allclose(logprobs.grad, -adv / (S * C))
    assert "ppo/clip_frac" in metrics
    with pytest.raises(ConfigError, match="needs a critic's 'values'"):
        loss_advantages(config, batch["rewards"], {k: v for k, v in batch.items() if k != "values"})


@pytest.mark.parametrize(("field", "value"), [("gamma", -0.1), ("gamma", 1.5), ("lam", -1.0), ("lam", 1.01), ("lam", math.nan)])
def test_gamma_and_lam_outside_zero_one_are_refused(field, value):
    with pytest.raises(ConfigError, match=rf"{field}=.* must (be in \[0, 1\]|be a finite number)"):
        LossConfig(objective="ppo", **{field: value})
