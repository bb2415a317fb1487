"""Value-based advantages as pure tensor functions: GAE over completion tokens, whitening, explained variance.

``flowrl.operators.losses.loss_advantages`` picks a loss's advantages: a critic's GAE from here, or a
group baseline.

Generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438), per completion token t
of a sample whose reward R arrives at its last real token L (token-level, as verl and OpenRLHF
give an outcome reward)::

    r_t     = R * 1[t = L]
    delta_t = r_t + gamma * V_{t+1} - V_t            (V_{L+1} = 0: the episode ends)
    A_t     = delta_t + gamma * lam * A_{t+1}        (A_{L+1} = 0)
    G_t     = A_t + V_t                              (the critic's regression target, its return)

``V_t = V(x, y_<t)`` is the critic's value of the state before token t. Positions off the mask are
skipped: the recursion carries ``V`` and ``A`` of the next masked token over them (a multi-turn
sample's environment tokens), and their advantages and returns are 0.

``whiten``: advantages minus their mean over the masked tokens of the batch, divided by their
standard deviation (plus ``eps``), as verl's ``masked_whiten`` and OpenRLHF's PPO do.

Example:
    >>> adv, ret = gae(torch.tensor([1.0]), torch.zeros(1, 3), torch.tensor([[True, True, False]]), gamma=1.0, lam=1.0)
    >>> adv.tolist(), ret.tolist()
    ([[1.0, 1.0, 0.0]], [[1.0, 1.0, 0.0]])
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowrl.errors import ConfigError

__all__ = ["gae", "whiten", "explained_variance"]


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over ``mask``; 0 for an empty mask (``losses.masked_mean``, which imports this module)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum() / mask.sum().clamp(min=1)


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns ``([S, C], [S, C])`` (module docstring); 0 off the mask.

    Args:
        rewards: ``[S]`` each sample's reward, given at its last masked token.
        values: ``[S, C]`` the critic's values (no gradient is taken through them).
        mask: ``[S, C]`` bool, the completion tokens.
        gamma: discount per token, in [0, 1].
        lam: GAE's lambda, in [0, 1].

    Raises:
        ConfigError: for shapes that do not agree.
    """
    S, C = mask.shape  # [S, C]
    if values.shape != mask.shape or rewards.shape != (S,):
        raise ConfigError(f"gae: values {tuple(values.shape)} and rewards {tuple(rewards.shape)} must be [S, C] = {(S, C)} and [S] = ({S},)")
    values = values.detach().float()
    zero = torch.zeros(S, dtype=torch.float32, device=values.device)
    positions = torch.arange(C, device=mask.device)
    last = torch.where(mask, positions, -1).max(1).values if C else torch.full((S,), -1, device=mask.device)  # [S]
    adv = torch.zeros(S, C, dtype=torch.float32, device=values.device)
    next_v, next_a = zero, zero
    r = rewards.float()
    for t in range(C - 1, -1, -1):
        m = mask[:, t]
        delta = torch.where(last == t, r, zero) + gamma * next_v - values[:, t]
        a = delta + gamma * lam * next_a
        adv[:, t] = torch.where(m, a, zero)
        next_v = torch.where(m, values[:, t], next_v)
        next_a = torch.where(m, a, next_a)
    returns = torch.where(mask, adv + values, torch.zeros((), dtype=adv.dtype, device=adv.device))
    return adv, returns


def whiten(x: Tensor, mask: Tensor, *, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / (std + eps)`` over the masked entries (population std); 0 off the mask."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(mask, (x - mean) / (var.sqrt() + eps), zero)


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """``1 - Var(G - V) / Var(G)`` over the masked tokens: 1 for a perfect critic, 0 for one that
    predicts the mean, negative for worse; 0 when the returns do not vary."""
    var_g = masked_mean((returns - masked_mean(returns, mask)) ** 2, mask)
    err = returns - values
    var_e = masked_mean((err - masked_mean(err, mask)) ** 2, mask)
    return float(1 - var_e / var_g) if float(var_g) > 0 else 0.0
