"""Batch shaping before the loss: truncated completions masked, DAPO's overlong penalty and dynamic sampling.

Pure functions over a rollout batch (``LossConfig`` says which apply; ``shape_batch`` applies them in
this order):

1. **dynamic sampling** (DAPO, Yu et al. 2025, arXiv 2503.14476, ``dynamic_sampling=True``): the
   groups whose combined rewards (before the overlong penalty) are all equal have advantage 0 with a
   group baseline and only dilute the normaliser; their samples are dropped from the step. The
   number dropped is in ``shaping/dropped_groups``. DAPO refills the batch from the source until it
   holds enough groups with a signal; here the source over-samples instead, as verl's generation
   batch does: with ``dynamic_sampling_groups = N`` the step trains on the first N groups (in batch
   order) whose rewards differ, out of the source's ``batch_size`` prompts (e.g. 3N), and the rest
   are discarded (``shaping/surplus_groups``; ``shaping/kept_groups`` is what trained, below N when
   too few groups had a signal). The trainer applies it once to the whole batch, before the
   proximal pass and the mini-batches, so every data-parallel rank keeps the same groups.
2. **overlong penalty** (DAPO's soft overlong punishment, ``overlong_buffer > 0``): with ``Lmax`` the
   completion width (the generator's ``max_new_tokens``) and ``B = overlong_buffer``, a completion of
   length ``L`` gets, added to its reward::

       0                                      if L <= Lmax - B
       -overlong_penalty * (L - (Lmax - B)) / B   if Lmax - B < L <= Lmax

3. **mask_truncated_completions** (DAPO; TRL's option of that name): a completion that reached
   ``Lmax`` without a stop gets mask 0 (no loss, no token count). Which completions did: those whose
   ``completion_stopped`` is False when the batch has that field, else those of length ``Lmax`` (a
   completion whose stop token fell exactly on the last position is then counted as truncated).

Example:
    >>> overlong_penalty(torch.tensor([2, 3, 4]), max_len=4, buffer=2, penalty=1.0).tolist()
    [0.0, -0.5, -1.0]
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from flowrl.graph.configs import LossConfig
from flowrl.operators.batch import leading_dim
from flowrl.operators.losses import batch_normalizer, combined_rewards

__all__ = ["overlong_penalty", "truncated_completions", "uniform_groups", "dynamic_sample", "shape_batch", "loss_normalizer"]


def overlong_penalty(lengths: Tensor, *, max_len: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment ``[S]`` (module docstring), 0 everywhere when ``buffer`` is 0."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    over = (lengths.to(torch.float32) - (max_len - buffer)).clamp(min=0, max=buffer)  # [S], tokens inside the buffer
    return 0.0 - penalty * over / buffer  # 0.0 - x: +0.0 (not -0.0) below the buffer


def truncated_completions(mask: Tensor, stopped: Tensor | None = None) -> Tensor:
    """``[S]`` bool: the completions that reached the width of ``mask`` ``[S, C]`` without a stop."""
    full = mask.sum(1) >= mask.shape[1]  # [S]
    return full & ~stopped.to(torch.bool) if stopped is not None else full


def uniform_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """``[S]`` bool: True for the samples of a group whose rewards are all equal (a group of one included)."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n = int(inverse.max()) + 1 if inverse.numel() else 0
    hi = torch.full((n,), -torch.inf, device=rewards.device).scatter_reduce(0, inverse, rewards.float(), "amax")
    lo = torch.full((n,), torch.inf, device=rewards.device).scatter_reduce(0, inverse, rewards.float(), "amin")
    return (hi == lo)[inverse]


def _select(batch: Mapping[str, Tensor], keep: Tensor) -> dict[str, Tensor]:
    return {k: v[keep] if leading_dim(k) == "sample" else v for k, v in batch.items()}


def dynamic_sample(config: LossConfig, batch: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, float]]:
    """``batch`` without the groups whose combined rewards are all equal and, with
    ``dynamic_sampling_groups = N``, cut to the first N groups left (module docstring); its
    ``shaping/*`` metrics. The batch unchanged, and no metrics, without ``dynamic_sampling``.

    Example:
        >>> cfg = LossConfig(dynamic_sampling=True, dynamic_sampling_groups=1)
        >>> b = {"group_ids": torch.tensor([0, 0, 1, 1, 2, 2]), "rewards": torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0])}
        >>> out, m = dynamic_sample(cfg, b)
        >>> out["group_ids"].tolist(), m["shaping/dropped_groups"], m["shaping/surplus_groups"]
        ([1, 1], 1.0, 1.0)
    """
    if not config.dynamic_sampling:
        return dict(batch), {}
    gid = batch["group_ids"]
    drop = uniform_groups(combined_rewards(config, batch), gid)  # [S]
    metrics = {"shaping/dropped_groups": float(torch.unique(gid[drop]).numel()), "shaping/dropped_samples": float(drop.sum())}
    keep = ~drop
    if config.dynamic_sampling_groups:
        first_seen: list[int] = []  # the groups left, in batch order
        for g in gid[keep].tolist():
            if not first_seen or first_seen[-1] != g and g not in first_seen:
                first_seen.append(g)
        chosen = first_seen[: config.dynamic_sampling_groups]
        keep = keep & torch.isin(gid, torch.tensor(chosen, dtype=gid.dtype, device=gid.device))
        metrics["shaping/surplus_groups"] = float(len(first_seen) - len(chosen))
    metrics["shaping/kept_groups"] = float(torch.unique(gid[keep]).numel())
    return _select(batch, keep), metrics


def shape_batch(config: LossConfig, batch: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], Tensor, dict[str, float]]:
    """The batch after ``config``'s shaping, its rewards ``[S']`` (combined, with the overlong penalty)
    and the ``shaping/*`` metrics of what was applied.

    Metrics: ``shaping/dropped_groups``, ``shaping/dropped_samples``, ``shaping/kept_groups``,
    ``shaping/surplus_groups`` (dynamic sampling, ``dynamic_sample``),
    ``shaping/overlong_penalty_mean`` (over the kept samples), ``shaping/truncated_frac`` (fraction of
    kept samples masked as truncated).
    """
    out, metrics = dynamic_sample(config, batch)
    rewards = combined_rewards(config, out)  # [S']
    mask = out["completion_mask"]  # [S, C]
    if config.overlong_buffer > 0:
        extra = overlong_penalty(mask.sum(1), max_len=mask.shape[1], buffer=config.overlong_buffer, penalty=config.overlong_penalty)
        rewards = rewards + extra
        metrics["shaping/overlong_penalty_mean"] = float(extra.mean()) if extra.numel() else 0.0
    if config.mask_truncated_completions:
        cut = truncated_completions(mask, out.get("completion_stopped"))
        out["completion_mask"] = mask & ~cut[:, None]
        metrics["shaping/truncated_frac"] = float(cut.float().mean()) if cut.numel() else 0.0
    return out, rewards, metrics


def loss_normalizer(config: LossConfig, batch: Mapping[str, Tensor]) -> float:
    """The loss divisor of ``batch`` once shaped (``batch_normalizer`` of its shaped mask under
    ``config.loss_agg``): what a data-parallel rank compares its shard's to the whole batch's."""
    shaped, _, _ = shape_batch(config, batch)
    return batch_normalizer(shaped["completion_mask"], config.loss_agg)
