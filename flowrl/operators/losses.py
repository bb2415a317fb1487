"""RL objectives as pure tensor functions: advantages, AIPO (LlamaRL), plain policy gradient, GRPO/PPO-clip
(with DAPO's clip-higher), GSPO, CISPO, SAPO, DPPO, truncated and masked IS, a KL penalty.

Every loss takes per-token tensors ``[S, C]`` (S samples, C completion positions) and returns
``(loss, metrics)``: a scalar to minimise and python floats under namespaced keys. Per-token terms are
reduced by ``aggregate`` under ``loss_agg`` (below; the formulas here show the default ``token_mean``:
token sums divided by ``normalizer``, by default the number of real tokens, at least 1), so that a
trainer that accumulates micro-batches passes the whole batch's count and gets exactly the whole
batch's gradient. Masked positions contribute nothing, whatever their values (even inf or nan).

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

PPO with a critic (``ppo``): the same clipped surrogate with token-level advantages ``A_{i,t}``, a
critic's GAE (``flowrl.operators.gae``, whitened over the batch's tokens) instead of a group baseline;
the critic's own clipped value loss is ``flowrl.operators.critic.value_loss``.

Asymmetric clipping (DAPO's clip-higher, Yu et al. 2025, arXiv 2503.14476): ``clip(ratio, 1 - eps_low,
1 + eps_high)``; ``LossConfig.clip_range()`` (both default to ``clip_eps``).

GSPO (Zheng et al. 2025, arXiv 2507.18071): the ratio of a whole sequence, the geometric mean of its
tokens' ratios, ``s_i = exp(1/|y_i| sum_t (log pi - log mu))``, clipped at the sequence level; in its
token form ``s_{i,t} = sg[s_i] * pi_t / sg[pi_t]`` (value ``s_i``, gradient ``s_i * grad log pi_t``), so that
with ``loss_agg="seq_mean"`` it is GSPO's objective exactly::

    loss = - agg_{i,t} min(s_{i,t} * A_i, clip(s_{i,t}, 1 - eps_low, 1 + eps_high) * A_i)

CISPO (MiniMax-M1, arXiv 2506.13585): the clipped importance weight is a constant coefficient of
log pi, so no token loses its gradient (PPO's clip drops it)::

    loss = - agg_{i,t} sg[clip(ratio, 1 - eps_low, 1 + eps_high)] * A_i * log pi_t

(AIPO is CISPO without a lower bound and with ``1 + eps_high = rho``.)

Off-policy corrections of the policy gradient for a behaviour policy mu != pi (Yao et al. 2025,
"Your efficient RL framework secretly brings you off-policy RL training", truncated IS; Liu et al.
2025, "When speed kills stability", masked IS), the weight a constant (no gradient), the ratio per
token (``r_t = pi_t / mu_t``) or per sequence (``r_i = prod_t r_t``, ``is_level="sequence"``)::

    tis:  loss = - agg_{i,t} min(r, C) * A_i * log pi_t                       (C = rho)
    mis:  loss = - agg_{i,t} r * 1[low <= r <= high] * A_i * log pi_t        ([low, high] = [rho_low, rho])

(``tis`` per token is ``aipo``.)

Decoupled PPO (AReaL, Fu et al. 2025, arXiv 2505.24298; Hilton et al. 2021's decoupled objective): the
trust region is around the proximal policy pi_prox (the trainer's weights at the start of the batch,
``proximal_logprobs``: with several updates per batch, the "old" policy), not around the behaviour
policy mu that sampled; the off-policy gap mu -> pi_prox is corrected by a constant importance weight,
dropped above ``rho`` (AReaL's ``behav_imp_weight_cap``)::

    w = sg[pi_prox / mu] * 1[pi_prox / mu <= rho],    r = pi / pi_prox
    loss = - agg_{i,t} w * min(r * A_i, clip(r, 1 - eps_low, 1 + eps_high) * A_i)

(With one update per batch r = 1 in value, and the gradient is ``w * A * grad log pi``.)

DPPO (``dppo_loss``, prime-rl's default) masks a token whose probability moved too far from mu's in
the advantage's direction and adds a squared log-ratio KL; SAPO (``sapo_loss``, Qwen) replaces PPO's
clip by a smooth sigmoid gate (formulas in their docstrings).

Each objective is a row of ``flowrl.graph.objectives`` (what it reads, what its ratio is anchored at,
its advantages, the correction it applies itself, its options); ``LOSSES`` holds the built-in rows'
functions by name, ``compute_loss`` reads the row. The old policy of the PPO-style objectives
(``anchored_at_old``: ``grpo``, ``ppo_clip``, ``ppo``, ``gspo``, ``cispo``, ``sapo``, whose ``ratio``
is clipped or gated): with several updates per batch (``num_iterations`` or ``num_mini_batches`` > 1)
the trainer computes log pi_old, the policy at the batch's start (``proximal_logprobs``; TRL's
``old_per_token_logps``), and the ratio is ``pi / pi_old``, as TRL takes it; with one update per batch
it is ``pi / mu`` (the engine's recorded log-probs: PPO's old policy when the generator is on-policy,
and a correction of a stale batch's k >= 1 versions otherwise), or ``pi / pi`` (1 in value) under a
rollout correction, which then carries the whole pi_old / mu gap (``flowrl.graph.corrections``: each
token's gradient scaled by a truncated or masked weight of that ratio, ``flowrl.operators.corrections``).
``aipo``, ``tis``, ``mis`` and ``dppo`` are corrections towards mu and always take ``pi / mu``; ``pg``
takes no ratio.

Aggregation (``loss_agg``, TRL's ``loss_type``), over per-token terms ``l_{i,t}`` and mask ``m``::

    token_mean: sum_{i,t} m * l / N_tokens                         (TRL dapo; bnpo over the whole batch)
    seq_mean:   sum_i (sum_t m * l / max(|y_i|, 1)) / N_sequences   (TRL grpo)
    dr_grpo:    sum_{i,t} m * l / (N_sequences * C)                 (TRL dr_grpo; C: the completion width, max_new_tokens)

The counts ``N`` are the whole batch's (``batch_normalizer``): a trainer accumulating micro-batches,
or data-parallel ranks weighting their gradients by their share of it, get one big batch's gradient.

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

import math
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from flowrl.errors import ConfigError, GraphError
from flowrl.graph.configs import LOSS_AGGREGATIONS, LossConfig
from flowrl.graph.objectives import ANCHORED_AT_OLD, NEEDS_PROXIMAL, READ_FIELDS, ObjectiveRow, known_objectives, row_of
from flowrl.graph.refs import resolve
from flowrl.operators.corrections import apply_weights, correction_weights
from flowrl.operators.gae import gae, whiten
from flowrl.operators.distill import opd_terms  # on-policy distillation's per-token terms

__all__ = [
    "masked_mean",
    "advantages",
    "loss_advantages",
    "combined_rewards",
    "aipo_loss",
    "pg_loss",
    "ppo_clip_loss",
    "gspo_loss",
    "cispo_loss",
    "is_loss",
    "decoupled_ppo_loss",
    "dppo_loss",
    "sapo_loss",
    "proximal_metrics",
    "kl_penalty",
    "aggregate",
    "batch_normalizer",
    "LOSSES",
    "NEEDS_PROXIMAL",
    "ANCHORED_AT_OLD",
    "check_objective",
    "objective_function",
    "compute_loss",
    "aipo_objective",
    "pg_objective",
    "ppo_clip_objective",
    "gspo_objective",
    "cispo_objective",
    "tis_objective",
    "mis_objective",
    "decoupled_ppo_objective",
    "dppo_objective",
    "sapo_objective",
]

LossFn = Callable[..., tuple[Tensor, dict[str, float]]]


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over ``mask``; 0 for an empty mask (never nan)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / mask.sum().clamp(min=1)


def batch_normalizer(mask: Tensor, agg: str = "token_mean") -> float:
    """The divisor of the whole batch's term sum under ``agg`` (module docstring), at least 1:
    real tokens (``token_mean``), sequences (``seq_mean``), sequences * width (``dr_grpo``).

    Example:
        >>> m = torch.tensor([[True, True, False], [True, False, False]])
        >>> [batch_normalizer(m, a) for a in ("token_mean", "seq_mean", "dr_grpo")]
        [3.0, 2.0, 6.0]

    Raises:
        ConfigError: for an unknown ``agg``.
    """
    S, C = mask.shape  # [S, C]
    if agg == "token_mean":
        return float(max(int(mask.sum()), 1))
    if agg == "seq_mean":
        return float(max(S, 1))
    if agg == "dr_grpo":
        return float(max(S * C, 1))
    raise ConfigError(f"unknown loss_agg {agg!r}: use one of {', '.join(LOSS_AGGREGATIONS)}")


def aggregate(
    per_token: Tensor, mask: Tensor, *, agg: str = "token_mean", normalizer: float | None = None, lengths: Tensor | None = None
) -> Tensor:
    """The per-token terms ``[S, C]`` reduced to a scalar under ``agg`` (module docstring).

    Args:
        per_token: ``[S, C]`` terms; masked positions are ignored whatever their values.
        mask: ``[S, C]`` bool.
        agg: ``"token_mean"``, ``"seq_mean"`` or ``"dr_grpo"``.
        normalizer: the whole batch's divisor (``batch_normalizer`` of the whole batch); default: this
            batch's.
        lengths: ``[S]`` each sequence's token count for ``seq_mean`` (default ``mask.sum(1)``; a trainer
            that masks some tokens out passes the real lengths).

    Raises:
        ConfigError: for an unknown ``agg`` or a normalizer <= 0.
    """
    if normalizer is None:
        normalizer = batch_normalizer(mask, agg)
    elif normalizer <= 0:
        raise ConfigError(f"normalizer={normalizer} must be > 0 (a count of tokens or sequences)")
    x = torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))  # [S, C]
    if agg == "seq_mean":
        lengths = mask.sum(1) if lengths is None else lengths  # [S]
        x = x.sum(1) / lengths.clamp(min=1).to(x.dtype)  # [S]
    elif agg not in LOSS_AGGREGATIONS:
        raise ConfigError(f"unknown loss_agg {agg!r}: use one of {', '.join(LOSS_AGGREGATIONS)}")
    return x.sum() / float(normalizer)


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


def loss_advantages(config: LossConfig, rewards: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
    """The advantages ``config``'s objective trains on (its row's ``advantages``): a critic's whitened
    GAE ``[S, C]`` for ``"gae"`` (``flowrl.operators.gae``, ``gamma``, ``lam``), else per-sample group
    advantages ``[S]`` (``advantages``).

    Raises:
        ConfigError: a critic objective and a batch without ``values``.
    """
    if _row(config).advantages == "gae":
        if "values" not in batch:
            raise ConfigError(f"objective {config.objective!r} needs a critic's 'values' in the batch (it has {sorted(batch)}): list a critic in the loss")
        mask = batch["completion_mask"]
        adv, _ = gae(rewards, batch["values"], mask, gamma=config.gamma, lam=config.lam)
        return whiten(adv, mask)
    return advantages(rewards, batch["group_ids"], baseline=config.baseline, normalize_std=config.normalize_std)


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
    agg: str = "token_mean",
    lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """LlamaRL's AIPO loss (formula in the module docstring).

    Args:
        logprobs: ``[S, C]`` log pi, with gradients.
        behaviour_logprobs: ``[S, C]`` log mu recorded by the generator.
        advantages: ``[S]``.
        mask: ``[S, C]`` bool, True on real completion tokens.
        rho: upper cap of the importance ratio (>= 1).
        normalizer: the whole batch's divisor (``batch_normalizer``; default: this batch's).
        agg: ``loss_agg`` (``aggregate``); ``lengths``: ``[S]`` sequence lengths for ``seq_mean``.

    Returns:
        ``(loss, metrics)`` with ``loss/policy``, ``aipo/ratio_mean``, ``aipo/ratio_max``,
        ``aipo/truncated_frac``, ``aipo/kl`` (KL(mu || pi), k3 estimator) and ``aipo/tokens``.
    """
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    log_ratio = torch.where(mask, logprobs.detach() - behaviour_logprobs, zero)  # [S, C]
    ratio = log_ratio.exp()
    weight = ratio.clamp(max=rho)  # one-sided truncation, a constant (no gradient)
    per_token = weight * advantages[:, None] * logprobs  # [S, C]
    loss = -aggregate(per_token, mask, agg=agg, normalizer=normalizer, lengths=lengths)
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
    agg: str = "token_mean",
    lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Plain policy gradient (REINFORCE with the given advantages) that ignores mu.

    Arguments as ``aipo_loss``. mu and ``rho`` do not enter the loss; they only feed the metrics,
    which measure the mismatch the objective ignores: ``pg/ratio_mean``, ``pg/ratio_max``,
    ``pg/truncated_frac`` (the fraction of tokens AIPO with this ``rho`` would truncate), ``pg/kl``
    (KL(mu || pi), k3), besides ``loss/policy``.
    """
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    per_token = advantages[:, None] * logprobs  # [S, C]
    loss = -aggregate(per_token, mask, agg=agg, normalizer=normalizer, lengths=lengths)
    log_ratio = torch.where(mask, logprobs.detach() - behaviour_logprobs, zero)
    return loss, {"loss/policy": float(loss.detach()), **_ratio_metrics("pg", log_ratio, mask, rho)}


