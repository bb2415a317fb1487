"""Rollout correction weights (``flowrl.graph.corrections`` has the formulas, options and rules).

``correction_weights`` turns pi_prox's and mu's log-probs into the per-token weights ``[S, C]`` the
objective's gradient is scaled by (0: masked) and the ``correction/*`` metrics; ``apply_weights``
scales each token's gradient by its weight without changing any value.

Example (token TIS with cap 2: ratios 1, 4 -> weights 1, 2; one token of one sequence truncated):
    >>> import math
    >>> from flowrl.graph.corrections import CorrectionConfig
    >>> prox = torch.tensor([[0.0, math.log(4.0)]])
    >>> w, m = correction_weights(CorrectionConfig(kind="tis"), prox, torch.zeros(1, 2), torch.tensor([[True, True]]))
    >>> w.tolist(), m["correction/token_frac"], m["correction/seq_frac"], m["correction/weight_max"]
    ([[1.0, 2.0]], 0.5, 1.0, 2.0)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flowrl.graph.corrections import CorrectionConfig

__all__ = ["correction_weights", "apply_weights"]


def _log_bound(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


@torch.no_grad()
def correction_weights(correction: CorrectionConfig, prox_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, float]]:
    """The weights ``[S, C]`` (float32, 0 off ``mask`` and on masked tokens) of ``r = pi_prox / mu`` and
    the metrics ``correction/token_frac`` (real tokens masked or truncated), ``correction/seq_frac``
    (sequences with any), ``correction/weight_mean``, ``correction/weight_max`` (over real tokens).

    Args:
        correction: the loss's correction.
        prox_logprobs: ``[S, C]`` log pi_prox (the anchor's log-probs).
        behaviour_logprobs: ``[S, C]`` log mu, the generator's.
        mask: ``[S, C]`` bool, the real tokens.
    """
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    log_r = torch.where(mask, prox_logprobs.float() - behaviour_logprobs.float(), zero)  # [S, C]
    o = correction.options()
    if correction.kind == "tis":
        if o["level"] == "sequence":  # the product of the sequence's ratios, every token of it
            log_r = log_r.sum(1, keepdim=True).expand_as(log_r)
        cap = math.log(o["cap"])
        weight = log_r.clamp(max=cap).exp()  # min(r, C), without overflow for a long sequence
        hit = log_r > cap
    elif correction.kind == "icepop":
        low, high = (_log_bound(b) for b in correction.band())
        keep = (log_r >= low) & (log_r <= high)
        weight = torch.where(keep, log_r.clamp(max=high).exp(), zero)  # r inside the band, else 0
        hit = ~keep
    else:  # seq_mask: the geometric mean of the sequence's ratios
        low, high = (_log_bound(b) for b in correction.band())
        log_g = log_r.sum(1) / mask.sum(1).clamp(min=1)  # [S]
        keep_seq = ((log_g >= low) & (log_g <= high))[:, None].expand_as(log_r)
        weight = keep_seq.float()
        hit = ~keep_seq
    weight = torch.where(mask, weight, zero)
    hit = hit & mask
    tokens = mask.sum().clamp(min=1)
    seqs = mask.any(1)
    metrics = {
        "correction/token_frac": float(hit.sum() / tokens),
        "correction/seq_frac": float(hit.any(1).sum() / seqs.sum().clamp(min=1)),
        "correction/weight_mean": float(weight.sum() / tokens),
        "correction/weight_max": float(weight.max()) if mask.any() else 0.0,
    }
    return weight, metrics


def apply_weights(logprobs: Tensor, weight: Tensor, mask: Tensor) -> Tensor:
    """``logprobs`` with the same values and each real token's gradient scaled by its weight:
    ``sg[lp] + w (lp - sg[lp])``, so that an objective's per-token term ``l(lp_t)`` gets gradient
    ``w_t dl/dlp_t``, as if it were ``w_t l_t`` with ``w`` a constant. Off ``mask`` ``logprobs`` pass
    through (whatever they hold).

    Example:
        >>> lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        >>> out = apply_weights(lp, torch.tensor([[0.5, 2.0]]), torch.tensor([[True, True]]))
        >>> out.sum().backward(); out.tolist(), lp.grad.tolist()
        ([[-1.0, -2.0]], [[0.5, 2.0]])
    """
    if not logprobs.requires_grad:
        return logprobs
    base = logprobs.detach()
    return torch.where(mask, base + weight.to(logprobs.dtype) * (logprobs - base), logprobs)
