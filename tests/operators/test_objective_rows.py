"""DPPO and SAPO rows and the rollout corrections against hand computations on small tensors.

The batch is test_loss_menu's: two samples, pi = (0.5, 0.25 | 0.8), mu = (0.25, 0.25 | 0.1), so the
ratios pi/mu are 2, 1 and 8, advantages 1 and -2, three real tokens (token_mean divides by 3).

Tolerance: each expected value is computed in float64 from its formula; the code's float32 result
passes through at most ~10 rounded operations (a log, an exp or sigmoid, a few products, a sum of
three terms, a division) on values of magnitude at most ``MAG`` (16: A * r = -2 * 8), each rounding
by at most ``U32`` relative, so the two differ by at most ``10 * U32 * MAG`` plus the float32
rounding of the inputs themselves (log-probs of magnitude <= 2.3, rounded once: their exp's relative
error ``2.3 * U32`` times ``MAG``): ``TOL = (10 + 2.3) * U32 * MAG``, about 1.2e-5.
"""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.graph.configs import LossConfig
from flowrl.graph.corrections import CorrectionConfig
from flowrl.graph.objectives import BUILTIN_OBJECTIVES
from flowrl.operators.losses import LOSSES, compute_loss

from ..tolerances import U32

L = math.log
LOGP = [[L(0.5), L(0.25)], [L(0.8), 0.0]]
MU = torch.tensor([[L(0.25), L(0.25)], [L(0.1), 0.0]])
ADV = torch.tensor([1.0, -2.0])
MASK = torch.tensor([[True, True], [True, False]])
R = [[2.0, 1.0], [8.0, 0.0]]  # pi / mu
A = [[1.0, 1.0], [-2.0, 0.0]]  # each token's advantage
MAG = 16.0
TOL = (10 + 2.3) * U32 * MAG


def run(config: LossConfig, logp=LOGP, **fields):
    x = torch.tensor(logp, requires_grad=True)
    batch = {"behaviour_logprobs": MU, "completion_mask": MASK, "group_ids": torch.arange(2), **fields}
    loss, metrics = compute_loss(config, x, batch, advantages=ADV)
    loss.backward()
    return float(loss.detach()), x.grad, metrics


def close(actual, expected) -> None:
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64), atol=TOL, rtol=0)


def test_the_built_in_rows_and_their_functions_list_the_same_names():
    assert sorted(LOSSES) == sorted(BUILTIN_OBJECTIVES)


# --- DPPO (prime-rl's default) --------------------------------------------------------------------


def test_dppo_by_hand():
    # pi - mu = 0.25, 0, 0.7. Sample 0 (A = 1 > 0) masks d > 0.2: its first token. Sample 1 (A = -2)
    # masks d < -0.2: nothing. Per token: - keep A r + kl_tau (log r)^2, kl_tau = 0.1.
    kl = 0.1
    _, grad, m = run(LossConfig(objective="dppo", options={"kl_tau": kl}))
    lr = [[L(2.0), 0.0], [L(8.0), 0.0]]
    keep = [[0.0, 1.0], [1.0, 0.0]]
    want_loss = sum(-keep[i][j] * A[i][j] * R[i][j] + kl * lr[i][j] ** 2 for i, j in ((0, 0), (0, 1), (1, 0))) / 3
    loss, _, _ = run(LossConfig(objective="dppo", options={"kl_tau": kl}))
    close(loss, want_loss)
    # d/dlog pi: - keep A r + 2 kl_tau log r
    want_grad = [[(-keep[i][j] * A[i][j] * R[i][j] + 2 * kl * lr[i][j]) / 3 if MASK[i, j] else 0.0 for j in range(2)] for i in range(2)]
    close(grad, want_grad)
    assert m["dppo_tv/masked_frac"] == pytest.approx(1 / 3) and m["dppo_tv/masked_frac_high"] == pytest.approx(1 / 3)
    assert m["dppo_tv/masked_frac_low"] == 0.0


