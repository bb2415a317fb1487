"""Losses: hand-computed cases, AIPO's gradient against its formula, truncation from above only, masks."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flowrl.errors import ConfigError
from flowrl.graph.configs import LossConfig
from flowrl.operators.losses import (
    LOSSES,
    advantages,
    aipo_loss,
    compute_loss,
    kl_penalty,
    masked_mean,
    pg_loss,
    ppo_clip_loss,
)

L = math.log


@pytest.mark.parametrize(
    ("baseline", "normalize_std", "want"),
    [
        ("group_mean", False, [0.5, -0.5, 1.0, -0.5, -0.5, 0.0]),
        ("leave_one_out", False, [1.0, -1.0, 1.5, -0.75, -0.75, 0.0]),
        ("group_mean", True, [1.0, -1.0, 2 ** 0.5, -(0.5 ** 0.5), -(0.5 ** 0.5), 0.0]),
    ],
    ids=["group-mean", "leave-one-out", "std-normalised"],
)
def test_advantages_by_hand(baseline, normalize_std, want):
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5, 0.5, 3.0])
    groups = torch.tensor([7, 7, 3, 3, 3, 9])  # any ids; 9 is a group of one
    got = advantages(rewards, groups, baseline=baseline, normalize_std=normalize_std)
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-5, atol=1e-5)


def test_unknown_baseline_is_refused():
    with pytest.raises(ConfigError, match="unknown advantage baseline 'median'"):
        advantages(torch.zeros(2), torch.zeros(2, dtype=torch.long), baseline="median")


# Two samples, two positions; the last token of sample 1 is padding.
LOGP = torch.tensor([[L(0.5), L(0.25)], [L(0.8), 0.0]])
MU = torch.tensor([[L(0.25), L(0.25)], [L(0.1), 0.0]])
ADV = torch.tensor([1.0, -2.0])
MASK = torch.tensor([[True, True], [True, False]])


def test_aipo_by_hand():
    loss, m = aipo_loss(LOGP, MU, ADV, MASK, rho=4.0)
    # ratios 2, 1, 8 -> weights 2, 1, 4 (8 is truncated to rho)
    want = -(2 * 1 * L(0.5) + 1 * 1 * L(0.25) + 4 * -2 * L(0.8)) / 3
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert m["aipo/ratio_mean"] == pytest.approx(11 / 3, rel=1e-6)
    assert m["aipo/ratio_max"] == pytest.approx(8.0, rel=1e-6)
    assert m["aipo/truncated_frac"] == pytest.approx(1 / 3)
    kl = ((2 - 1 - L(2)) + 0 + (8 - 1 - L(8))) / 3
    assert m["aipo/kl"] == pytest.approx(kl, rel=1e-5)
    assert m["aipo/tokens"] == 3 and m["loss/policy"] == pytest.approx(want, rel=1e-6)


def test_aipo_gradient_equals_the_formula():
    """Autograd through log_softmax equals  -sum_t min(ratio, rho) * A * grad log pi / N, computed by hand."""
    gen = torch.Generator().manual_seed(0)
    S, C, V, rho = 4, 3, 5, 2.0
    logits = torch.randn(S, C, V, generator=gen, requires_grad=True)
    tokens = torch.randint(0, V, (S, C), generator=gen)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    mu = torch.log_softmax(torch.randn(S, C, V, generator=gen) * 2, -1).gather(-1, tokens[..., None]).squeeze(-1)
    adv = torch.tensor([1.0, -0.5, 2.0, -2.5])
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    loss, m = aipo_loss(logp, mu, adv, mask, rho=rho)
    loss.backward()
    with torch.no_grad():
        probs = torch.softmax(logits, -1)
        onehot = torch.nn.functional.one_hot(tokens, V).float()
        grad_log_pi = onehot - probs  # d log pi(y_t) / d logits
        weight = torch.minimum((logp - mu).exp(), torch.tensor(rho))
        want = -(weight * adv[:, None] * mask)[..., None] * grad_log_pi / mask.sum()
    torch.testing.assert_close(logits.grad, want, rtol=1e-5, atol=1e-7)
    assert 0 < m["aipo/truncated_frac"] < 1  # the case exercises both branches


def test_on_policy_aipo_is_reinforce_with_the_group_baseline():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25])
    groups = torch.tensor([0, 0, 1, 1])
    adv = advantages(rewards, groups, baseline="group_mean", normalize_std=False)
    logp = torch.log(torch.rand(4, 3, generator=torch.Generator().manual_seed(1)).clamp(0.05)).requires_grad_()
    mask = torch.ones(4, 3, dtype=torch.bool)
    loss, m = aipo_loss(logp, logp.detach(), adv, mask, rho=4.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, -(rewards - torch.tensor([0.5, 0.5, 0.375, 0.375]))[:, None].expand(4, 3) / 12)
    assert m["aipo/ratio_mean"] == 1.0 and m["aipo/truncated_frac"] == 0.0 and m["aipo/kl"] == 0.0


@given(
    st.lists(st.floats(-12, 0), min_size=6, max_size=6),
    st.lists(st.floats(-12, 0), min_size=6, max_size=6),
    st.floats(1.0, 10.0),
)
def test_truncation_only_caps_from_above(logp_values, mu_values, rho):
    logp = torch.tensor(logp_values, dtype=torch.float64).view(2, 3).requires_grad_()
    mu = torch.tensor(mu_values, dtype=torch.float64).view(2, 3)
    adv = torch.tensor([1.0, 1.0], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, _ = aipo_loss(logp, mu, adv, mask, rho=rho)
    loss.backward()
    weight = -logp.grad * 6  # the constant weight each token's log pi is multiplied by
    ratio = (logp.detach() - mu).exp()
    assert (weight <= rho + 1e-9).all()
    small = ratio < rho
    torch.testing.assert_close(weight[small], ratio[small])  # never raised, never clipped from below


def test_masked_tokens_contribute_nothing():
    loss, m = aipo_loss(LOGP, MU, ADV, MASK, rho=4.0)
    junk_logp = LOGP.clone().requires_grad_()
    junk_mu = MU.clone()
    junk_mu[1, 1] = float("-inf")
    with torch.no_grad():
        junk_logp[1, 1] = float("inf")
    loss2, m2 = aipo_loss(junk_logp, junk_mu, ADV, MASK, rho=4.0)
    assert float(loss2.detach()) == pytest.approx(float(loss)) and m2 == pytest.approx(m)
    loss2.backward()
    assert junk_logp.grad[1, 1] == 0 and torch.isfinite(junk_logp.grad).all()


@pytest.mark.parametrize("fn", [aipo_loss, pg_loss, ppo_clip_loss], ids=["aipo", "pg", "ppo-clip"])
def test_an_empty_mask_gives_zero_not_nan(fn):
    kw = {"clip_eps": 0.2} if fn is ppo_clip_loss else {"rho": 4.0}
    logp = LOGP.clone().requires_grad_()
    loss, metrics = fn(logp, MU, ADV, torch.zeros(2, 2, dtype=torch.bool), **kw)
    loss.backward()
    assert float(loss.detach()) == 0.0 and all(math.isfinite(v) for v in metrics.values())
    assert (logp.grad == 0).all()
    assert float(masked_mean(torch.ones(3), torch.zeros(3, dtype=torch.bool))) == 0.0


def test_pg_by_hand_ignores_mu_but_reports_the_mismatch():
    loss, m = pg_loss(LOGP, MU, ADV, MASK, rho=4.0)
    want = -(1 * L(0.5) + 1 * L(0.25) + -2 * L(0.8)) / 3  # every weight is 1, whatever mu says
    assert float(loss) == pytest.approx(want, rel=1e-6)
    assert m["pg/ratio_mean"] == pytest.approx(11 / 3, rel=1e-6) and m["pg/ratio_max"] == pytest.approx(8.0, rel=1e-6)
    assert m["pg/truncated_frac"] == pytest.approx(1 / 3)  # the token AIPO with rho = 4 would truncate
    other_mu, _ = pg_loss(LOGP, torch.zeros_like(MU), ADV, MASK, rho=4.0)
    assert float(other_mu) == float(loss)


def test_pg_gradient_is_reinforce_with_the_advantages():
    logp = LOGP.clone().requires_grad_()
    loss, _ = pg_loss(logp, MU, ADV, MASK, rho=4.0)
    loss.backward()
    torch.testing.assert_close(logp.grad, -(ADV[:, None] * MASK) / 3)


def test_ppo_clip_by_hand():
    logp = LOGP.clone().requires_grad_()
    loss, m = ppo_clip_loss(logp, MU, ADV, MASK, clip_eps=0.2)
    # ratios 2 (A=1 -> clipped to 1.2), 1 (A=1 -> 1), 8 (A=-2 -> min(-16, -2.4) = -16, unclipped)
    assert float(loss.detach()) == pytest.approx(-(1.2 + 1.0 - 16.0) / 3, rel=1e-6)
    assert m["ppo/clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    # Clipped tokens get no gradient; the unclipped negative one gets -A * ratio / N.
    assert logp.grad[0, 0] == 0 and float(logp.grad[1, 0]) == pytest.approx(2 * 8 / 3, rel=1e-5)


def test_kl_penalty_is_zero_at_the_reference_and_positive_elsewhere():
    zero, m = kl_penalty(LOGP, LOGP, MASK)
    assert float(zero) == 0.0 and m["loss/kl_ref"] == 0.0
    positive, _ = kl_penalty(LOGP, MU, MASK)
    assert float(positive) > 0


def batch(**extra):
    return {"behaviour_logprobs": MU, "completion_mask": MASK, "group_ids": torch.tensor([0, 0]), **extra}


def test_compute_loss_weighs_the_reward_fields():
    config = LossConfig(reward_weights={"a": 1.0, "b": 0.5})
    loss, m = compute_loss(config, LOGP, batch(a=torch.tensor([1.0, 0.0]), b=torch.tensor([0.0, 4.0])))
    # rewards 1*1 + 0.5*0 = 1 and 1*0 + 0.5*4 = 2 -> advantages -0.5, 0.5; weights 2, 1, 4 (as in test_aipo_by_hand)
    want = -(2 * -0.5 * L(0.5) + 1 * -0.5 * L(0.25) + 4 * 0.5 * L(0.8)) / 3
    assert float(loss) == pytest.approx(want, rel=1e-6) and m["loss/total"] == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("objective", sorted(LOSSES))
def test_every_objective_runs(objective):
    critic = {"values": torch.zeros_like(LOGP)} if objective == "ppo" else {}  # "ppo" reads a critic's values
    teacher = {"teacher_logprobs": MU} if objective == "opd" else {}  # "opd" reads a teacher's log-probs
    loss, m = compute_loss(LossConfig(objective=objective), LOGP, batch(rewards=torch.tensor([1.0, 0.0]), **critic, **teacher))
    assert math.isfinite(float(loss)) and "loss/policy" in m


def test_the_kl_term_needs_reference_logprobs():
    config = LossConfig(kl_coef=0.1)
    with pytest.raises(ConfigError, match="no 'ref_logprobs'"):
        compute_loss(config, LOGP, batch(rewards=torch.tensor([1.0, 0.0])))
    loss, m = compute_loss(config, LOGP, batch(rewards=torch.tensor([1.0, 0.0]), ref_logprobs=MU))
    plain, _ = compute_loss(LossConfig(), LOGP, batch(rewards=torch.tensor([1.0, 0.0])))
    penalty, _ = kl_penalty(LOGP, MU, MASK)
    assert float(loss) == pytest.approx(float(plain) + 0.1 * float(penalty), rel=1e-6)
    assert m["loss/kl_ref"] > 0


@pytest.mark.parametrize(
    ("config", "fields", "match"),
    [
        (LossConfig(objective="dpo"), {"rewards": torch.zeros(2)}, "unknown loss objective 'dpo': known objectives are aipo, cispo, decoupled_ppo, dppo, grpo, gspo, mis, opd, pg, ppo, ppo_clip, sapo, tis"),
        (LossConfig(), {"score": torch.zeros(2)}, "reward field 'rewards'"),
    ],
    ids=["unknown-objective", "missing-reward"],
)
def test_configuration_errors_are_clear(config, fields, match):
    with pytest.raises(ConfigError, match=match):
        compute_loss(config, LOGP, batch(**fields))


def test_a_global_normalizer_makes_micro_batches_add_up():
    full, _ = aipo_loss(LOGP, MU, ADV, MASK, rho=4.0)
    parts = [aipo_loss(LOGP[i : i + 1], MU[i : i + 1], ADV[i : i + 1], MASK[i : i + 1], rho=4.0, normalizer=3)[0] for i in range(2)]
    assert float(sum(parts)) == pytest.approx(float(full), rel=1e-6)


def test_aipo_weighs_each_token_by_the_mu_that_drew_it():
    """An in-flight sample: its first token drawn by weights version 3 (mu 0.1), its second by version 4 (mu 0.4).

    pi gives both tokens 0.5, so the per-token ratios are 5 (capped at rho = 4) and 1.25; a per-sample
    ratio (the product 6.25, or the first token's 5 for both) would weigh them otherwise.
    """
    logp = torch.tensor([[L(0.5), L(0.5)], [L(0.5), 0.0]], requires_grad=True)
    rollout = {
        "behaviour_logprobs": torch.tensor([[L(0.1), L(0.4)], [L(0.5), 0.0]]),
        "token_versions": torch.tensor([[3, 4], [4, 4]]),
        "completion_mask": torch.tensor([[True, True], [True, False]]),
        "group_ids": torch.tensor([0, 0]),
        "rewards": torch.tensor([1.0, 0.0]),
    }
    config = LossConfig(objective="aipo", rho=4.0, baseline="group_mean", normalize_std=False)
    loss, m = compute_loss(config, logp, rollout)  # advantages +0.5, -0.5
    loss.backward()
    want_weight = torch.tensor([[4.0, 1.25], [1.0, 0.0]])  # min(pi / mu, rho) per token
    torch.testing.assert_close(logp.grad, -want_weight * torch.tensor([[0.5], [-0.5]]) / 3)
    assert m["aipo/ratio_mean"] == pytest.approx((5 + 1.25 + 1) / 3, rel=1e-6)
    assert m["aipo/truncated_frac"] == pytest.approx(1 / 3) and m["aipo/ratio_max"] == pytest.approx(5.0, rel=1e-6)
    want_loss = -(4.0 * 0.5 * L(0.5) + 1.25 * 0.5 * L(0.5) + 1.0 * -0.5 * L(0.5)) / 3
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-6)
