"""The engine/trainer log-prob mismatch: how far mu's recorded log-probs are from pi's on tokens of the same weights.

A generator (any engine: the built-in one, vLLM) records ``behaviour_logprobs``, log mu of each token
it drew, and the version of the weights that drew it (``token_versions``, or ``rollout_version`` for
the whole batch). The trainer recomputes log pi of the same tokens with its own weights. On a token
drawn by the trainer's *current* weights (every token at k = 0; with staleness, the tokens of the
newest version), pi and mu are the same function of the same weights, so any difference is the
engine's: another kernel, a KV cache, a lower precision (int8, bf16), batch-dependent reductions.
That is the mismatch AIPO's ratio corrects; these metrics measure it every step::

    mismatch/kl          = mean_{t in T} (log mu(y_t) - log pi(y_t))     (k1 estimate of KL(mu || pi); may be < 0 on few tokens)
    mismatch/abs_logp_max = max_{t in T} |log mu(y_t) - log pi(y_t)|
    mismatch/tokens      = |T|

with ``T`` the real tokens (``completion_mask``) of the current version that lie inside pi's kept set
(with top-k/top-p, pi is truncated by its own kept set: ``flowrl.operators.logprobs.kept_logprobs``).
When ``T`` is empty (a batch drawn entirely by older weights) ``mismatch/kl`` and
``mismatch/abs_logp_max`` are 0.0 and ``mismatch/tokens`` is 0: a number that plots, averages and
survives JSON and TensorBoard (NaN would be written as ``null`` and compare unequal to itself); read
the pair with ``mismatch/tokens`` (``flowrl plot`` leaves such steps out of its mismatch panel).

``mismatch/outside_kept_frac`` is the fraction of *all* real tokens of the batch (any version) that
fall outside pi's kept set: pi gives them probability 0, so AIPO's ratio is 0 there and the trainer
gives them weight 0 (they still count in the token normaliser).

Example:
    >>> mu = torch.tensor([[-1.0, -2.0, 0.0]])
    >>> pi = torch.tensor([[-1.5, -2.0, 0.0]])
    >>> m = mismatch_metrics(pi, mu, torch.tensor([[True, True, False]]), versions=torch.tensor([[3, 2, 3]]), version=3)
    >>> m["mismatch/kl"], m["mismatch/tokens"]
    (0.5, 1.0)
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["mismatch_metrics", "MISMATCH_KEYS"]

#: The keys ``mismatch_metrics`` returns, in every metrics row of a trainer step.
MISMATCH_KEYS: tuple[str, ...] = ("mismatch/kl", "mismatch/abs_logp_max", "mismatch/tokens", "mismatch/outside_kept_frac")


@torch.no_grad()
def mismatch_metrics(
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    *,
    versions: Tensor,
    version: int,
    kept: Tensor | None = None,
) -> dict[str, float]:
    """The mismatch between mu's recorded log-probs and pi's on the tokens of pi's weights (module docstring).

    Args:
        logprobs: ``[S, C]`` log pi (any value where ``kept`` is False).
        behaviour_logprobs: ``[S, C]`` log mu, as the generator recorded them.
        mask: ``[S, C]`` bool, True on real completion tokens.
        versions: ``[S, C]`` the version of the weights that drew each token (``token_versions``), or a
            scalar for the whole batch (``rollout_version``).
        version: the version of pi's weights (the trainer's, before its step).
        kept: ``[S, C]`` bool, True where the token lies inside pi's kept set (None: everywhere).

    Returns:
        ``mismatch/kl``, ``mismatch/abs_logp_max``, ``mismatch/tokens``, ``mismatch/outside_kept_frac``.
    """
    inside = mask if kept is None else mask & kept
    current = inside & (versions.to(mask.device) == version)  # [S, C] (a scalar version broadcasts)
    diff = (behaviour_logprobs.float() - logprobs.detach().float())[current]  # [T]
    tokens = int(diff.numel())
    real = int(mask.sum())
    return {
        "mismatch/kl": float(diff.mean()) if tokens else 0.0,
        "mismatch/abs_logp_max": float(diff.abs().max()) if tokens else 0.0,
        "mismatch/tokens": float(tokens),
        "mismatch/outside_kept_frac": float((mask & ~inside).sum()) / real if real else 0.0,
    }
