"""The loss menu of issue 25: aggregation (loss_agg), asymmetric clipping, GSPO, CISPO, truncated and masked IS.

Every expected value is worked out by hand in the test (ratios chosen to be exact), or comes from an
independent float64 implementation of the paper's formula.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import LossConfig
from flowrl.operators.losses import LOSSES, aggregate, batch_normalizer, compute_loss, gspo_loss
from flowrl.operators.shaping import loss_normalizer

L = math.log

# Two samples, two positions; the last token of sample 1 is padding. Ratios pi/mu: 2, 1 | 8.
LOGP = [[L(0.5), L(0.25)], [L(0.8), 0.0]]
MU = torch.tensor([[L(0.25), L(0.25)], [L(0.1), 0.0]])
ADV = torch.tensor([1.0, -2.0])
MASK = torch.tensor([[True, True], [True, False]])


def batch(mu=MU, mask=MASK, **fields):
    return {"behaviour_logprobs": mu, "completion_mask": mask, "group_ids": torch.arange(mask.shape[0]), **fields}


def loss_and_grad(config: LossConfig, logp, mu=MU, adv=ADV, mask=MASK, fields=None, **kw):
    x = torch.tensor(logp, requires_grad=True)
    loss, metrics = compute_loss(config, x, batch(mu, mask, **(fields or {})), advantages=adv, **kw)
    loss.backward()
    return float(loss.detach()), x.grad, metrics


# --- 1. aggregation --------------------------------------------------------------------------------

# pg's terms A * log pi: a = ln .5, b = ln .25 (sample 0, A = 1), c = -2 ln .8 (sample 1, one token)
A_, B_, C_ = L(0.5), L(0.25), -2 * L(0.8)


@pytest.mark.parametrize(
    ("agg", "want_loss", "want_grad"),
    [
        ("token_mean", -(A_ + B_ + C_) / 3, [[-1 / 3, -1 / 3], [2 / 3, 0.0]]),  # 3 real tokens
        ("seq_mean", -((A_ + B_) / 2 + C_ / 1) / 2, [[-1 / 4, -1 / 4], [2 / 2, 0.0]]),  # per-sequence means, 2 sequences
        ("dr_grpo", -(A_ + B_ + C_) / (2 * 2), [[-1 / 4, -1 / 4], [2 / 4, 0.0]]),  # 2 sequences * width 2
    ],
    ids=["token_mean", "seq_mean", "dr_grpo"],
)
def test_each_aggregation_by_hand(agg, want_loss, want_grad):
    loss, grad, _ = loss_and_grad(LossConfig(objective="pg", loss_agg=agg), LOGP)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    torch.testing.assert_close(grad, torch.tensor(want_grad))


def test_batch_normalizer_counts_tokens_sequences_or_the_padded_area():
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    assert batch_normalizer(mask, "token_mean") == 3.0
    assert batch_normalizer(mask, "seq_mean") == 3.0  # an empty sequence still counts, as in TRL's grpo
    assert batch_normalizer(mask, "dr_grpo") == 9.0
    assert batch_normalizer(torch.zeros(2, 3, dtype=torch.bool), "token_mean") == 1.0  # never 0
    assert float(aggregate(torch.full((2, 3), float("nan")), torch.zeros(2, 3, dtype=torch.bool), agg="seq_mean")) == 0.0


# Three samples of unequal lengths (3, 1, 2 tokens), width 3; ratios made up, advantages of both signs.
LOGP3 = torch.tensor([[L(0.5), L(0.3), L(0.9)], [L(0.2), 0.0, 0.0], [L(0.6), L(0.7), 0.0]])
MU3 = torch.tensor([[L(0.4), L(0.3), L(0.5)], [L(0.25), 0.0, 0.0], [L(0.5), L(0.9), 0.0]])
MASK3 = torch.tensor([[True, True, True], [True, False, False], [True, True, False]])
ADV3 = torch.tensor([1.0, -0.5, 2.0])


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean", "dr_grpo"])
@pytest.mark.parametrize("objective", ["pg", "grpo", "gspo", "cispo", "mis"])
def test_unequal_micro_batches_and_dp_shares_give_the_one_batch_gradient(objective, agg):
    """Micro-batches of 1 and 2 samples with the whole batch's normaliser sum to the one-batch loss
    and gradient; so do "ranks" whose losses use their own normaliser, weighted by their share
    ``loss_normalizer(shard) / loss_normalizer(batch)`` (what DataParallelPolicy and ShardedPolicy set)."""
    config = LossConfig(objective=objective, loss_agg=agg, kl_coef=0.1, rho=1.5)
    full = {**batch(MU3, MASK3), "ref_logprobs": MU3 - 0.1, "rewards": torch.zeros(3)}

    def run(rows, **kw):
        x = LOGP3[rows].clone().requires_grad_(True)
        part = {k: v[rows] for k, v in full.items()}
        loss, _ = compute_loss(config, x, part, advantages=ADV3[rows], **kw)
        loss.backward()
        return loss, x.grad

    whole, g_whole = run(slice(0, 3))
    n = batch_normalizer(MASK3, agg)
    (l1, g1), (l2, g2) = run(slice(0, 1), normalizer=n), run(slice(1, 3), normalizer=n)
    assert float(l1 + l2) == pytest.approx(float(whole), rel=1e-6)
    torch.testing.assert_close(torch.cat([g1, g2]), g_whole)
    shares = [loss_normalizer(config, {k: v[r] for k, v in full.items()}) / loss_normalizer(config, full) for r in (slice(0, 1), slice(1, 3))]
    (d1, h1), (d2, h2) = run(slice(0, 1)), run(slice(1, 3))  # each rank normalises by its own shard
    assert float(shares[0] * d1 + shares[1] * d2) == pytest.approx(float(whole), rel=1e-6)
    torch.testing.assert_close(torch.cat([shares[0] * h1, shares[1] * h2]), g_whole)


# --- 2. asymmetric clipping -----------------------------------------------------------------------

# mu = 0.4 everywhere; ratios 1.25, 1.5 (A = +1) | 0.5, 0.9 (A = -1)
MU_C = torch.full((2, 2), L(0.4))
LOGP_C = [[L(0.5), L(0.6)], [L(0.2), L(0.36)]]
ADV_C = torch.tensor([1.0, -1.0])
FULL = torch.ones(2, 2, dtype=torch.bool)


@pytest.mark.parametrize("objective", ["grpo", "ppo_clip"])
def test_clip_higher_by_hand(objective):
    # [0.8, 1.28]: 1.25 inside (gradient r * A = 1.25); 1.5 -> 1.28 (none); A < 0: 0.5 -> min(-0.5, -0.8) = -0.8
    # (none); 0.9 inside (gradient -0.9)
    loss, grad, m = loss_and_grad(LossConfig(objective=objective, clip_eps_low=0.2, clip_eps_high=0.28), LOGP_C, MU_C, ADV_C, FULL)
    assert loss == pytest.approx(-(1.25 + 1.28 - 0.8 - 0.9) / 4, rel=1e-5)
    torch.testing.assert_close(grad, -torch.tensor([[1.25, 0.0], [0.0, -0.9]]) / 4)
    assert m["ppo/clip_frac_high"] == pytest.approx(1 / 4) and m["ppo/clip_frac_low"] == pytest.approx(1 / 4)
    assert m["ppo/clip_frac"] == pytest.approx(2 / 4)


def test_clip_eps_alone_is_symmetric_and_the_default_of_both_sides():
    # [0.8, 1.2]: 1.25 is now clipped too (no gradient)
    loss, grad, m = loss_and_grad(LossConfig(objective="grpo", clip_eps=0.2), LOGP_C, MU_C, ADV_C, FULL)
    assert loss == pytest.approx(-(1.2 + 1.2 - 0.8 - 0.9) / 4, rel=1e-5)
    torch.testing.assert_close(grad, -torch.tensor([[0.0, 0.0], [0.0, -0.9]]) / 4)
    assert m["ppo/clip_frac_high"] == pytest.approx(2 / 4)
    assert LossConfig(clip_eps=0.1, clip_eps_high=0.3).clip_range() == (0.1, 0.3)
    assert LossConfig(clip_eps=0.1, clip_eps_low=0.05).clip_range() == (0.05, 0.1)


# --- 3. GSPO, CISPO, TIS, MIS --------------------------------------------------------------------


def test_gspo_clips_the_sequence_ratio_by_hand():
    # sample 0: token ratios 2 and 0.5 -> geometric mean s = 1 (inside; token-level PPO would clip the 2);
    # sample 1: one token, s = 1.5 -> clipped to 1.2 (no gradient). A = +1 both.
    mu = torch.tensor([[L(0.25), L(0.5)], [L(0.4), 0.0]])
    logp = [[L(0.5), L(0.25)], [L(0.6), 0.0]]
    loss, grad, m = loss_and_grad(LossConfig(objective="gspo", loss_agg="seq_mean"), logp, mu, torch.tensor([1.0, 1.0]))
    assert loss == pytest.approx(-((1 + 1) / 2 + 1.2) / 2, rel=1e-5)
    # d s_0 / d log pi_t = s_0 / |y_0| = 1/2, times A / N_seq = 1/2
    torch.testing.assert_close(grad, -torch.tensor([[0.25, 0.25], [0.0, 0.0]]))
    assert m["gspo/ratio_mean"] == pytest.approx(1.25, rel=1e-5) and m["gspo/clip_frac_high"] == pytest.approx(0.5)


def test_gspo_gradient_equals_the_papers_sequence_objective_in_float64():
    """GSPO eq. (5)-(7), written over sequences in float64: -1/G sum_i min(s_i A_i, clip(s_i) A_i)."""
    gen = torch.Generator().manual_seed(3)
    S, C = 5, 4
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    logp = (-torch.rand(S, C, generator=gen) * 2).double()
    mu = logp + torch.randn(S, C, generator=gen).double() * 0.3
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.0])
    lo, hi = 0.1, 0.15
    x = logp.clone().requires_grad_(True)
    loss, _ = gspo_loss(x, mu, adv.double(), mask, clip_eps_low=lo, clip_eps_high=hi, agg="seq_mean")
    loss.backward()
    y = logp.clone().requires_grad_(True)
    terms = []
    for i in range(S):
        n = int(mask[i].sum())
        s = torch.exp(((y[i] - mu[i]) * mask[i]).sum() / max(n, 1))
        terms.append(torch.min(s * adv[i], s.clamp(1 - lo, 1 + hi) * adv[i]) if n else y[i].sum() * 0)
    want = -torch.stack(terms).sum() / S
    want.backward()
    assert float(loss) == pytest.approx(float(want), rel=1e-12)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-14)
    assert bool((x.grad[0] != 0).all())  # the check is not vacuous: sample 0 gets a gradient


def test_cispo_keeps_the_gradient_of_clipped_tokens_by_hand():
    # ratios 2, 1, 8; no lower bound (clip_eps_low = 1), upper 1.28: weights 1.28, 1, 1.28
    cfg = LossConfig(objective="cispo", clip_eps_low=1.0, clip_eps_high=0.28)
    loss, grad, m = loss_and_grad(cfg, LOGP)
    assert loss == pytest.approx(-(1.28 * L(0.5) + 1 * L(0.25) + 1.28 * -2 * L(0.8)) / 3, rel=1e-5)
    torch.testing.assert_close(grad, -torch.tensor([[1.28 * 1, 1.0], [1.28 * -2, 0.0]]) / 3)
    assert m["cispo/clip_frac_high"] == pytest.approx(2 / 3)
    # the lower bound: ratio 0.5 with clip_eps_low = 0.2 weighs 0.8
    _, grad, _ = loss_and_grad(LossConfig(objective="cispo", clip_eps=0.2), [[L(0.2)]], torch.tensor([[L(0.4)]]), torch.tensor([1.0]), torch.ones(1, 1, dtype=torch.bool))
    torch.testing.assert_close(grad, torch.tensor([[-0.8]]))


@pytest.mark.parametrize(
    ("objective", "level", "weights", "frac"),
    [
        ("tis", "token", [[2, 1], [4, 0]], 1 / 3),  # min(r, 4): 8 -> 4
        ("tis", "sequence", [[2, 2], [4, 0]], 1 / 3),  # sequence ratios 2 * 1 = 2 | 8 -> 4
        ("mis", "token", [[2, 1], [0, 0]], 1 / 3),  # r in [1/4, 4] kept; 8 dropped
        ("mis", "sequence", [[2, 2], [0, 0]], 1 / 3),  # sequence 0 (2) kept, sequence 1 (8) dropped
    ],
    ids=["tis-token", "tis-sequence", "mis-token", "mis-sequence"],
)
def test_truncated_and_masked_importance_sampling_by_hand(objective, level, weights, frac):
    loss, grad, m = loss_and_grad(LossConfig(objective=objective, is_level=level, rho=4.0), LOGP)
    w = torch.tensor(weights, dtype=torch.float32)
    want = -(w[0, 0] * 1 * L(0.5) + w[0, 1] * 1 * L(0.25) + w[1, 0] * -2 * L(0.8)) / 3
    assert loss == pytest.approx(float(want), rel=1e-5)
    torch.testing.assert_close(grad, -w * ADV[:, None] / 3)
    key = "tis/truncated_frac" if objective == "tis" else "mis/masked_frac"
    assert m[key] == pytest.approx(frac)


def test_mis_drops_ratios_below_its_lower_bound():
    # ratios 0.5 and 0.1 (sample 0: product 0.05); rho_low = 0.2 drops the 0.1 token, or the whole sequence
    mu = torch.tensor([[L(0.4), L(0.5)]])
    logp = [[L(0.2), L(0.05)]]
    one, full = torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool)
    _, grad, _ = loss_and_grad(LossConfig(objective="mis", rho=2.0, rho_low=0.2), logp, mu, one, full)
    torch.testing.assert_close(grad, -torch.tensor([[0.5, 0.0]]) / 2)
    _, grad, _ = loss_and_grad(LossConfig(objective="mis", rho=2.0, rho_low=0.2, is_level="sequence"), logp, mu, one, full)
    torch.testing.assert_close(grad, torch.zeros(1, 2))


def test_a_long_sequences_ratio_does_not_overflow():
    # sum of log-ratios 200 * 1 = 200: exp overflows float32, the weights must not
    mask = torch.ones(1, 200, dtype=torch.bool)
    for objective in ("tis", "mis"):
        x = torch.zeros(1, 200, requires_grad=True)
        loss, _ = compute_loss(LossConfig(objective=objective, is_level="sequence"), x, batch(torch.full((1, 200), -1.0), mask), advantages=torch.ones(1))
        loss.backward()
        assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("objective", sorted(LOSSES))
def test_every_objective_on_policy_is_reinforce(objective):
    """pi == mu: every ratio is 1, nothing clipped or dropped, and each gradient is -A / N (token_mean); opd's teacher is mu too (no reverse KL)."""
    teacher = {"teacher_logprobs": torch.tensor(LOGP)} if objective == "opd" else {}
    _, grad, _ = loss_and_grad(LossConfig(objective=objective), LOGP, torch.tensor(LOGP), fields=teacher)
    torch.testing.assert_close(grad, -ADV[:, None] * MASK / 3)