def test_dppo_masks_a_falling_token_under_a_negative_advantage():
    # one token, A = -1, pi = 0.1, mu = 0.5: d = -0.4 < -0.2, masked; with mask_low = 0.5 it is kept
    mu, one = torch.tensor([[L(0.5)]]), torch.ones(1, 1, dtype=torch.bool)
    for mask_low, want in ((0.2, 0.0), (0.5, 0.2)):  # kept: - A r = 1 * 0.2 per unit grad log pi
        x = torch.tensor([[L(0.1)]], requires_grad=True)
        cfg = LossConfig(objective="dppo", options={"mask_low": mask_low, "kl_tau": 0.0})
        loss, _ = compute_loss(cfg, x, {"behaviour_logprobs": mu, "completion_mask": one, "group_ids": torch.zeros(1)}, advantages=torch.tensor([-1.0]))
        loss.backward()
        close(x.grad, [[want]])


# --- SAPO -----------------------------------------------------------------------------------------


def test_sapo_by_hand():
    # one update a batch: pi_old = mu, r = 2, 1, 8; tau 1.0 (A > 0), 1.05 (A < 0)
    tau = [[1.0, 1.0], [1.05, 1.0]]
    sig = [[1 / (1 + math.exp(-tau[i][j] * (R[i][j] - 1))) for j in range(2)] for i in range(2)]
    toks = ((0, 0), (0, 1), (1, 0))
    want_loss = -sum(4 / tau[i][j] * sig[i][j] * A[i][j] for i, j in toks) / 3
    want_grad = [[-4 * sig[i][j] * (1 - sig[i][j]) * R[i][j] * A[i][j] / 3 if MASK[i, j] else 0.0 for j in range(2)] for i in range(2)]
    loss, grad, m = run(LossConfig(objective="sapo"))
    close(loss, want_loss)
    close(grad, want_grad)
    assert m["sapo/gate_mean"] == pytest.approx(sum(4 * sig[i][j] * (1 - sig[i][j]) for i, j in toks) / 3, rel=1e-6)


def test_sapo_takes_its_ratio_against_the_batch_start_policy():
    # several updates: pi_old = proximal_logprobs = pi, so r = 1 and the gradient is -A / 3 (REINFORCE)
    _, grad, _ = run(LossConfig(objective="sapo"), proximal_logprobs=torch.tensor(LOGP))
    close(grad, [[-1 / 3, -1 / 3], [2 / 3, 0.0]])


# --- corrections ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("correction", "weights", "token_frac", "seq_frac"),
    [
        (CorrectionConfig(kind="tis"), [[2, 1], [2, 0]], 1 / 3, 1 / 2),  # min(r, 2): 8 -> 2
        (CorrectionConfig(kind="tis", level="sequence", cap=4.0), [[2, 2], [4, 0]], 1 / 3, 1 / 2),  # products 2 | 8 -> 4
        (CorrectionConfig(kind="icepop"), [[2, 1], [0, 0]], 1 / 3, 1 / 2),  # r in [0.5, 5] kept with weight r; 8 masked
        (CorrectionConfig(kind="seq_mask", low=0.5, high=1.5), [[1, 1], [0, 0]], 1 / 3, 1 / 2),  # geo means sqrt 2 (kept), 8
    ],
    ids=["tis-token", "tis-sequence", "icepop", "seq_mask"],
)
def test_a_correction_on_grpo_weights_each_tokens_gradient_by_hand(correction, weights, token_frac, seq_frac):
    # under a correction grpo's ratio is pi / pi_old = 1 (one update: pi's own values), so its gradient
    # is -A / 3 per token, times the weight of pi_old / mu = 2, 1, 8
    loss, grad, m = run(LossConfig(objective="grpo", correction=correction))
    w = torch.tensor(weights, dtype=torch.float64)
    close(grad, -w * torch.tensor(A, dtype=torch.float64) / 3)
    kept = [(i, j) for i, j in ((0, 0), (0, 1), (1, 0)) if weights[i][j] > 0]
    close(loss, -sum(A[i][j] for i, j in kept) / 3)  # masked tokens leave the value; the normalizer stays 3
    assert m["correction/token_frac"] == pytest.approx(token_frac) and m["correction/seq_frac"] == pytest.approx(seq_frac)
    assert m["correction/weight_mean"] == pytest.approx(float(w.sum()) / 3, rel=1e-6)
    assert m["correction/weight_max"] == pytest.approx(float(w.max()), rel=1e-6)