def _clipped_surrogate(ratio: Tensor, adv: Tensor, low: float, high: float) -> Tensor:
    """PPO's pessimistic surrogate ``min(ratio * A, clip(ratio, 1 - low, 1 + high) * A)``, elementwise."""
    return torch.min(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)


@torch.no_grad()
def _clip_metrics(prefix: str, ratio: Tensor, log_ratio: Tensor, mask: Tensor, low: float, high: float) -> dict[str, float]:
    below, above = (ratio < 1 - low).float(), (ratio > 1 + high).float()
    return {
        f"{prefix}/ratio_mean": float(masked_mean(ratio, mask)),
        f"{prefix}/clip_frac": float(masked_mean(below + above, mask)),
        f"{prefix}/clip_frac_low": float(masked_mean(below, mask)),
        f"{prefix}/clip_frac_high": float(masked_mean(above, mask)),
        f"{prefix}/kl": float(masked_mean(ratio - 1 - log_ratio, mask)),
    }


def ppo_clip_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float,
    clip_eps_high: float | None = None,
    normalizer: float | None = None,
    agg: str = "token_mean",
    lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The PPO clipped surrogate with (group) advantages, i.e. GRPO's policy term.

    Arguments as ``aipo_loss``; the clip interval is ``[1 - clip_eps, 1 + clip_eps_high]``
    (``clip_eps_high`` defaults to ``clip_eps``; DAPO's clip-higher raises it). Metrics: ``loss/policy``,
    ``ppo/ratio_mean``, ``ppo/clip_frac`` (ratio outside the interval), ``ppo/clip_frac_low``,
    ``ppo/clip_frac_high``, ``ppo/kl``.
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    log_ratio = torch.where(mask, logprobs - behaviour_logprobs, zero)  # [S, C], with gradient
    ratio = log_ratio.exp()
    adv = advantages if advantages.dim() == 2 else advantages[:, None]  # [S, C] per token (a critic's GAE) or [S] per sample
    surrogate = _clipped_surrogate(ratio, adv, clip_eps, high)  # [S, C]
    loss = -aggregate(surrogate, mask, agg=agg, normalizer=normalizer, lengths=lengths)
    metrics = {"loss/policy": float(loss.detach()), **_clip_metrics("ppo", ratio.detach(), log_ratio.detach(), mask, clip_eps, high)}
    return loss, metrics


def gspo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    normalizer: float | None = None,
    agg: str = "token_mean",
    lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO's sequence-level clipped objective in its token form (module docstring).

    Arguments as ``aipo_loss``; the clip interval of the sequence ratio is ``[1 - clip_eps_low,
    1 + clip_eps_high]`` (the GSPO paper uses 3e-4 and 4e-4). Metrics: ``loss/policy``,
    ``gspo/ratio_mean`` (mean sequence ratio over the sequences with tokens), ``gspo/clip_frac``
    (fraction of those clipped), ``gspo/clip_frac_low``, ``gspo/clip_frac_high``, ``gspo/kl`` (the k3
    estimate on the sequence log-ratios).
    """
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    token_log_ratio = torch.where(mask, logprobs - behaviour_logprobs, zero)  # [S, C]
    log_s = token_log_ratio.sum(1) / mask.sum(1).clamp(min=1)  # [S], log of the geometric mean
    log_s_token = log_s.detach()[:, None] + logprobs - logprobs.detach()  # [S, C]: value log s_i, gradient grad log pi_t
    ratio = torch.where(mask, log_s_token, zero).exp()
    surrogate = _clipped_surrogate(ratio, advantages[:, None], clip_eps_low, clip_eps_high)  # [S, C]
    loss = -aggregate(surrogate, mask, agg=agg, normalizer=normalizer, lengths=lengths)
    has = mask.any(1)  # [S]
    s = log_s.detach().exp()
    metrics = {"loss/policy": float(loss.detach()), **_clip_metrics("gspo", s, log_s.detach(), has, clip_eps_low, clip_eps_high)}
    return loss, metrics


def cispo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    normalizer: float | None = None,
    agg: str = "token_mean",
    lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO: ``- agg sg[clip(ratio, 1 - clip_eps_low, 1 + clip_eps_high)] * A * log pi`` (module docstring).

    Arguments as ``aipo_loss``. MiniMax-M1 sets no lower bound (``clip_eps_low=1``) and tunes the upper
    one. Metrics: ``loss/policy``, ``cispo/ratio_mean``, ``cispo/clip_frac`` (weights clipped),
    ``cispo/clip_frac_low``, ``cispo/clip_frac_high``, ``cispo/kl``.
    """
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    log_ratio = torch.where(mask, logprobs.detach() - behaviour_logprobs, zero)  # [S, C], no gradient
    ratio = log_ratio.exp()
    weight = ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)  # a constant coefficient
    per_token = weight * advantages[:, None] * logprobs  # [S, C]
    loss = -aggregate(per_token, mask, agg=agg, normalizer=normalizer, lengths=lengths)
    metrics = {"loss/policy": float(loss.detach()), **_clip_metrics("cispo", ratio, log_ratio, mask, clip_eps_low, clip_eps_high)}
    return loss, metrics


