"""RL objectives as pure tensor functions: advantages, AIPO (LlamaRL), plain policy gradient, GRPO/PPO-clip, a KL penalty.

Every loss takes per-token tensors ``[S, C]`` (S samples, C completion positions) and returns
``(loss, metrics)``: a scalar to minimise and python floats under namespaced keys. Token sums are
divided by ``normalizer`` (default: the number of real tokens, at least 1), so that a trainer that
accumulates micro-batches passes the whole batch's token count and gets exactly the whole batch's
gradient. Masked positions contribute nothing, whatever their values (even inf or nan).

AIPO (LlamaRL, Meta, arXiv 2505.24034), per token t of completion y of prompt x::

    loss = - sum_{i,t} min(pi(y_t | x, y_<t) / mu(y_t | x, y_<t), rho) * A(x, y) * log pi(y_t | x, y_<t) / normalizer

    gradient = - sum_{i,t} min(ratio, rho) * A * grad log pi / normalizer

The truncated ratio is a constant weight (no gradient flows through it); the truncation is one-sided
(it caps from above only), IMPALA/V-trace style. With pi == mu every weight is 1 and the loss is
REINFORCE with the group baseline.

Plain policy gradient (``pg``): REINFORCE with the same advantages, ignoring mu (no importance
ratio, no truncation); the baseline to show what AIPO's correction buys when mu != pi (a stale or
quantized generator)::

    loss = - sum_{i,t} A(x, y) * log pi(y_t | x, y_<t) / normalizer

GRPO / PPO-clip (Schulman et al. 2017; Shao et al. 2024)::

    loss = - sum_{i,t} min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) / normalizer

Advantages (``advantages``): ``A_i = r_i - b_i`` with ``b_i`` the mean reward of the samples of the
same prompt (LlamaRL's ``group_mean``) or the mean of the *other* samples of that prompt
(``leave_one_out``, 0 advantage for a prompt with one sample), optionally divided by the group's
reward standard deviation (population std, plus ``eps``; GRPO style).

Example:
    >>> r = torch.tensor([1.0, 0.0, 0.5, 0.5])
    >>> advantages(r, torch.tensor([0, 0, 1, 1]), baseline="group_mean", normalize_std=False).tolist()
    [0.5, -0.5, 0.0, 0.0]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from flowrl.errors import ConfigError
from flowrl.graph.configs import LossConfig

__all__ = [
    "masked_mean",
    "advantages",
    "combined_rewards",
    "aipo_loss",
    "pg_loss",
    "ppo_clip_loss",
    "kl_penalty",
    "LOSSES",
    "check_objective",
    "compute_loss",
]

LossFn = Callable[..., tuple[Tensor, dict[str, float]]]


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over ``mask``; 0 for an empty mask (never nan)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / mask.sum().clamp(min=1)


def _denominator(mask: Tensor, normalizer: float | None) -> Tensor | float:
    if normalizer is None:
        return mask.sum().clamp(min=1).to(torch.float32)
    if normalizer <= 0:
        raise ConfigError(f"normalizer={normalizer} must be > 0 (it is a token count)")
    return float(normalizer)


def advantages(
    rewards: Tensor,
    group_ids: Tensor,
    *,
    baseline: str = "group_mean",
    normalize_std: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """Per-sample advantages ``[S]`` against a per-prompt baseline (see the module docstring).

    Args:
        rewards: ``[S]`` rewards.
        group_ids: ``[S]`` int, equal for samples of the same prompt (any integers).
        baseline: ``"group_mean"`` or ``"leave_one_out"``.
        normalize_std: divide by the group's reward std (+ ``eps``).

    Raises:
        ConfigError: for an unknown baseline.
    """
    rewards = rewards.to(torch.float32)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(n_groups, device=rewards.device).index_add_(0, inverse, torch.ones_like(rewards))  # [G]
    total = torch.zeros(n_groups, device=rewards.device).index_add_(0, inverse, rewards)  # [G]
    mean = total / count
    if baseline == "group_mean":
        base = mean[inverse]
    elif baseline == "leave_one_out":
        others = (count[inverse] - 1).clamp(min=1)
        base = torch.where(count[inverse] > 1, (total[inverse] - rewards) / others, rewards)
    else:
        raise ConfigError(f"unknown advantage baseline {baseline!r}: use 'group_mean' or 'leave_one_out'")
    adv = rewards - base  # [S]
    if normalize_std:
        var = torch.zeros(n_groups, device=rewards.device).index_add_(0, inverse, (rewards - mean[inverse]) ** 2) / count
        adv = adv / (var.sqrt()[inverse] + eps)
    return adv


def combined_rewards(config: LossConfig, batch: Mapping[str, Tensor]) -> Tensor:
    """``sum_name weight * batch[name]`` over ``config.reward_weights``; ``[S]`` float32.

    Raises:
        ConfigError: naming a reward field the batch lacks.
    """
    total: Tensor | None = None
    for name, weight in sorted(config.reward_weights.items()):
        if name not in batch:
            raise ConfigError(
                f"loss reads reward field {name!r} (reward_weights={dict(config.reward_weights)}) but the batch has "
                f"only {sorted(batch)}; name each scorer's output in reward_weights"
            )
        term = weight * batch[name].to(torch.float32)
        total = term if total is None else total + term
    if total is None:
        raise ConfigError("loss has no reward field: reward_weights is empty")
    return total


@torch.no_grad()
def _ratio_metrics(prefix: str, log_ratio: Tensor, mask: Tensor, rho: float) -> dict[str, float]:
    """pi/mu over the real tokens: mean, max, the fraction above ``rho`` and KL(mu || pi) (k3 estimator)."""
    ratio = log_ratio.exp()
    return {
        f"{prefix}/ratio_mean": float(masked_mean(ratio, mask)),
        f"{prefix}/ratio_max": float(torch.where(mask, ratio, 0.0).max()) if mask.any() else 1.0,
        f"{prefix}/truncated_frac": float(masked_mean((ratio > rho).float(), mask)),
        f"{prefix}/kl": float(masked_mean(ratio - 1 - log_ratio, mask)),
    }


def aipo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    rho: float,
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """LlamaRL's AIPO loss (formula in the module docstring).

    Args:
        logprobs: ``[S, C]`` log pi, with gradients.
        behaviour_logprobs: ``[S, C]`` log mu recorded by the generator.
        advantages: ``[S]``.
        mask: ``[S, C]`` bool, True on real completion tokens.
        rho: upper cap of the importance ratio (>= 1).
        normalizer: divisor of the token sum (default: real tokens in ``mask``).

    Returns:
        ``(loss, metrics)`` with ``loss/policy``, ``aipo/ratio_mean``, ``aipo/ratio_max``,
        ``aipo/truncated_frac``, ``aipo/kl`` (KL(mu || pi), k3 estimator) and ``aipo/tokens``.
    """
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    log_ratio = torch.where(mask, logprobs.detach() - behaviour_logprobs, zero)  # [S, C]
    ratio = log_ratio.exp()
    weight = ratio.clamp(max=rho)  # one-sided truncation, a constant (no gradient)
    per_token = torch.where(mask, weight * advantages[:, None] * logprobs, zero)
    loss = -per_token.sum() / _denominator(mask, normalizer)
    metrics = {"loss/policy": float(loss.detach()), **_ratio_metrics("aipo", log_ratio, mask, rho), "aipo/tokens": float(mask.sum())}
    return loss, metrics


def pg_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    rho: float,
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Plain policy gradient (REINFORCE with the given advantages) that ignores mu.

    Arguments as ``aipo_loss``. mu and ``rho`` do not enter the loss; they only feed the metrics,
    which measure the mismatch the objective ignores: ``pg/ratio_mean``, ``pg/ratio_max``,
    ``pg/truncated_frac`` (the fraction of tokens AIPO with this ``rho`` would truncate), ``pg/kl``
    (KL(mu || pi), k3), besides ``loss/policy``.
    """
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    per_token = torch.where(mask, advantages[:, None] * logprobs, zero)  # [S, C]
    loss = -per_token.sum() / _denominator(mask, normalizer)
    log_ratio = torch.where(mask, logprobs.detach() - behaviour_logprobs, zero)
    return loss, {"loss/policy": float(loss.detach()), **_ratio_metrics("pg", log_ratio, mask, rho)}


