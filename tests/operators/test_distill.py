"""On-policy distillation (``flowrl.operators.distill``, the row ``LOSSES["opd"]``): the loss by hand, its gradient against the formula
and against the exact reverse KL's, composition with the reward's advantage, and its teacher operator."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import LossConfig, ModelConfig
from flowrl.operators.distill import opd_advantages
from flowrl.operators.losses import LOSSES, aipo_loss, compute_loss
from tests.tolerances import U32

L = math.log

# Two samples, two positions; the last token of sample 1 is padding (its values must not matter).
LOGP = torch.tensor([[L(0.5), L(0.25)], [L(0.8), 0.0]])
MU = torch.tensor([[L(0.25), L(0.25)], [L(0.1), 7.0]])
TEACHER = torch.tensor([[L(0.5), L(0.125)], [L(0.2), float("nan")]])
ADV = torch.tensor([1.0, -2.0])
MASK = torch.tensor([[True, True], [True, False]])
def opd_loss(logp, mu, teacher, adv, mask, *, coef: float, rho: float, normalizer=None):
    """The objective's row (``LOSSES["opd"]``: ``distill.opd_terms`` aggregated under ``token_mean``)."""
    config = LossConfig(objective="opd", distill_coef=coef, rho=rho)
    return LOSSES["opd"](config, logp, mu, adv, mask, teacher=teacher, normalizer=normalizer)


#: A handful of float32 operations on values of order 1-10: each rounds by at most u, a few dozen u in all.
REL = 64 * U32


def test_opd_by_hand():
    loss, m = opd_loss(LOGP, MU, TEACHER, ADV, MASK, coef=0.5, rho=4.0)
    k = [L(0.25) - L(0.5), L(0.25) - L(0.125), L(0.1) - L(0.2)]  # log mu - log teacher: -log 2, log 2, -log 2
    adv = [1.0 - 0.5 * k[0], 1.0 - 0.5 * k[1], -2.0 - 0.5 * k[2]]
    weights = [2.0, 1.0, 4.0]  # ratios 2, 1, 8 (capped at rho)
    logp = [L(0.5), L(0.25), L(0.8)]
    want = -sum(w * a * lp for w, a, lp in zip(weights, adv, logp)) / 3
    assert float(loss) == pytest.approx(want, rel=REL)
    assert m["distill/reverse_kl"] == pytest.approx(sum(k) / 3, rel=REL)
    assert m["distill/teacher_logprob"] == pytest.approx((L(0.5) + L(0.125) + L(0.2)) / 3, rel=REL)
    assert m["distill/advantage"] == pytest.approx(sum(adv) / 3, rel=REL)
    assert m["opd/ratio_max"] == pytest.approx(8.0, rel=REL) and m["opd/truncated_frac"] == pytest.approx(1 / 3)
    assert math.isfinite(float(loss)), "the padding's nan teacher value leaked into the loss"


def test_without_the_teacher_term_it_is_aipo():
    """distill_coef = 0: exactly AIPO's loss with the reward's advantages."""
    got, _ = opd_loss(LOGP, MU, TEACHER, ADV, MASK, coef=0.0, rho=4.0)
    want, _ = aipo_loss(LOGP, MU, ADV, MASK, rho=4.0)
    assert float(got) == float(want)


def test_token_advantages_are_the_reward_minus_the_weighted_reverse_kl():
    adv = opd_advantages(ADV, MU, TEACHER, MASK, coef=2.0)
    want = torch.tensor([[1.0 + 2 * L(2), 1.0 - 2 * L(2)], [-2.0 + 2 * L(2), 0.0]])
    torch.testing.assert_close(adv, want, rtol=REL, atol=0.0)


def test_the_gradient_equals_the_formula():
    """Autograd equals  -sum_t min(ratio, rho) * (A_i - c * (log mu - log teacher)) * grad log pi / N."""
    gen = torch.Generator().manual_seed(0)
    S, C, V, rho, coef = 4, 3, 5, 2.0, 0.7
    logits = torch.randn(S, C, V, generator=gen, requires_grad=True)
    tokens = torch.randint(0, V, (S, C), generator=gen)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    pick = lambda t: t.gather(-1, tokens[..., None]).squeeze(-1)  # noqa: E731
    mu = pick(torch.log_softmax(torch.randn(S, C, V, generator=gen) * 2, -1))
    teacher = pick(torch.log_softmax(torch.randn(S, C, V, generator=gen) * 2, -1))
    adv = torch.tensor([1.0, -0.5, 2.0, -2.5])
    logp = pick(torch.log_softmax(logits, -1))
    loss, m = opd_loss(logp, mu, teacher, adv, mask, coef=coef, rho=rho)
    loss.backward()
    with torch.no_grad():
        grad_log_pi = torch.nn.functional.one_hot(tokens, V).float() - torch.softmax(logits, -1)
        weight = torch.minimum((logp - mu).exp(), torch.tensor(rho))
        want = -(weight * (adv[:, None] - coef * (mu - teacher)) * mask)[..., None] * grad_log_pi / mask.sum()
    # float32 sums of at most 12 terms of magnitude <= rho * (|A| + c * |k|) ~ 30: rounding far below 1e-5 of the largest entry
    torch.testing.assert_close(logits.grad, want, rtol=1e-5, atol=float(want.abs().max()) * 64 * U32)
    assert 0 < m["opd/truncated_frac"] < 1  # both branches of the cap