def is_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    mode: str,
    level: str = "token",
    high: float,
    low: float = 0.0,
    normalizer: float | None = None,
    agg: str = "token_mean",
    lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Policy gradient corrected by truncated (``mode="truncate"``, ``tis``) or masked (``mode="mask"``,
    ``mis``) importance sampling, per token or per sequence (module docstring).

    Arguments as ``aipo_loss``; ``high`` is the cap C (``truncate``) or the upper bound (``mask``),
    ``low`` the lower bound of ``mask``; ``level`` is ``"token"`` or ``"sequence"`` (the ratio of a
    sequence is the product of its tokens' ratios, every token of it weighted by it). Metrics, under
    ``tis/`` or ``mis/``: ``weight_mean`` (the weights over the real tokens), ``truncated_frac`` or
    ``masked_frac`` (fraction of tokens whose ratio was capped or dropped), ``kl`` (KL(mu || pi), k3, per
    token).

    Raises:
        ConfigError: for an unknown mode or level.
    """
    if mode not in ("truncate", "mask") or level not in ("token", "sequence"):
        raise ConfigError(f"is_loss: mode={mode!r} must be 'truncate' or 'mask', level={level!r} 'token' or 'sequence'")
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    token_log_ratio = torch.where(mask, logprobs.detach() - behaviour_logprobs, zero)  # [S, C], no gradient
    log_r = token_log_ratio if level == "token" else token_log_ratio.sum(1, keepdim=True).expand_as(token_log_ratio)
    if mode == "truncate":
        weight = log_r.clamp(max=math.log(high)).exp()  # min(r, C), without overflow for a long sequence
        hit = log_r > math.log(high)
    else:
        keep = (log_r <= math.log(high)) & (log_r >= (math.log(low) if low > 0 else -math.inf))
        weight = torch.where(keep, log_r.clamp(max=math.log(high)).exp(), zero)  # r inside [low, high], else 0
        hit = ~keep
    per_token = weight * advantages[:, None] * logprobs  # [S, C]
    loss = -aggregate(per_token, mask, agg=agg, normalizer=normalizer, lengths=lengths)
    prefix = "tis" if mode == "truncate" else "mis"
    with torch.no_grad():
        r = token_log_ratio.exp()
        metrics = {
            "loss/policy": float(loss.detach()),
            f"{prefix}/weight_mean": float(masked_mean(weight, mask)),
            f"{prefix}/{'truncated' if mode == 'truncate' else 'masked'}_frac": float(masked_mean(hit.float(), mask)),
            f"{prefix}/kl": float(masked_mean(r - 1 - token_log_ratio, mask)),
        }
    return loss, metrics


def decoupled_ppo_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    cap: float | None = None,
    normalizer: float | None = None,
    agg: str = "token_mean",
    lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """AReaL's decoupled PPO (module docstring): PPO-clip of ``pi / pi_prox``, weighted by the constant
    ``pi_prox / mu``, a token whose weight exceeds ``cap`` dropped (weight 0; None: no cap).

    Args:
        logprobs: ``[S, C]`` log pi, with gradients.
        proximal_logprobs: ``[S, C]`` log pi_prox (no gradient), the trainer's weights at the batch's start.
        behaviour_logprobs: ``[S, C]`` log mu recorded by the generator.
        advantages, mask, normalizer, agg, lengths: as ``aipo_loss``.
        clip_eps_low, clip_eps_high: the clip interval ``[1 - clip_eps_low, 1 + clip_eps_high]`` of ``pi / pi_prox``.

    Returns:
        ``(loss, metrics)`` with ``loss/policy``, ``dppo/ratio_mean`` (pi / pi_prox), ``dppo/clip_frac``,
        ``dppo/clip_frac_low``, ``dppo/clip_frac_high``, ``dppo/kl`` (KL(pi_prox || pi), k3),
        ``dppo/behav_weight_mean`` (pi_prox / mu over the kept tokens), ``dppo/behav_masked_frac``
        (tokens dropped by the cap) and ``dppo/behav_kl`` (KL(mu || pi_prox), k3).

    Example (one token, pi = pi_prox = 0.5, mu = 0.25: weight 2, gradient -2 * A):
        >>> lp = torch.tensor([[math.log(0.5)]], requires_grad=True)
        >>> loss, m = decoupled_ppo_loss(lp, lp.detach(), torch.tensor([[math.log(0.25)]]), torch.tensor([1.0]),
        ...                              torch.tensor([[True]]), clip_eps_low=0.2, clip_eps_high=0.2)
        >>> loss.backward(); float(lp.grad), m["dppo/behav_weight_mean"]
        (-2.0, 2.0)
    """
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    prox = proximal_logprobs.detach()
    log_ratio = torch.where(mask, logprobs - prox, zero)  # [S, C], log pi / pi_prox, with gradient
    ratio = log_ratio.exp()
    behav_log = torch.where(mask, prox - behaviour_logprobs, zero)  # [S, C], log pi_prox / mu, a constant
    kept = mask if cap is None else mask & (behav_log <= math.log(cap))
    weight = torch.where(kept, behav_log.exp(), zero)  # dropped above the cap, as AReaL's behav_imp_weight_cap
    surrogate = weight * _clipped_surrogate(ratio, advantages[:, None], clip_eps_low, clip_eps_high)  # [S, C]
    loss = -aggregate(surrogate, mask, agg=agg, normalizer=normalizer, lengths=lengths)
    with torch.no_grad():
        metrics = {
            "loss/policy": float(loss.detach()),
            **_clip_metrics("dppo", ratio.detach(), log_ratio.detach(), mask, clip_eps_low, clip_eps_high),
            "dppo/behav_weight_mean": float(masked_mean(weight, kept)),
            "dppo/behav_masked_frac": float(masked_mean((mask & ~kept).float(), mask)),
            "dppo/behav_kl": float(masked_mean((-behav_log).exp() - 1 + behav_log, mask)),
        }
    return loss, metrics


def dppo_loss(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    mask_low: float = 0.2,
    mask_high: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
    normalizer: float | None = None,
    agg: str = "token_mean",
    lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """DPPO with a squared log-ratio KL, prime-rl's default loss (``default_loss_fn`` in
    ``src/prime_rl/trainer/rl/loss.py`` of github.com/PrimeIntellect-ai/prime-rl: DPPO-Binary TV,
    arXiv 2602.04879, with Kimi-K2.5's KL term, arXiv 2602.02276; defaults as its ``DefaultLossConfig``).

    The trust region is on the probability difference ``d_t = pi_t - mu_t`` against the engine's
    policy, by the advantage's sign: a token whose probability already rose by more than
    ``mask_high`` (``A > 0``) or fell by more than ``mask_low`` (otherwise) is masked from the
    policy term; every real token keeps the KL term::

        keep_t = (d_t <= mask_high) if A > 0 else (d_t >= -mask_low)
        loss = agg_{i,t} [ - keep_t adv_tau A r_t + kl_tau (log r_t)^2 ],   r_t = pi_t / mu_t (with gradient)

    Args:
        logprobs, behaviour_logprobs, mask, normalizer, agg, lengths: as ``aipo_loss``.
        advantages: ``[S]`` or ``[S, C]``.
        mask_low, mask_high: the band of ``pi - mu`` (probabilities, >= 0).
        adv_tau, kl_tau: the weights of the policy and the KL terms (>= 0).

    Returns:
        ``(loss, metrics)`` with ``loss/policy``, ``dppo_tv/ratio_mean``, ``dppo_tv/masked_frac``,
        ``dppo_tv/masked_frac_high`` (A > 0 masked), ``dppo_tv/masked_frac_low`` (A < 0 masked),
        ``dppo_tv/kl`` (KL(mu || pi), k3) and ``dppo_tv/kl_term`` (mean (log r)^2).

    Example (pi = 0.5, mu = 0.25, A = 1: d = 0.25 > 0.2, the policy term masked; the KL term's gradient
    2 kl_tau log 2):
        >>> lp = torch.tensor([[math.log(0.5)]], requires_grad=True)
        >>> loss, m = dppo_loss(lp, torch.tensor([[math.log(0.25)]]), torch.tensor([1.0]), torch.tensor([[True]]))
        >>> loss.backward(); round(float(lp.grad), 6), m["dppo_tv/masked_frac_high"]
        (0.001386, 1.0)
    """
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    adv = advantages if advantages.dim() == 2 else advantages[:, None]  # [S, C] or [S, 1]
    log_ratio = torch.where(mask, logprobs - behaviour_logprobs, zero)  # [S, C], with gradient
    ratio = log_ratio.exp()
    with torch.no_grad():
        diff = torch.where(mask, logprobs.detach().exp() - behaviour_logprobs.exp(), zero)  # [S, C]
        high, low = diff > mask_high, diff < -mask_low
        masked = torch.where(adv > 0, high, low) & mask
    policy = torch.where(masked, zero, adv_tau * adv * ratio)
    per_token = -policy + kl_tau * log_ratio**2  # [S, C]
    loss = aggregate(per_token, mask, agg=agg, normalizer=normalizer, lengths=lengths)
    with torch.no_grad():
        lr, r = log_ratio.detach(), ratio.detach()
        metrics = {
            "loss/policy": float(loss.detach()),
            "dppo_tv/ratio_mean": float(masked_mean(r, mask)),
            "dppo_tv/masked_frac": float(masked_mean(masked.float(), mask)),
            "dppo_tv/masked_frac_high": float(masked_mean((masked & (adv > 0)).float(), mask)),
            "dppo_tv/masked_frac_low": float(masked_mean((masked & (adv < 0)).float(), mask)),
            "dppo_tv/kl": float(masked_mean(r - 1 - lr, mask)),
            "dppo_tv/kl_term": float(masked_mean(lr**2, mask)),
        }
    return loss, metrics


def sapo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    normalizer: float | None = None,
    agg: str = "token_mean",
    lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """SAPO, Soft Adaptive Policy Optimization (Gao et al. 2025, Qwen, arXiv 2511.20347): PPO's hard
    clip replaced by a smooth gate of the token ratio, steeper for negative advantages::

        loss = - agg_{i,t} (4 / tau) sigmoid(tau (r_t - 1)) A,   tau = tau_pos if A > 0 else tau_neg,  r_t = pi_t / pi_old_t

    Its gradient is ``4 s (1 - s) r A grad log pi`` with ``s = sigmoid(tau (r - 1))``: ``A grad log
    pi`` at ``r = 1``, fading smoothly as r leaves 1. Chosen over M2PO and KPop as the one of the
    three shipped most widely (verl, AReaL, TRL-style trainers, torchforge, Trinity-RFT list it;
    Qwen3-VL trained with it).

    Args:
        logprobs, mask, normalizer, agg, lengths: as ``aipo_loss``.
        old_logprobs: ``[S, C]`` log pi_old (the anchor: pi_prox, or mu with one update a batch).
        advantages: ``[S]`` or ``[S, C]``.
        tau_pos, tau_neg: the gate's temperatures (> 0; the paper's 1.0 and 1.05).

    Returns:
        ``(loss, metrics)`` with ``loss/policy``, ``sapo/ratio_mean``, ``sapo/gate_mean`` (the mean
        gradient factor ``4 s (1 - s)``, 1 on-policy) and ``sapo/kl`` (KL(pi_old || pi), k3).

    Example (on-policy, r = 1: the gradient is REINFORCE's, -A):
        >>> lp = torch.tensor([[-1.0]], requires_grad=True)
        >>> loss, m = sapo_loss(lp, lp.detach(), torch.tensor([2.0]), torch.tensor([[True]]))
        >>> loss.backward(); float(lp.grad), m["sapo/gate_mean"]
        (-2.0, 1.0)
    """
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    log_ratio = torch.where(mask, logprobs - old_logprobs, zero)  # [S, C], with gradient
    ratio = log_ratio.exp()
    tau = torch.where(adv > 0, torch.tensor(tau_pos, device=mask.device), torch.tensor(tau_neg, device=mask.device))  # [S, C] or [S, 1]
    gate = torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau)
    loss = -aggregate(gate * adv, mask, agg=agg, normalizer=normalizer, lengths=lengths)
    with torch.no_grad():
        sig = torch.sigmoid(tau * (ratio.detach() - 1))
        lr, r = log_ratio.detach(), ratio.detach()
        metrics = {
            "loss/policy": float(loss.detach()),
            "sapo/ratio_mean": float(masked_mean(r, mask)),
            "sapo/gate_mean": float(masked_mean((4 * sig * (1 - sig)).expand_as(r), mask)),
            "sapo/kl": float(masked_mean(r - 1 - lr, mask)),
        }
    return loss, metrics


@torch.no_grad()
def proximal_metrics(logprobs: Tensor, proximal_logprobs: Tensor, mask: Tensor, *, clip_eps_low: float, clip_eps_high: float) -> dict[str, float]:
    """pi against the proximal ("old") policy, the trainer's weights at the batch's start, over ``mask``:
    ``old/ratio_mean``, ``old/ratio_max``, ``old/clip_frac`` (ratio outside ``[1 - clip_eps_low, 1 +
    clip_eps_high]``), ``old/kl`` (KL(pi_old || pi), k3). The first update of a batch has ratio 1.

    Example:
        >>> m = proximal_metrics(torch.tensor([[0.0, math.log(2.0)]]), torch.zeros(1, 2), torch.tensor([[True, True]]),
        ...                      clip_eps_low=0.2, clip_eps_high=0.2)
        >>> m["old/ratio_mean"], m["old/ratio_max"], m["old/clip_frac"]
        (1.5, 2.0, 0.5)
    """
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    log_ratio = torch.where(mask, logprobs.float() - proximal_logprobs.float(), zero)  # [S, C]
    ratio = log_ratio.exp()
    clip = _clip_metrics("old", ratio, log_ratio, mask, clip_eps_low, clip_eps_high)
    return {
        "old/ratio_mean": clip["old/ratio_mean"],
        "old/ratio_max": float(torch.where(mask, ratio, zero).max()) if mask.any() else 1.0,
        "old/clip_frac": clip["old/clip_frac"],
        "old/kl": clip["old/kl"],
    }


def kl_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    normalizer: float | None = None,
    agg: str = "token_mean",
    lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """KL(pi || ref) per token by the k3 estimator ``exp(ref - pi) - (ref - pi) - 1`` (>= 0), aggregated
    as the policy term (``aggregate``).

    A token the truncated reference gives probability 0 (``ref_logprobs`` is ``-inf``: outside the
    reference's top-k/top-p kept set) would make the estimate infinite; it is left out (weight 0, still
    counted in the normaliser and in its sequence's length).

    Metric: ``loss/kl_ref``.
    """
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    lengths = mask.sum(1) if lengths is None else lengths
    normalizer = batch_normalizer(mask, agg) if normalizer is None else normalizer
    mask = mask & ~torch.isneginf(ref_logprobs)
    ref_logprobs = torch.where(mask, ref_logprobs, zero)
    diff = torch.where(mask, ref_logprobs - logprobs, zero)
    kl = torch.where(mask, diff.exp() - diff - 1, zero)
    penalty = aggregate(kl, mask, agg=agg, normalizer=normalizer, lengths=lengths)
    return penalty, {"loss/kl_ref": float(masked_mean(kl.detach(), mask))}


def _agg(config: LossConfig, normalizer: float | None, lengths: Tensor | None) -> dict:
    return {"agg": config.loss_agg, "normalizer": normalizer, "lengths": lengths}


def aipo_objective(config: LossConfig, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, *, options=None, normalizer=None, lengths=None):
    return aipo_loss(logprobs, behaviour, adv, mask, rho=config.rho, **_agg(config, normalizer, lengths))


def pg_objective(config: LossConfig, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, *, options=None, normalizer=None, lengths=None):
    return pg_loss(logprobs, behaviour, adv, mask, rho=config.rho, **_agg(config, normalizer, lengths))


def ppo_clip_objective(config: LossConfig, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, *, options=None, normalizer=None, lengths=None):
    low, high = config.clip_range()
    return ppo_clip_loss(logprobs, behaviour, adv, mask, clip_eps=low, clip_eps_high=high, **_agg(config, normalizer, lengths))


def gspo_objective(config: LossConfig, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, *, options=None, normalizer=None, lengths=None):
    low, high = config.clip_range()
    return gspo_loss(logprobs, behaviour, adv, mask, clip_eps_low=low, clip_eps_high=high, **_agg(config, normalizer, lengths))


def cispo_objective(config: LossConfig, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, *, options=None, normalizer=None, lengths=None):
    low, high = config.clip_range()
    return cispo_loss(logprobs, behaviour, adv, mask, clip_eps_low=low, clip_eps_high=high, **_agg(config, normalizer, lengths))


def tis_objective(config: LossConfig, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, *, options=None, normalizer=None, lengths=None):
    return is_loss(logprobs, behaviour, adv, mask, mode="truncate", level=config.is_level, high=config.rho, **_agg(config, normalizer, lengths))


def mis_objective(config: LossConfig, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, *, options=None, normalizer=None, lengths=None):
    low, high = config.mis_range()
    return is_loss(logprobs, behaviour, adv, mask, mode="mask", level=config.is_level, high=high, low=low, **_agg(config, normalizer, lengths))


def decoupled_ppo_objective(config: LossConfig, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, *, options=None, proximal: Tensor, normalizer=None, lengths=None):
    low, high = config.clip_range()
    return decoupled_ppo_loss(
        logprobs, proximal, behaviour, adv, mask, clip_eps_low=low, clip_eps_high=high, cap=config.rho, **_agg(config, normalizer, lengths)
    )


def dppo_objective(config: LossConfig, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, *, options=None, normalizer=None, lengths=None):
    o = config.objective_options() if options is None else options
    return dppo_loss(
        logprobs, behaviour, adv, mask, mask_low=o["mask_low"], mask_high=o["mask_high"], adv_tau=o["adv_tau"], kl_tau=o["kl_tau"],
        **_agg(config, normalizer, lengths),
    )  # fmt: skip


def sapo_objective(config: LossConfig, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, *, options=None, normalizer=None, lengths=None):
    o = config.objective_options() if options is None else options
    return sapo_loss(logprobs, behaviour, adv, mask, tau_pos=o["tau_pos"], tau_neg=o["tau_neg"], **_agg(config, normalizer, lengths))


def opd_objective(
    config: LossConfig, logprobs: Tensor, behaviour: Tensor, adv: Tensor, mask: Tensor, *, teacher: Tensor, options=None, normalizer=None, lengths=None
):
    per_token, metrics = opd_terms(logprobs, behaviour, teacher, adv, mask, coef=config.distill_coef, rho=config.rho)
    loss = -aggregate(per_token, mask, **_agg(config, normalizer, lengths))
    return loss, {"loss/policy": float(loss.detach()), **metrics}


#: The built-in rows' functions (``flowrl.graph.objectives.BUILTIN_OBJECTIVES`` holds their facts; both
#: list the same names, ``tests/operators/test_objective_rows.py``), by ``LossConfig.objective``:
#: ``fn(config, logprobs, old, advantages, mask, *, options, normalizer, lengths)`` (and ``proximal=``,
#: log pi_prox, for the rows that read it).
LOSSES: dict[str, LossFn] = {
    "aipo": aipo_objective,
    "pg": pg_objective,
    "grpo": ppo_clip_objective,
    "ppo_clip": ppo_clip_objective,
    "ppo": ppo_clip_objective,  # with a critic's token-level GAE advantages (loss_advantages)
    "gspo": gspo_objective,
    "cispo": cispo_objective,
    "tis": tis_objective,
    "mis": mis_objective,
    "decoupled_ppo": decoupled_ppo_objective,
    "dppo": dppo_objective,
    "sapo": sapo_objective,
    "opd": opd_objective,  # on-policy distillation from a teacher node (flowrl.operators.distill; teacher=)
}

_RESOLVED: dict[str, LossFn] = {}


def objective_function(config: LossConfig | str, *, owner: str = "loss") -> LossFn:
    """The loss function of ``config``'s row: a built-in's, or a user's imported by its reference.

    Raises:
        ConfigError: an unknown objective, or a user's function that cannot be imported (naming the
            reference and the fix).
    """
    row = _row(config, owner)
    if not row.fn:  # a built-in
        return LOSSES[row.name]
    if row.fn not in _RESOLVED:
        try:
            _RESOLVED[row.fn] = resolve(row.fn)
        except GraphError as exc:
            raise ConfigError(
                f"{owner}: objective {row.name!r}'s function {row.fn!r} cannot be imported here: {exc}; "
                "put its module on PYTHONPATH (or its file at that path) on every host of the run"
            ) from None
    return _RESOLVED[row.fn]


def _row(config: LossConfig | str, owner: str = "loss") -> ObjectiveRow:
    try:
        return row_of(config, owner=owner)
    except ConfigError:
        name = config if isinstance(config, str) else config.objective
        raise ConfigError(f"unknown loss objective {name!r}: known objectives are {known_objectives()}") from None


def check_objective(objective: LossConfig | str) -> None:
    """Raise ``ConfigError`` listing the known objectives if ``objective`` (a name or a ``LossConfig``)
    is not one of them, or its function cannot be imported."""
    objective_function(objective)


_advantages = advantages



def compute_loss(
    config: LossConfig,
    logprobs: Tensor,
    batch: Mapping[str, Tensor],
    *,
    advantages: Tensor | None = None,
    normalizer: float | None = None,
    lengths: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The loss a ``LossNode`` declares, over a rollout batch with its reward fields: its objective's
    row (``flowrl.graph.objectives``) says what the function reads and what its ratio is anchored at;
    the loss's correction (``flowrl.graph.corrections``) weights each token's gradient.

    Args:
        config: the loss node's config.
        logprobs: ``[S, C]`` log pi of ``batch["completion_ids"]``, with gradients.
        batch: rollout fields (``behaviour_logprobs``, ``completion_mask``, ``group_ids``), the reward
            fields of ``config.reward_weights``, with ``kl_coef > 0`` ``ref_logprobs``, and for an
            objective reading ``"proximal"`` ``proximal_logprobs`` (without it, pi's own values: the
            proximal policy of a batch's only update). An objective anchored at the old policy takes
            its ratio against ``proximal_logprobs`` when the batch has them, else against pi's own
            values under a correction, else against mu.
        advantages: ``[S]`` precomputed advantages (a micro-batch passes its slice of the whole
            batch's); computed from the batch's rewards when None.
        normalizer: the whole batch's divisor under ``config.loss_agg`` (``batch_normalizer``; default:
            this batch's).
        lengths: ``[S]`` sequence lengths for ``seq_mean`` (default: ``completion_mask.sum(1)``).

    Returns:
        ``(loss, metrics)``: the objective's metrics plus ``loss/total``, with a correction the
        ``correction/*`` metrics, with a KL penalty ``loss/kl_ref``.

    Raises:
        ConfigError: for an unknown objective or a missing field.
    """
    row = _row(config)
    fn = objective_function(config)
    for field in ("behaviour_logprobs", "completion_mask", "group_ids"):
        if field not in batch:
            raise ConfigError(f"loss {config.objective!r} needs batch field {field!r}; the batch has {sorted(batch)}")
    if advantages is None:
        advantages = loss_advantages(config, combined_rewards(config, batch), batch)
    mask = batch["completion_mask"]
    mu = batch["behaviour_logprobs"]
    prox = batch["proximal_logprobs"] if "proximal_logprobs" in batch else logprobs.detach()  # pi_prox: pi now on a batch's only update
    extra: dict[str, Tensor] = {}
    if "proximal" in row.reads:
        extra["proximal"] = prox
    if "teacher" in row.reads:
        if READ_FIELDS["teacher"] not in batch:
            raise ConfigError(f"loss {config.objective!r} reads a teacher's log-probs ({READ_FIELDS['teacher']!r}); the batch has {sorted(batch)}: add a teacher node feeding the loss")
        extra["teacher"] = batch[READ_FIELDS["teacher"]]
    old = mu  # PPO's old policy is pi_old when the trainer computed it (several updates), or under a correction
    if row.anchored_at_old and ("proximal_logprobs" in batch or config.correction is not None):
        old = prox
    policy_logprobs, policy_mask = logprobs, mask
    correction: dict[str, float] = {}
    if config.correction is not None:  # the whole batch's counts, whatever the correction masks
        normalizer = batch_normalizer(mask, config.loss_agg) if normalizer is None else normalizer
        lengths = mask.sum(1) if lengths is None else lengths
        weight, correction = correction_weights(config.correction, prox, mu, mask)
        policy_mask = mask & (weight > 0)
        policy_logprobs = apply_weights(logprobs, weight, policy_mask)
    loss, metrics = fn(
        config, policy_logprobs, old, advantages, policy_mask, options=config.objective_options(), normalizer=normalizer, lengths=lengths, **extra
    )
    metrics.update(correction)
    if config.kl_coef > 0:
        if "ref_logprobs" not in batch:
            raise ConfigError(
                f"loss has kl_coef={config.kl_coef} but the batch has no 'ref_logprobs': add a reference node "
                "feeding the loss, or set kl_coef=0"
            )
        penalty, kl_metrics = kl_penalty(
            logprobs, batch["ref_logprobs"], mask, normalizer=normalizer, agg=config.loss_agg, lengths=lengths
        )
        loss = loss + config.kl_coef * penalty
        metrics.update(kl_metrics)
    metrics["loss/total"] = float(loss.detach())
    return loss, metrics