def ppo_clip_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float,
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The PPO clipped surrogate with (group) advantages, i.e. GRPO's policy term.

    Arguments as ``aipo_loss``; ``clip_eps`` is the clip range. Metrics: ``loss/policy``,
    ``ppo/ratio_mean``, ``ppo/clip_frac``, ``ppo/kl``.
    """
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    log_ratio = torch.where(mask, logprobs - behaviour_logprobs, zero)  # [S, C], with gradient
    ratio = log_ratio.exp()
    adv = advantages[:, None]
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    loss = -torch.where(mask, surrogate, zero).sum() / _denominator(mask, normalizer)
    with torch.no_grad():
        r, lr = ratio.detach(), log_ratio.detach()
        metrics = {
            "loss/policy": float(loss.detach()),
            "ppo/ratio_mean": float(masked_mean(r, mask)),
            "ppo/clip_frac": float(masked_mean(((r - 1).abs() > clip_eps).float(), mask)),
            "ppo/kl": float(masked_mean(r - 1 - lr, mask)),
        }
    return loss, metrics


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, *, normalizer: float | None = None
) -> tuple[Tensor, dict[str, float]]:
    """KL(pi || ref) per token by the k3 estimator ``exp(ref - pi) - (ref - pi) - 1`` (>= 0), summed / normalizer.

    A token the truncated reference gives probability 0 (``ref_logprobs`` is ``-inf``: outside the
    reference's top-k/top-p kept set) would make the estimate infinite; it is left out (weight 0).

    Metric: ``loss/kl_ref``.
    """
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    mask = mask & ~torch.isneginf(ref_logprobs)
    ref_logprobs = torch.where(mask, ref_logprobs, zero)
    diff = torch.where(mask, ref_logprobs - logprobs, zero)
    kl = torch.where(mask, diff.exp() - diff - 1, zero)
    penalty = kl.sum() / _denominator(mask, normalizer)
    return penalty, {"loss/kl_ref": float(masked_mean(kl.detach(), mask))}


def _aipo(config: LossConfig, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, *, normalizer: float | None):
    return aipo_loss(logprobs, behaviour, adv, mask, rho=config.rho, normalizer=normalizer)


def _pg(config: LossConfig, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, *, normalizer: float | None):
    return pg_loss(logprobs, behaviour, adv, mask, rho=config.rho, normalizer=normalizer)


def _ppo_clip(config: LossConfig, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, *, normalizer: float | None):
    return ppo_clip_loss(logprobs, behaviour, adv, mask, clip_eps=config.clip_eps, normalizer=normalizer)


#: Objectives by ``LossConfig.objective``: ``fn(config, logprobs, behaviour_logprobs, advantages, mask, *, normalizer)``.
LOSSES: dict[str, LossFn] = {"aipo": _aipo, "pg": _pg, "grpo": _ppo_clip, "ppo_clip": _ppo_clip}


def check_objective(objective: str) -> None:
    """Raise ``ConfigError`` listing the known objectives if ``objective`` is not one of them."""
    if objective not in LOSSES:
        raise ConfigError(f"unknown loss objective {objective!r}: known objectives are {', '.join(sorted(LOSSES))}")


_advantages = advantages


def compute_loss(
    config: LossConfig,
    logprobs: Tensor,
    batch: Mapping[str, Tensor],
    *,
    advantages: Tensor | None = None,
    normalizer: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The loss a ``LossNode`` declares, over a rollout batch with its reward fields.

    Args:
        config: the loss node's config.
        logprobs: ``[S, C]`` log pi of ``batch["completion_ids"]``, with gradients.
        batch: rollout fields (``behaviour_logprobs``, ``completion_mask``, ``group_ids``), the reward
            fields of ``config.reward_weights`` and, with ``kl_coef > 0``, ``ref_logprobs``.
        advantages: ``[S]`` precomputed advantages (a micro-batch passes its slice of the whole
            batch's); computed from the batch's rewards when None.
        normalizer: divisor of token sums (see the module docstring).

    Returns:
        ``(loss, metrics)``: the objective's metrics plus ``loss/total`` and, with a KL penalty,
        ``loss/kl_ref``.

    Raises:
        ConfigError: for an unknown objective or a missing field.
    """
    check_objective(config.objective)
    for field in ("behaviour_logprobs", "completion_mask", "group_ids"):
        if field not in batch:
            raise ConfigError(f"loss {config.objective!r} needs batch field {field!r}; the batch has {sorted(batch)}")
    if advantages is None:
        rewards = combined_rewards(config, batch)
        advantages = _advantages(rewards, batch["group_ids"], baseline=config.baseline, normalize_std=config.normalize_std)
    mask = batch["completion_mask"]
    loss, metrics = LOSSES[config.objective](
        config, logprobs, batch["behaviour_logprobs"], advantages, mask, normalizer=normalizer
    )
    if config.kl_coef > 0:
        if "ref_logprobs" not in batch:
            raise ConfigError(
                f"loss has kl_coef={config.kl_coef} but the batch has no 'ref_logprobs': add a reference node "
                "feeding the loss, or set kl_coef=0"
            )
        penalty, kl_metrics = kl_penalty(logprobs, batch["ref_logprobs"], mask, normalizer=normalizer)
        loss = loss + config.kl_coef * penalty
        metrics.update(kl_metrics)
    metrics["loss/total"] = float(loss.detach())
    return loss, metrics