def test_pg_with_tis_is_the_tis_objective():
    # the alias: objective="tis" (cap rho) has the gradient of pg with correction tis (cap rho)
    for level in ("token", "sequence"):
        _, old, _ = run(LossConfig(objective="tis", rho=2.0, is_level=level))
        _, new, _ = run(LossConfig(objective="pg", correction=CorrectionConfig(kind="tis", cap=2.0, level=level)))
        close(new, old)


def test_the_correction_reads_the_batch_start_policy_not_pi():
    # several updates: pi_prox = mu here, so every weight is 1 and grpo keeps its pi / pi_prox clip
    _, plain, _ = run(LossConfig(objective="grpo"), proximal_logprobs=MU)
    _, corrected, m = run(LossConfig(objective="grpo", correction="icepop"), proximal_logprobs=MU)
    close(corrected, plain)
    assert m["correction/token_frac"] == 0.0 and m["correction/weight_max"] == 1.0
    assert bool((plain[0] != 0).any())  # not vacuous


def test_ppo_with_a_critic_takes_a_correction():
    values = torch.zeros(2, 2)
    fields = {"rewards": torch.tensor([1.0, 0.0]), "values": values}
    x = torch.tensor(LOGP, requires_grad=True)
    batch = {"behaviour_logprobs": MU, "completion_mask": MASK, "group_ids": torch.arange(2), **fields}
    loss, m = compute_loss(LossConfig(objective="ppo", correction="icepop"), x, batch)
    loss.backward()
    assert m["correction/token_frac"] == pytest.approx(1 / 3)
    assert float(x.grad[1, 0]) == 0.0 and bool((x.grad[0] != 0).all())  # the r = 8 token masked, the others train


# --- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: LossConfig(objective="aipo", correction=CorrectionConfig(kind="tis")), r"objective 'aipo', which already corrects the mismatch \(AIPO"),
        (lambda: LossConfig(objective="dppo", correction=CorrectionConfig(kind="icepop")), r"already corrects the mismatch \(DPPO"),
        (lambda: LossConfig(objective="tis", correction=CorrectionConfig(kind="seq_mask")), r"already corrects"),
        (lambda: CorrectionConfig(kind="icepop", low=2.0, high=1.5), r"low=2.0 > high=1.5"),
        (lambda: CorrectionConfig(kind="seq_mask", low=-0.1), r"must satisfy 0 <= low <= 1 <= high"),
        (lambda: CorrectionConfig(kind="icepop", high=0.9), r"must satisfy 0 <= low <= 1 <= high"),
        (lambda: CorrectionConfig(kind="tis", cap=0.5), r"cap=0.5 must be >= 1"),
        (lambda: CorrectionConfig(kind="icepop", cap=2.0), r"takes only \['high', 'low'\], not \['cap'\]"),
        (lambda: CorrectionConfig(kind="tis", high=float("inf")), r"takes only \['cap', 'level'\], not \['high'\]"),
        (lambda: LossConfig(objective="grpo", options={"kl_tau": 0.1}), r"options \['kl_tau'\] are not options of objective 'grpo'"),
        (lambda: LossConfig(objective="sapo", options={"tau_pos": 0.0}), r"temperatures tau_\* > 0"),
        (lambda: LossConfig(objective="dppo", options={"mask_high": -1.0}), r"must be >= 0"),
    ],
)
def test_bad_corrections_and_options_are_refused_by_name(make, match):
    with pytest.raises(ConfigError, match=match):
        make()
