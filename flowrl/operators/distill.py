"""On-policy distillation (``objective="opd"``): the student learns a teacher's per-token log-probs on its own samples.

A student (the policy) samples completions; a teacher node (``flowrl.graph.teacher``) scores every
sampled token. The per-token reverse KL, estimated on the sampled token ``y_t ~ mu`` (Agarwal et al.
2024, GKD; Thinking Machines' "On-policy distillation", 2025; verl's ``docs/algo/opd.md``)::

    k_t = log mu(y_t | x, y_<t) - log teacher(y_t | x, y_<t)        (E_{y_t ~ mu}[k_t] = KL(mu || teacher) at step t)

becomes a negative per-token advantage, summed with the reward's per-sample advantage ``A_i`` (the
group baseline of ``reward_weights``, ``flowrl.operators.losses.advantages``; all weights 0:
distillation alone)::

    A_{i,t} = A_i - distill_coef * k_{i,t}

trained with the truncated importance-sampled policy gradient (AIPO's, ``rho``), the advantage a
constant::

    loss = - agg_{i,t} min(pi_t / mu_t, rho) * A_{i,t} * log pi_t

Its gradient is the sampled-token estimate of ``distill_coef * grad KL(pi || teacher)`` (per token,
the reverse KL's score-function term without the future tokens' part), plus the reward's policy
gradient. ``mu``'s log-probs, not pi's, enter ``k``: the estimate is of the distribution that sampled,
and it stays the same over every optimizer step of the batch. The teacher scores at the rollout's
temperature over its whole vocabulary (``flowrl.operators.teacher``), so ``k`` is finite.

Metrics (every row): ``distill/reverse_kl`` (the mean of ``k`` over the completion tokens),
``distill/teacher_logprob`` (the mean of log teacher), ``distill/advantage`` (the mean of
``A_{i,t}``), the ratio's ``opd/ratio_mean``, ``opd/ratio_max``, ``opd/truncated_frac``, and
``loss/policy``.

This module computes the per-token terms (``opd_terms``); ``flowrl.operators.losses.LOSSES["opd"]``
aggregates them under the loss's ``loss_agg`` as every objective's terms are (so this module imports
nothing of ``losses``, which imports it).

Example:
    >>> mask = torch.tensor([[True, True]])
    >>> mu = torch.log(torch.tensor([[0.5, 0.25]]))
    >>> teacher = torch.log(torch.tensor([[0.5, 0.5]]))
    >>> per_token, m = opd_terms(mu.clone(), mu, teacher, torch.zeros(1), mask, coef=1.0, rho=4.0)
    >>> round(m["distill/reverse_kl"], 4), round(m["distill/advantage"], 4)
    (-0.3466, 0.3466)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["opd_terms", "opd_advantages", "distill_metrics"]


def _mean(x: Tensor, mask: Tensor) -> Tensor:
    """The mean of ``x`` over ``mask`` (0 for an empty mask)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / mask.sum().clamp(min=1)


def opd_advantages(advantages: Tensor, behaviour_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, *, coef: float) -> Tensor:
    """``A_{i,t} = A_i - coef * (log mu_t - log teacher_t)`` on the real tokens, 0 elsewhere; ``[S, C]``.

    ``advantages`` is ``[S]`` (per sample) or ``[S, C]`` (per token).
    """
    zero = torch.zeros((), dtype=behaviour_logprobs.dtype, device=mask.device)
    reverse_kl = torch.where(mask, behaviour_logprobs - teacher_logprobs, zero)
    base = advantages[:, None] if advantages.dim() == 1 else advantages
    return torch.where(mask, base - coef * reverse_kl, zero)


@torch.no_grad()
def distill_metrics(behaviour_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """The mean reverse KL ``log mu - log teacher`` and the mean ``log teacher`` over the real tokens."""
    zero = torch.zeros((), dtype=teacher_logprobs.dtype, device=mask.device)
    teacher = torch.where(mask, teacher_logprobs, zero)
    return {
        "distill/reverse_kl": float(_mean(torch.where(mask, behaviour_logprobs, zero) - teacher, mask)),
        "distill/teacher_logprob": float(_mean(teacher, mask)),
    }


def opd_terms(
    logprobs: Tensor, behaviour_logprobs: Tensor, teacher_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, coef: float, rho: float
) -> tuple[Tensor, dict[str, float]]:
    """The OPD loss's per-token terms ``min(pi_t / mu_t, rho) * A_{i,t} * log pi_t`` (``[S, C]``, 0 off the mask; the
    loss is minus their aggregate) and its metrics but ``loss/policy`` (module docstring).

    Args:
        logprobs: ``[S, C]`` log pi, with gradients.
        behaviour_logprobs: ``[S, C]`` log mu recorded by the generator.
        teacher_logprobs: ``[S, C]`` log teacher of the same tokens (a teacher node's ``teacher_logprobs``).
        advantages: ``[S]`` the reward's advantages (zeros: distillation alone).
        mask: ``[S, C]`` bool, True on real completion tokens.
        coef: ``distill_coef``, the weight of the reverse-KL advantage.
        rho: the importance ratio's one-sided cap.
    """
    zero = torch.zeros((), dtype=logprobs.dtype, device=mask.device)
    adv = opd_advantages(advantages, behaviour_logprobs, teacher_logprobs, mask, coef=coef)
    log_ratio = torch.where(mask, logprobs.detach() - behaviour_logprobs, zero)
    ratio = log_ratio.exp()
    weight = ratio.clamp(max=rho)  # a constant (no gradient), AIPO's truncation
    per_token = torch.where(mask, weight * adv * logprobs, zero)
    with torch.no_grad():
        metrics = {
            **distill_metrics(behaviour_logprobs, teacher_logprobs, mask),
            "distill/advantage": float(_mean(adv, mask)),
            "opd/ratio_mean": float(_mean(ratio, mask)),
            "opd/ratio_max": float(torch.where(mask, ratio, zero).max()) if mask.any() else 1.0,
            "opd/truncated_frac": float(_mean((ratio > rho).to(logprobs.dtype), mask)),
        }
    return per_token, metrics
