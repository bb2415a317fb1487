"""Several updates per batch (``num_iterations`` x ``num_mini_batches``) and AReaL's decoupled PPO.

Expected values come from outside the trainer: the decoupled-PPO cases are worked out by hand; the
trainer's steps are replayed in the test with plain autograd and ``torch.optim.AdamW`` on a copy of
the model (the objective written out here, advantages by hand, one normaliser per mini-batch).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from flowrl.errors import ConfigError, GraphError
from flowrl.graph.builder import GraphBuilder
from flowrl.graph.configs import LossConfig, OptimizerConfig
from flowrl.operators.logprobs import completion_logprobs
from flowrl.operators.losses import compute_loss, decoupled_ppo_loss
from flowrl.operators.trainer import Trainer

from .helpers import TINY, loss_node, rollout_with_rewards, tiny_policy_node

L = math.log


# --- decoupled PPO by hand ----------------------------------------------------------------------
# Three tokens of one sample (A = +1) and one of another (A = -1); eps = 0.2, cap rho = 3.
#   token  pi    pi_prox  mu     r = pi/prox   w = prox/mu    term (A * r, clipped)
#   0      0.6   0.5      0.25   1.2           2.0            min(1.2, 1.2) = 1.2     -> w * 1.2 = 2.4
#   1      0.9   0.6      0.3    1.5           2.0            min(1.5, 1.2) = 1.2     -> 2.4, no gradient (clipped)
#   2      0.4   0.8      0.2    0.5           4.0 > cap      dropped (w = 0)
#   3      0.3   0.5      0.5    0.6 (A = -1)  1.0            min(-0.6, -0.8) = -0.8  -> -0.8, no gradient (clipped)
# loss = -(2.4 + 2.4 + 0 - 0.8) / 4 tokens = -1.0
# d loss / d log pi: only token 0 unclipped: -w * A * r / 4 = -2 * 1.2 / 4 = -0.6
PI = [[0.6, 0.9, 0.4], [0.3, 1.0, 1.0]]
PROX = [[0.5, 0.6, 0.8], [0.5, 1.0, 1.0]]
MU = [[0.25, 0.3, 0.2], [0.5, 1.0, 1.0]]
MASK = torch.tensor([[True, True, True], [True, False, False]])
ADV = torch.tensor([1.0, -1.0])


def _logs(p):
    return torch.tensor([[L(x) for x in row] for row in p])


def test_decoupled_ppo_by_hand():
    x = _logs(PI).requires_grad_(True)
    loss, m = decoupled_ppo_loss(x, _logs(PROX), _logs(MU), ADV, MASK, clip_eps_low=0.2, clip_eps_high=0.2, cap=3.0)
    loss.backward()
    assert float(loss) == pytest.approx(-1.0, rel=1e-6)
    want = torch.zeros(2, 3)
    want[0, 0] = -0.6
    torch.testing.assert_close(x.grad, want)
    assert m["dppo/behav_masked_frac"] == pytest.approx(0.25)
    assert m["dppo/behav_weight_mean"] == pytest.approx((2 + 2 + 1) / 3)  # over the kept tokens
    assert m["dppo/clip_frac"] == pytest.approx(0.75)  # r = 1.5, 0.5, 0.6 lie outside [0.8, 1.2]
    assert m["dppo/ratio_mean"] == pytest.approx((1.2 + 1.5 + 0.5 + 0.6) / 4)


def test_decoupled_ppo_without_a_cap_keeps_every_token():
    """No cap: token 2 (w = 4, r = 0.5, A = +1: min(0.5, 0.8) = 0.5, unclipped) adds -4 * 0.5 / 4 to the gradient."""
    x = _logs(PI).requires_grad_(True)
    loss, m = decoupled_ppo_loss(x, _logs(PROX), _logs(MU), ADV, MASK, clip_eps_low=0.2, clip_eps_high=0.2, cap=None)
    loss.backward()
    assert float(loss) == pytest.approx(-(2.4 + 2.4 + 2.0 - 0.8) / 4, rel=1e-6)
    assert float(x.grad[0, 2]) == pytest.approx(-0.5)
    assert m["dppo/behav_masked_frac"] == 0.0


def test_decoupled_ppo_through_the_loss_table_takes_rho_as_its_cap_and_the_batchs_proximal_logprobs():
    batch = {"behaviour_logprobs": _logs(MU), "completion_mask": MASK, "group_ids": torch.tensor([0, 1]), "proximal_logprobs": _logs(PROX)}
    x = _logs(PI).requires_grad_(True)
    loss, m = compute_loss(LossConfig(objective="decoupled_ppo", rho=3.0, clip_eps=0.2), x, batch, advantages=ADV)
    assert float(loss) == pytest.approx(-1.0, rel=1e-6)
    assert m["dppo/behav_masked_frac"] == pytest.approx(0.25)


# --- options and their checks -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "match"),
    [({"num_iterations": 0}, r"num_iterations=0 must be >= 1"), ({"num_mini_batches": 0}, r"num_mini_batches=0 must be >= 1")],
    ids=["iterations", "mini-batches"],
)
def test_bad_counts_are_config_errors(options, match):
    with pytest.raises(ConfigError, match=match):
        OptimizerConfig(**options)


def _graph(batch_size: int = 4, batching: str = "lockstep", **policy: object):
    b = GraphBuilder("iters", model=TINY)
    prompts = b.source("prompts", task="copy", batch_size=batch_size)
    gen = b.generator("gen", prompts, n_samples=2, max_new_tokens=3, batching=batching)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    loss = b.loss("loss", gen, reward)
    pol = b.policy("policy", loss, **policy)
    b.weights(pol, gen, max_staleness=1)
    return b.build()


def test_a_mini_batch_split_that_does_not_divide_the_batch_is_refused_when_the_graph_is_built():
    with pytest.raises(GraphError, match=r"num_mini_batches=3 does not divide the 4 prompts .* use one of \[1, 2, 4\]"):
        _graph(batch_size=4, num_mini_batches=3)
    assert _graph(batch_size=4, num_mini_batches=2).updates_per_batch() == 2


def test_trls_num_iterations_given_to_the_loss_points_at_the_policy():
    b = GraphBuilder("iters", model=TINY)
    prompts = b.source("prompts", task="copy", batch_size=2)
    gen = b.generator("gen", prompts, n_samples=2)
    reward = b.scorer("reward", gen, fn="flowrl.operators.tasks:copy_reward")
    with pytest.raises(ConfigError, match=r"'num_iterations' is an option of b.policy"):
        b.loss("loss", gen, reward, num_iterations=2)
    with pytest.raises(ConfigError, match=r"'steps_per_generation' is TRL's name: did you mean num_mini_batches\?"):
        b.policy("policy", b.loss("loss", gen, reward), steps_per_generation=2)


# --- the trainer: versions, mini-batches, the old policy, the gradient -----------------------------
def test_one_update_per_batch_is_one_aipo_step_as_before_without_an_old_policy_pass():
    """K = M = 1 (the default): one AdamW step on AIPO's objective written out here, equal to the last
    bit (measured: the same kernels in the same order), no ``old/*`` metrics, version 1."""
    batch = rollout_with_rewards(seed=0, n_samples=3, batch_size=2)
    assert batch["rewards"].std() > 0
    node = tiny_policy_node(lr=3e-2, grad_clip=0.0)
    trainer = Trainer(node, loss_node(rho=2.0))
    replay = copy.deepcopy(trainer.model)
    opt = torch.optim.AdamW(replay.parameters(), lr=3e-2, betas=node.optimizer.betas, weight_decay=node.optimizer.weight_decay)
    rewards = batch["rewards"].float().view(-1, 3)
    adv = (rewards - rewards.mean(1, keepdim=True)).reshape(-1, 1)
    mask = batch["completion_mask"]
    logp = _logp(replay, batch)
    weight = torch.exp(logp.detach() - batch["behaviour_logprobs"]).clamp(max=2.0)
    (-(torch.where(mask, weight * adv * logp, 0.0)).sum() / mask.sum()).backward()
    opt.step()
    metrics = trainer.train_step(batch)
    assert trainer.version == 1
    assert not any(k.startswith("old/") for k in metrics) and "updates" not in metrics
    for p, q in zip(trainer.model.parameters(), replay.parameters()):
        assert torch.equal(p.grad, q.grad) and torch.equal(p.data, q.data)


def test_mini_batches_are_whole_groups_each_pass_in_a_seeded_order():
    batch = rollout_with_rewards(seed=0, n_samples=3, batch_size=8)
    trainer = Trainer(tiny_policy_node(num_iterations=3, num_mini_batches=4, seed=5), loss_node())
    parts = trainer._mini_batches(batch, version=0)
    assert len(parts) == 12
    passes = [[sorted(set(p["group_ids"].tolist())) for p in parts[i : i + 4]] for i in range(0, 12, 4)]
    for groups in passes:
        assert sorted(g for part in groups for g in part) == list(range(8))  # every group once a pass
        assert all(len(part) == 2 for part in groups)
    for p in parts:  # whole groups: each group's 3 samples, rows as in the batch
        for g in set(p["group_ids"].tolist()):
            rows = (batch["group_ids"] == g).nonzero().flatten()
            assert torch.equal(p["completion_ids"][p["group_ids"] == g], batch["completion_ids"][rows])
    assert passes[0] != passes[1] or passes[1] != passes[2]  # new orders
    again = [sorted(set(p["group_ids"].tolist())) for p in Trainer(tiny_policy_node(num_iterations=3, num_mini_batches=4, seed=5), loss_node())._mini_batches(batch, version=0)]
    assert again == [g for groups in passes for g in groups]  # the same seed and version draw the same (resume)
    later = [sorted(set(p["group_ids"].tolist())) for p in trainer._mini_batches(batch, version=12)]
    assert later != again


def _logp(model, part):
    return completion_logprobs(
        model, part["sample_prompt_ids"], part["sample_prompt_lens"], part["completion_ids"], part["completion_mask"],
        temperature=part.get("sampling_temperature", 1.0),
    )


def _reference_steps(model, optimizer, parts, *, prox_model, eps=0.2, rho=4.0):
    """Decoupled PPO steps written out: per mini-batch, group-mean advantages by hand, the objective
    over the mini-batch's real tokens, backward, AdamW; returns each step's ratios to the old policy."""
    ratios = []
    for part in parts:
        n = int(part["group_ids"].shape[0])
        groups = part["group_ids"].view(-1, 3)  # 3 samples a group, contiguous
        assert (groups == groups[:, :1]).all()
        rewards = part["rewards"].float().view(-1, 3)
        adv = (rewards - rewards.mean(1, keepdim=True)).reshape(n, 1)
        mask = part["completion_mask"]
        with torch.no_grad():
            prox = _logp(prox_model, part)
        logp = _logp(model, part)
        r = torch.exp(logp - prox)
        w = torch.exp(prox - part["behaviour_logprobs"])
        w = torch.where(w <= rho, w, torch.zeros(()))
        term = w * torch.min(r * adv, r.clamp(1 - eps, 1 + eps) * adv)
        loss = -(term * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ratios.append(r.detach()[mask])
    return ratios


@pytest.mark.parametrize(
    ("iterations", "mini_batches"), [pytest.param(2, 1, marks=pytest.mark.slow), (2, 2)], ids=["K2", "K2-M2"]
)  # K2 alone: --runslow (CI time; K2-M2 has K = 2 and a second pass too)
def test_each_update_equals_an_autograd_replay_against_the_old_policy(iterations, mini_batches):
    """K passes of M mini-batches: every optimizer step's gradient and the final weights equal the
    steps replayed with autograd, the ratio pi / pi_old of the second pass differs from 1, and the
    version advances by K * M. Measured: gradients and weights equal to the last bit (same kernels, same
    order); the tolerances are assert_close's float32 defaults (1.3e-6 relative), for other machines."""
    batch = rollout_with_rewards(seed=3, n_samples=3, batch_size=4)
    assert batch["rewards"].std() > 0
    node = tiny_policy_node(lr=3e-2, grad_clip=0.0, num_iterations=iterations, num_mini_batches=mini_batches)
    trainer = Trainer(node, loss_node(objective="decoupled_ppo", clip_eps=0.2, rho=4.0))
    old = copy.deepcopy(trainer.model)
    replay = copy.deepcopy(trainer.model)
    opt = torch.optim.AdamW(replay.parameters(), lr=3e-2, betas=node.optimizer.betas, weight_decay=node.optimizer.weight_decay)
    parts = trainer._mini_batches(batch, version=0)  # the order the trainer draws (checked above)
    ratios = _reference_steps(replay, opt, parts, prox_model=old)
    metrics = trainer.train_step(batch)
    assert trainer.version == iterations * mini_batches
    assert metrics["updates"] == iterations * mini_batches
    for p, q in zip(trainer.model.parameters(), replay.parameters()):
        torch.testing.assert_close(p.grad, q.grad)  # the last step's gradient
        torch.testing.assert_close(p.data, q.data)
    assert torch.allclose(ratios[0], torch.ones_like(ratios[0]), atol=1e-5)  # the first step is at the old weights
    assert (ratios[-1] - 1).abs().max() > 1e-2  # the second pass is not
    want_ratio = sum(float(r.mean()) for r in ratios) / len(ratios)  # the row's mean over the steps
    assert metrics["old/ratio_mean"] == pytest.approx(want_ratio, rel=1e-5)
    assert metrics["old/ratio_max"] == pytest.approx(max(float(r.max()) for r in ratios), rel=1e-5)


def _reference_ppo_steps(model, optimizer, parts, *, old, eps=0.2):
    """GRPO's clipped surrogate written out against the log-probs ``old`` (one tensor per part): group-mean
    advantages by hand, ``min(r A, clip(r, 1 - eps, 1 + eps) A)`` with ``r = pi / old`` over the part's real
    tokens, backward, AdamW; returns each step's ratios."""
    ratios = []
    for part, anchor in zip(parts, old):
        n = int(part["group_ids"].shape[0])
        rewards = part["rewards"].float().view(-1, 3)  # 3 samples a group, contiguous
        adv = (rewards - rewards.mean(1, keepdim=True)).reshape(n, 1)
        mask = part["completion_mask"]
        logp = _logp(model, part)
        r = torch.exp(logp - anchor)
        loss = -(torch.min(r * adv, r.clamp(1 - eps, 1 + eps) * adv) * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ratios.append(r.detach()[mask])
    return ratios


@pytest.mark.parametrize("objective", ["grpo", "ppo_clip"])
def test_with_two_updates_ppo_clips_against_the_policy_at_the_batchs_start_not_mu(objective):
    """A batch whose mu is not the trainer's policy (every recorded log mu raised by 0.5, as a stale or
    quantized generator's would differ): with num_iterations=2 both steps clip pi / pi_old, pi_old the
    weights the batch starts with (TRL's old_per_token_logps), so the first step's ratio is exactly 1.
    The two steps replayed by hand against pi_old give the trainer's gradients and weights (assert_close's
    float32 defaults, 1.3e-6 relative: the same kernels in the same order); replayed against mu they
    do not (the ratio e^-0.5 = 0.61 lies below the clip range, which drops the negative advantages'
    gradients), so a trainer that skipped pi_old and fell back to mu fails here."""
    batch = rollout_with_rewards(seed=3, n_samples=3, batch_size=4)
    assert batch["rewards"].std() > 0
    batch["behaviour_logprobs"] = torch.where(batch["completion_mask"], batch["behaviour_logprobs"] + 0.5, 0.0)  # mu != pi_old
    node = tiny_policy_node(lr=3e-2, grad_clip=0.0, num_iterations=2)
    trainer = Trainer(node, loss_node(objective=objective, clip_eps=0.2))

    def replay(anchor_of):
        model = copy.deepcopy(trainer.model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-2, betas=node.optimizer.betas, weight_decay=node.optimizer.weight_decay)
        parts = [batch, batch]  # two passes over the one mini-batch
        return model, _reference_ppo_steps(model, opt, parts, old=[anchor_of(p) for p in parts])

    with torch.no_grad():
        pi_old = _logp(trainer.model, batch)
    by_hand, ratios = replay(lambda part: pi_old)
    against_mu, _ = replay(lambda part: part["behaviour_logprobs"])
    metrics = trainer.train_step(batch)
    assert trainer.version == 2
    torch.testing.assert_close(ratios[0], torch.ones_like(ratios[0]), rtol=0, atol=0)  # pi = pi_old at the first step
    for p, q in zip(trainer.model.parameters(), by_hand.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
        torch.testing.assert_close(p.data, q.data)
    assert max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(trainer.model.parameters(), against_mu.parameters())) > 1e-3
    # the row's mean of ~50 float32 ratios near 1, summed in another order: at most ~50 ulps (6e-6) apart
    assert metrics["ppo/ratio_mean"] == pytest.approx(sum(float(r.mean()) for r in ratios) / 2, rel=1e-5)
