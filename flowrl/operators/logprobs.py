"""Log-probs of completions under a model: the one computation generation, reference and trainer share.

The generator records log mu(y_t | x, y_<t) while it samples (KV cache, step by step); the trainer
and the reference recompute log-probs with one full forward pass through ``completion_logprobs``.
Both lay a sample out the same way: the left-padded prompt, then the completion; positions count from
the first real prompt token; pads are never attended. So with identical weights they agree to float
rounding (float32: ~1e-6), which is what makes the AIPO ratio pi/mu exactly 1 on-policy.

Temperature: the generator samples from ``softmax(logits / T)`` and records ``T`` per sample
(``sampling_temperature``); ``completion_logprobs(..., temperature=T)`` evaluates the same
distribution, so the ratio is 1 on-policy at any temperature (top-k/top-p truncation is not undone).

Devices: every tensor is computed on the device of the model and of ``prompt_ids`` (the callers
move their inputs there first); the result is on that device.

Any model works through the ``flowrl.models.CausalLM`` interface (``model(tokens, valid=..., keep=...)``).

Example:
    >>> from flowrl.graph.configs import ModelConfig
    >>> from flowrl.operators.model import Transformer
    >>> m = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=1))
    >>> lp = completion_logprobs(m, torch.tensor([[0, 1, 4]]), torch.tensor([2]),
    ...                          torch.tensor([[5, 2]]), torch.tensor([[True, True]]))
    >>> lp.shape, bool((lp < 0).all())
    (torch.Size([1, 2]), True)
"""

from __future__ import annotations

import torch
from torch import Tensor

from flowrl.models.causal_lm import CausalLM

__all__ = ["completion_logprobs", "prompt_valid"]


def prompt_valid(prompt_ids: Tensor, prompt_lens: Tensor) -> Tensor:
    """Bool ``[N, Tp]``: True on the real (right-aligned) tokens of left-padded prompts."""
    Tp = prompt_ids.shape[1]
    return torch.arange(Tp, device=prompt_ids.device)[None, :] >= (Tp - prompt_lens)[:, None]


def completion_logprobs(
    model: CausalLM,
    prompt_ids: Tensor,
    prompt_lens: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: Tensor | float = 1.0,
    completion_lens: Tensor | None = None,
) -> Tensor:
    """log p(y_t | x, y_<t) of every completion token, 0 where ``completion_mask`` is False.

    Gradients flow to the model unless the caller runs it under ``torch.no_grad()``.

    Args:
        model: the model whose log-probs to compute (no top-k/top-p).
        prompt_ids: ``[S, Tp]`` left-padded prompts.
        prompt_lens: ``[S]`` real prompt lengths.
        completion_ids: ``[S, C]`` right-padded completions.
        completion_mask: ``[S, C]`` bool, True on real completion tokens (a prefix of each row).
        temperature: softmax temperature, a float or ``[S]`` per sample (the rollout's
            ``sampling_temperature``); logits are divided by it before ``log_softmax``.
        completion_lens: ``[S]`` each completion's extent, when ``completion_mask`` is a loss mask
            rather than a prefix (a multi-turn sample, ``flowrl.operators.multiturn``: its
            environment's tokens are mask False but attended): the first ``completion_lens`` tokens
            are attended, log-probs are still 0 where the mask is False. None: the mask's prefix.

    Returns:
        ``[S, C]`` float32.
    """
    S, Tp = prompt_ids.shape
    C = completion_ids.shape[1]
    out = torch.zeros(S, C, dtype=torch.float32, device=completion_ids.device)
    attended = completion_mask
    if completion_lens is not None:  # multi-turn: every token up to the extent is attended, the mask is the loss's
        attended = torch.arange(C, device=completion_ids.device)[None, :] < completion_lens.to(completion_ids.device)[:, None]
    used = int(attended.sum(1).max()) if S and C else 0  # trailing all-pad columns cost nothing
    if used == 0:
        return out
    # Leading columns that are padding in every row change nothing either.
    skip = int(Tp - prompt_lens.max())
    prompt_ids = prompt_ids[:, skip:]
    valid = torch.cat([prompt_valid(prompt_ids, prompt_lens), attended[:, :used]], dim=1)
    tokens = torch.cat([prompt_ids, completion_ids[:, :used]], dim=1)[:, :-1]  # the last token predicts nothing
    valid = valid[:, :-1]
    logits = model(tokens, valid=valid, keep=used).float()  # [S, used, V]: the last prompt token's logits predict y_0
    if isinstance(temperature, Tensor):
        logits = logits / temperature.to(logits)[:, None, None]
    elif temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)  # [S, used, V]
    picked = logp.gather(-1, completion_ids[:, :used, None]).squeeze(-1)
    out = torch.cat([picked, out[:, used:]], dim=1) if used < C else picked
    return torch.where(completion_mask, out, torch.zeros((), dtype=out.dtype, device=out.device))