def test_on_policy_its_expected_gradient_is_the_reverse_kl_gradient():
    """With mu = pi and no reward, the sampled-token loss averaged over y ~ pi (each token of the
    vocabulary weighted by pi(y)) has the gradient of distill_coef * KL(pi || teacher) at that position."""
    gen = torch.Generator().manual_seed(3)
    V, coef = 6, 1.5
    logits = torch.randn(V, generator=gen, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(V, generator=gen, dtype=torch.float64), -1)
    logp_all = torch.log_softmax(logits, -1)
    expected = torch.zeros((), dtype=torch.float64)
    for y in range(V):  # one sample per token y, drawn with probability pi(y)
        lp = logp_all[y].view(1, 1)
        loss, _ = opd_loss(lp, lp.detach(), teacher[y].view(1, 1), torch.zeros(1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool), coef=coef, rho=4.0)
        expected = expected + logp_all[y].exp().detach() * loss
    (grad,) = torch.autograd.grad(expected, logits)
    fresh = torch.log_softmax(logits, -1)
    kl = (fresh.exp() * (fresh - teacher)).sum()
    (want,) = torch.autograd.grad(coef * kl, logits)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-13)  # float64: the same sums in another order


def test_micro_batches_add_up_with_the_whole_batch_normalizer():
    full, _ = opd_loss(LOGP, MU, TEACHER, ADV, MASK, coef=0.5, rho=4.0)
    parts = [opd_loss(LOGP[i : i + 1], MU[i : i + 1], TEACHER[i : i + 1], ADV[i : i + 1], MASK[i : i + 1], coef=0.5, rho=4.0, normalizer=3)[0] for i in range(2)]
    assert float(sum(parts)) == pytest.approx(float(full), rel=REL)


def _batch(**extra):
    return {"behaviour_logprobs": MU, "completion_mask": MASK, "group_ids": torch.tensor([0, 0]), "rewards": torch.tensor([1.0, 0.0]), **extra}


def test_compute_loss_sums_the_reward_advantage_and_the_teacher_term():
    config = LossConfig(objective="opd", distill_coef=0.5)
    loss, m = compute_loss(config, LOGP, _batch(teacher_logprobs=TEACHER))
    want, _ = opd_loss(LOGP, MU, TEACHER, torch.tensor([0.5, -0.5]), MASK, coef=0.5, rho=4.0)  # group advantages of rewards 1, 0
    assert float(loss) == float(want) and "distill/reverse_kl" in m
    alone, _ = compute_loss(LossConfig(objective="opd", reward_weights={"rewards": 0.0}), LOGP, _batch(teacher_logprobs=TEACHER))
    want_alone, _ = opd_loss(LOGP, MU, TEACHER, torch.zeros(2), MASK, coef=1.0, rho=4.0)
    assert float(alone) == float(want_alone), "a reward weight of 0 is distillation alone"


def test_compute_loss_without_teacher_logprobs_names_the_teacher():
    with pytest.raises(ConfigError, match=r"loss 'opd' reads a teacher's log-probs \('teacher_logprobs'\).*add a teacher node feeding the loss"):
        compute_loss(LossConfig(objective="opd"), LOGP, _batch())


def test_a_negative_distill_coef_is_refused():
    with pytest.raises(ConfigError, match=r"distill_coef=-1.0 must be >= 0"):
        LossConfig(objective="opd", distill_coef=-1.0)


def test_the_teacher_scores_the_whole_vocabulary_where_the_reference_truncates():
    """The teacher's operator is the reference's with its own output field and no top-k / top-p: on one
    model the two agree where the reference keeps the token and the teacher stays finite where it does not."""
    from flowrl.graph.nodes import ReferenceNode
    from flowrl.graph.teacher import TeacherNode
    from flowrl.operators.reference import Reference
    from flowrl.operators.teacher import Teacher

    model = ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, seed=5)
    rollout = {
        "sample_prompt_ids": torch.tensor([[1, 4, 14], [0, 3, 2]]), "sample_prompt_lens": torch.tensor([3, 2]),
        "completion_ids": torch.tensor([[4, 2, 9], [7, 7, 0]]), "completion_mask": torch.tensor([[True, True, True], [True, True, False]]),
        "sampling_temperature": torch.tensor([0.7, 0.7]),
    }
    untruncated = Reference(ReferenceNode(name="ref", model=model)).logprobs(rollout)["ref_logprobs"]
    teacher = Teacher(TeacherNode(name="teacher", model=model)).logprobs({**rollout, "sampling_top_k": torch.tensor([1, 1])})["teacher_logprobs"]
    truncated = Reference(ReferenceNode(name="ref", model=model)).logprobs({**rollout, "sampling_top_k": torch.tensor([1, 1])})["ref_logprobs"]
    assert torch.equal(teacher, untruncated), "the same model and temperature: the same forward pass"
    assert torch.isneginf(truncated).any() and torch.isfinite(teacher).all()


def test_a_distill_coef_on_an_objective_without_a_teacher_is_refused_by_name():
    """``distill_coef`` weighs a teacher's advantage: on an objective that reads no teacher it would
    be accepted and ignored, so it is refused; at its default it is no choice and passes."""
    from flowrl.errors import ConfigError
    from flowrl.graph.configs import LossConfig

    with pytest.raises(ConfigError, match=r"distill_coef=0.5 weighs a teacher's advantage, which objective 'grpo' does not read \(reads: mu\)"):
        LossConfig(objective="grpo", distill_coef=0.5)
    assert LossConfig(objective="grpo").distill_coef == 1.0 and LossConfig(objective="opd", distill_coef=0.5).distill_coef == 0.5