# --- 5. validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"clip_eps_high": -0.1}, r"clip_eps_high=-0.1 must be > 0"),
        ({"clip_eps_low": 1.5}, r"clip_eps_low=1.5 must be in \(0, 1\]"),
        ({"clip_eps_low": 0.0}, r"clip_eps_low=0.0 must be in \(0, 1\]"),
        ({"loss_agg": "sum"}, r"unknown loss_agg 'sum': use one of token_mean, seq_mean, dr_grpo \(TRL's loss_type grpo -> seq_mean"),
        ({"is_level": "batch"}, r"unknown is_level 'batch'"),
        ({"rho_low": 5.0}, r"rho_low=5.0 must be in \[0, rho=4.0\)"),
        ({"overlong_buffer": -1}, r"overlong_buffer=-1 must be >= 0"),
        ({"overlong_penalty": -1.0}, r"overlong_penalty=-1.0 must be >= 0"),
        ({"clip_eps_high": float("inf")}, r"clip_eps_high=inf must be a finite number"),
    ],
    ids=["high-negative", "low-above-1", "low-zero", "agg", "is-level", "rho-low", "buffer", "penalty", "high-inf"],
)
def test_new_options_are_validated_with_clear_errors(options, match):
    with pytest.raises(ConfigError, match=match):
        LossConfig(**options)
