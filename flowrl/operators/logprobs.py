"""Log-probs of completions under a model: the one computation generation, reference and trainer share.

The generator records log mu(y_t | x, y_<t) while it samples (KV cache, step by step); the trainer
and the reference recompute log-probs with one full forward pass through ``completion_logprobs``.
Both lay a sample out the same way: the left-padded prompt, then the completion; positions count from
the first real prompt token; pads are never attended. So with identical weights they agree to float
rounding (float32: ~1e-6), which is what makes the AIPO ratio pi/mu exactly 1 on-policy.

Temperature and truncation: the generator samples from ``softmax(logits / T)`` restricted to the
tokens top-k and then top-p keep, renormalised over them, and records ``T``, ``k`` and ``p`` per
sample (``sampling_temperature``, ``sampling_top_k``, ``sampling_top_p``). The behaviour policy mu is
thus mu's own distribution truncated by mu's own kept set; the target pi is pi's distribution
truncated by *pi's* kept set under the same rule (``kept_logprobs``, the one function both sides
use). ``completion_logprobs(..., temperature=T, top_k=k, top_p=p)`` evaluates that, so the ratio is
1 on-policy at any temperature and truncation. A sampled token outside pi's kept set has
probability 0 under truncated pi: its log-prob is ``-inf`` (the trainer gives it weight 0 and counts
it, ``mismatch/outside_kept_frac``). Gradients flow through the renormalisation (a ``log_softmax``
over the kept set); the kept set itself is a discrete choice without gradient.

Cost: with truncation off (``top_k`` 0 or >= V, ``top_p`` 1) nothing is sorted and the computation
is the plain ``log_softmax`` it always was. Top-k costs one ``topk`` (top-p after it works on those
k values only); top-p without top-k looks at each row's largest logits in windows of growing size
(64, 256, ...) until they hold ``top_p`` of its mass, and sorts only the rows whose nucleus is a
large share of the vocabulary (``benches/truncation.py`` prints the costs).

Devices: every tensor is computed on the device of the model and of ``prompt_ids`` (the callers
move their inputs there first); the result is on that device.

Any model works through the ``flowrl.models.CausalLM`` interface (``model(tokens, valid=..., keep=...)``).

Example:
    >>> from flowrl.graph.configs import ModelConfig
    >>> from flowrl.models.families.builtin.model import Transformer
    >>> m = Transformer(ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=1))
    >>> lp = completion_logprobs(m, torch.tensor([[0, 1, 4]]), torch.tensor([2]),
    ...                          torch.tensor([[5, 2]]), torch.tensor([[True, True]]))
    >>> lp.shape, bool((lp < 0).all())
    (torch.Size([1, 2]), True)
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

from flowrl.errors import ConfigError
from flowrl.models.causal_lm import CausalLM
from flowrl.models.routing import RoutingAgreement, replaying
from flowrl.operators.packing import packed_logits

__all__ = [
    "completion_logprobs",
    "completion_logprobs_and_entropy",
    "prompt_valid",
    "truncation_threshold",
    "truncated_log_softmax",
    "kept_logprobs",
    "entropy_of",
    "attended_mask",
    "padded_layout",
    "routed_columns",
]


def prompt_valid(prompt_ids: Tensor, prompt_lens: Tensor) -> Tensor:
    """Bool ``[N, Tp]``: True on the real (right-aligned) tokens of left-padded prompts."""
    Tp = prompt_ids.shape[1]
    return torch.arange(Tp, device=prompt_ids.device)[None, :] >= (Tp - prompt_lens)[:, None]


def attended_mask(completion_mask: Tensor, completion_lens: Tensor | None = None) -> Tensor:
    """Bool ``[S, C]``: the completion tokens a forward pass attends (the mask's, or a multi-turn sample's
    first ``completion_lens``, its environment's tokens included)."""
    if completion_lens is None:
        return completion_mask
    C = completion_mask.shape[1]
    return torch.arange(C, device=completion_mask.device)[None, :] < completion_lens.to(completion_mask.device)[:, None]


def padded_layout(prompt_ids: Tensor, prompt_lens: Tensor, completion_ids: Tensor, attended: Tensor) -> tuple[Tensor, Tensor, int]:
    """The padded forward's input of ``S`` samples: ``(tokens [S, W], valid [S, W], used)``.

    The left-padded prompts (leading columns that are padding in every row dropped), then the first
    ``used`` completion columns (``used``: the longest attended completion), less the last token,
    which predicts nothing; ``model(tokens, valid=valid, keep=used)[:, j]`` are then the logits of
    completion token ``j``. A pipeline-parallel policy lays a whole mini-batch out once with it
    (``flowrl.runtime.parallel.pipeline_trainer``), so that every micro-batch has one shape.
    """
    used = int(attended.sum(1).max()) if attended.numel() else 0
    prompt_ids = prompt_ids[:, int(prompt_ids.shape[1] - prompt_lens.max()) :] if prompt_ids.shape[0] else prompt_ids
    valid = torch.cat([prompt_valid(prompt_ids, prompt_lens), attended[:, :used]], dim=1)[:, :-1]
    tokens = torch.cat([prompt_ids, completion_ids[:, :used]], dim=1)[:, :-1]
    return tokens, valid, used


def routed_columns(routed_experts: Tensor, prompt_width: int, completion_width: int) -> Tensor:
    """``routed_experts`` ``[S, Tp + C, layers, k]`` checked against the rollout's widths (its time axis is
    the left-padded prompt's ``Tp`` columns, then the completion's ``C``).

    Raises:
        ConfigError: when the time axis is not ``Tp + C`` long.
    """
    if routed_experts.dim() != 4 or routed_experts.shape[1] != prompt_width + completion_width:
        raise ConfigError(
            f"routed_experts has shape {tuple(routed_experts.shape)} but the rollout's prompts are {prompt_width} and its completions "
            f"{completion_width} columns wide: it must be [samples, {prompt_width + completion_width}, layers, top_k] (a generator's "
            "routing_replay records the prompt's columns, then the completion's)"
        )
    return routed_experts


#: The first window of largest logits that top-p (without top-k) looks at; it grows 4x until it holds ``top_p``.
_TOP_P_WINDOW = 64
#: A row whose window would pass ``V / _SORT_FRACTION`` is sorted whole (``topk`` of a large share of V is slower).
_SORT_FRACTION = 16


def _nucleus_threshold(top: Tensor, log_norm: Tensor, top_p: float) -> Tensor:
    """The smallest kept value of descending ``top`` ``[N, w]`` under top-p, given the log-normaliser ``[N, 1]``.

    A token is kept while the mass of the ones before it (in descending order) is below ``top_p``;
    the first is always kept. The exclusive cumulative sum never decreases (adding a probability
    never makes a float smaller), so the kept ones are a prefix and counting them finds the last.
    """
    probs = torch.exp(top - log_norm)  # [N, w]
    before = torch.cat([torch.zeros_like(probs[:, :1]), torch.cumsum(probs[:, :-1], dim=-1)], dim=-1)  # [N, w]
    last = (before < top_p).sum(-1, keepdim=True) - 1  # [N, 1], >= 0
    return top.gather(-1, last)


def truncation_threshold(scaled: Tensor, *, top_k: int = 0, top_p: float = 1.0) -> Tensor | None:
    """The smallest logit each row keeps under top-k, then top-p; None when both are off.

    The kept set of a row is ``{v : scaled[v] >= threshold}``: the ``top_k`` largest logits (0 or
    ``>= V``: all), then, of those in descending order renormalised over them, each token while the
    mass of the ones before it is below ``top_p`` (1: all). Tokens tied with the smallest kept logit
    are kept too, so the set does not depend on how a sort orders ties (top-p's masses count the
    ``top_k`` largest values once each, a tie beyond them not again).

    Args:
        scaled: ``[..., V]`` logits already divided by the temperature (no gradient is taken).
        top_k: keep the ``top_k`` largest (0 disables).
        top_p: nucleus mass in ``(0, 1]`` (1 disables).

    Returns:
        ``[..., 1]`` thresholds (detached), or None when nothing is truncated.
    """
    V = scaled.shape[-1]
    use_k, use_p = 0 < top_k < V, top_p < 1.0
    if not (use_k or use_p):
        return None
    with torch.no_grad():
        flat = scaled.detach().reshape(-1, V)
        if use_k:
            top = torch.topk(flat, top_k, dim=-1).values  # [N, k], descending
            threshold = top[:, -1:]
            if use_p:  # top-p over the top-k renormalised: the k values are the whole kept set
                threshold = _nucleus_threshold(top, torch.logsumexp(top, dim=-1, keepdim=True), top_p)
        else:
            threshold = _top_p_threshold(flat, top_p)
        return threshold.reshape(*scaled.shape[:-1], 1)


def _top_p_threshold(flat: Tensor, top_p: float) -> Tensor:
    """Top-p thresholds ``[N, 1]`` of ``flat`` ``[N, V]`` without sorting a row whose nucleus is small.

    Each row looks at its ``_TOP_P_WINDOW`` largest logits, then 4x as many, while they hold less than
    ``top_p`` of its mass; a row whose window would pass ``V / _SORT_FRACTION`` is sorted whole instead
    (``topk`` of a large share of a row costs more than a sort). Only unresolved rows go on to a wider window.
    """
    N, V = flat.shape
    log_norm = torch.logsumexp(flat, dim=-1, keepdim=True)  # [N, 1]
    threshold = torch.empty(N, 1, dtype=flat.dtype, device=flat.device)
    rows = torch.arange(N, device=flat.device)
    width = min(V, _TOP_P_WINDOW)
    while rows.numel():
        part, norm = flat[rows], log_norm[rows]
        if width * _SORT_FRACTION > V:  # what is left is flat: sort it whole
            threshold[rows] = _nucleus_threshold(part.sort(dim=-1, descending=True).values, norm, top_p)
            break
        top = torch.topk(part, width, dim=-1).values  # [n, width], descending
        inside = torch.exp(top - norm).sum(-1) >= top_p  # [n]: the nucleus ends within the window
        threshold[rows[inside]] = _nucleus_threshold(top[inside], norm[inside], top_p)
        rows = rows[~inside]
        width *= 4
    return threshold


def truncated_log_softmax(scaled: Tensor, *, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """``log_softmax`` of ``scaled`` over its kept set (``truncation_threshold``), ``-inf`` elsewhere.

    With both truncations off this is exactly ``torch.log_softmax(scaled, -1)``. Gradients flow into
    the kept logits (through the renormalisation), none into the dropped ones.
    """
    threshold = truncation_threshold(scaled, top_k=top_k, top_p=top_p)
    if threshold is not None:
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def kept_logprobs(
    logits: Tensor, tokens: Tensor, *, temperature: Tensor | float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> Tensor:
    """log-prob of ``tokens`` under ``softmax(logits / temperature)`` truncated by top-k then top-p and
    renormalised over the kept set; ``-inf`` for a token outside it.

    This is the one definition of a truncated sampling distribution in flowrl: the generator draws
    from it and records it as mu, and the trainer evaluates pi with it on pi's own logits (pi
    truncated by pi's own kept set). An engine must record the same thing: **mu's
    behaviour_logprobs must be the log-probs of the truncated, renormalised sampling distribution
    (vLLM: logprobs_mode='processed_logprobs')**, and the rollout must carry the temperature, top-k
    and top-p it sampled with (``sampling_temperature``, ``sampling_top_k``, ``sampling_top_p``).

    Formula, with ``z = logits / T`` and ``K`` the kept set (``truncation_threshold``)::

        log p(y) = z_y - log sum_{v in K} exp(z_v)   if y in K,   -inf otherwise

    Args:
        logits: ``[..., V]`` float logits (with gradients if wanted).
        tokens: ``[...]`` int64 token ids.
        temperature: a float, or a tensor that broadcasts against ``logits[..., :1]``.
        top_k: 0 disables; top_p: 1 disables.

    Returns:
        ``[...]`` float log-probs. Gradients are finite everywhere, also where the result is
        ``-inf`` (select those entries away with ``torch.where``, never multiply them by 0).

    Example:
        >>> import math
        >>> z = torch.tensor([[2.0, 1.0, 0.0]])
        >>> round(kept_logprobs(z, torch.tensor([1]), top_k=2).item(), 5), round(1 - math.log(math.e**2 + math.e), 5)
        (-1.31326, -1.31326)
        >>> kept_logprobs(z, torch.tensor([2]), top_k=2).item()
        -inf
    """
    scaled = logits / temperature if isinstance(temperature, Tensor) or temperature != 1.0 else logits
    logp = truncated_log_softmax(scaled, top_k=top_k, top_p=top_p)
    return logp.gather(-1, tokens[..., None]).squeeze(-1)


def entropy_of(logp: Tensor) -> Tensor:
    """Entropy ``-sum_v p_v log p_v`` ``[...]`` of the distributions whose log-probs are ``logp`` ``[..., V]``
    (``-inf`` outside a truncated kept set: those terms are 0), without gradient.

    Example:
        >>> import math
        >>> abs(float(entropy_of(torch.log(torch.tensor([0.5, 0.5, 0.0])))) - math.log(2)) < 1e-6
        True
    """
    with torch.no_grad():
        p = logp.exp()
        return -torch.where(p > 0, p * logp, torch.zeros((), dtype=logp.dtype, device=logp.device)).sum(-1)


def _settings(top_k: Tensor | int, top_p: Tensor | float, n: int) -> Iterator[tuple[int, float, Tensor | None]]:
    """``(k, p, rows)`` for each distinct truncation setting of ``n`` samples (rows None: all of them)."""
    if not isinstance(top_k, Tensor) and not isinstance(top_p, Tensor):
        yield int(top_k), float(top_p), None
        return
    ks = top_k.reshape(-1).cpu() if isinstance(top_k, Tensor) else torch.full((n,), int(top_k))
    ps = top_p.reshape(-1).cpu().to(torch.float64) if isinstance(top_p, Tensor) else torch.full((n,), float(top_p), dtype=torch.float64)
    pairs = list(zip(ks.tolist(), ps.tolist()))
    distinct = sorted(set(pairs))
    if len(distinct) == 1:
        yield int(distinct[0][0]), float(distinct[0][1]), None
        return
    for k, p in distinct:
        yield int(k), float(p), torch.tensor([i for i, pair in enumerate(pairs) if pair == (k, p)], dtype=torch.int64)


def completion_logprobs(
    model: CausalLM,
    prompt_ids: Tensor,
    prompt_lens: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: Tensor | float = 1.0,
    top_k: Tensor | int = 0,
    top_p: Tensor | float = 1.0,
    completion_lens: Tensor | None = None,
    packing: bool = False,
    routed_experts: Tensor | None = None,
    agreement: RoutingAgreement | None = None,
) -> Tensor:
    """log p(y_t | x, y_<t) of every completion token, 0 where ``completion_mask`` is False.

    With truncation (``top_k``/``top_p``), p is the model's distribution truncated by its own kept
    set and renormalised (``kept_logprobs``), and a token outside that set gets ``-inf``.

    Gradients flow to the model unless the caller runs it under ``torch.no_grad()``.

    Args:
        model: the model whose log-probs to compute.
        prompt_ids: ``[S, Tp]`` left-padded prompts.
        prompt_lens: ``[S]`` real prompt lengths.
        completion_ids: ``[S, C]`` right-padded completions.
        completion_mask: ``[S, C]`` bool, True on real completion tokens (a prefix of each row).
        temperature: softmax temperature, a float or ``[S]`` per sample (the rollout's
            ``sampling_temperature``); logits are divided by it before ``log_softmax``.
        top_k: top-k of the sampling distribution, an int or ``[S]`` (``sampling_top_k``; 0: off).
        top_p: top-p of the sampling distribution, a float or ``[S]`` (``sampling_top_p``; 1: off).
        completion_lens: ``[S]`` each completion's extent, when ``completion_mask`` is a loss mask
            rather than a prefix (a multi-turn sample, ``flowrl.operators.multiturn``: its
            environment's tokens are mask False but attended): the first ``completion_lens`` tokens
            are attended, log-probs are still 0 where the mask is False. None: the mask's prefix.
        packing: run the forward over packed rows (``flowrl.operators.packing``; the model's family
            must take them) where that costs fewer positions than padding; the same log-probs to float rounding.
        routed_experts: ``[S, Tp + C, layers, k]`` the experts a mixture of experts routes each token
            of the prompt and the completion through (the rollout field a generator with
            ``routing_replay`` records; ``flowrl.models.routing``), in the padded and the packed
            layout alike; None: the model's routers choose.
        agreement: adds, over the forward's recorded tokens, how often the model's own top-k equals
            ``routed_experts`` (``routing/agreement``).

    Returns:
        ``[S, C]`` float32.
    """
    logp, _ = _completion_logprobs(
        model, prompt_ids, prompt_lens, completion_ids, completion_mask,
        temperature=temperature, top_k=top_k, top_p=top_p, completion_lens=completion_lens, entropy=False, packing=packing,
        routed_experts=routed_experts, agreement=agreement,
    )  # fmt: skip
    return logp


def completion_logprobs_and_entropy(
    model: CausalLM,
    prompt_ids: Tensor,
    prompt_lens: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: Tensor | float = 1.0,
    top_k: Tensor | int = 0,
    top_p: Tensor | float = 1.0,
    completion_lens: Tensor | None = None,
    packing: bool = False,
    routed_experts: Tensor | None = None,
    agreement: RoutingAgreement | None = None,
) -> tuple[Tensor, Tensor]:
    """``completion_logprobs`` and, from the same forward pass, the entropy of the distribution each
    completion token was evaluated under (``entropy_of`` the truncated, renormalised ``p``; no gradient).

    Costs an ``exp`` and a sum over the vocabulary of the logits already computed, no forward pass.

    Returns:
        ``([S, C] log-probs, [S, C] entropies)``, both 0 where ``completion_mask`` is False.
    """
    logp, entropy = _completion_logprobs(
        model, prompt_ids, prompt_lens, completion_ids, completion_mask,
        temperature=temperature, top_k=top_k, top_p=top_p, completion_lens=completion_lens, entropy=True, packing=packing,
        routed_experts=routed_experts, agreement=agreement,
    )  # fmt: skip
    assert entropy is not None  # asked for
    return logp, entropy


def _completion_logprobs(
    model: CausalLM,
    prompt_ids: Tensor,
    prompt_lens: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: Tensor | float,
    top_k: Tensor | int,
    top_p: Tensor | float,
    completion_lens: Tensor | None,
    entropy: bool,
    packing: bool = False,
    routed_experts: Tensor | None = None,
    agreement: RoutingAgreement | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``completion_logprobs`` (see there), with the entropies ``[S, C]`` when ``entropy``, else None."""
    S = prompt_ids.shape[0]
    C = completion_ids.shape[1]
    out = torch.zeros(S, C, dtype=torch.float32, device=completion_ids.device)
    attended = attended_mask(completion_mask, completion_lens)
    used = int(attended.sum(1).max()) if S and C else 0  # trailing all-pad columns cost nothing
    if used == 0:
        return out, torch.zeros_like(out) if entropy else None
    # Leading columns that are padding in every row change nothing either.
    skip = int(prompt_ids.shape[1] - prompt_lens.max())
    routed = None if routed_experts is None else routed_columns(routed_experts, prompt_ids.shape[1], C)[:, skip:]  # [S, Tp + C, L, k]
    prompt_ids = prompt_ids[:, skip:]
    packed = (
        packed_logits(model, prompt_ids, prompt_lens, completion_ids[:, :used], attended[:, :used], routed_experts=routed, agreement=agreement)
        if packing
        else None
    )
    if packed is None:  # padded (packing off, or it would not shorten this batch)
        tokens, valid, _ = padded_layout(prompt_ids, prompt_lens, completion_ids, attended)
        with replaying(model, None if routed is None else routed[:, : tokens.shape[1]], owner="completion_logprobs", agreement=agreement):
            logits = model(tokens, valid=valid, keep=used)  # [S, used, V]: the last prompt token's logits predict y_0
        owner = torch.arange(S, device=logits.device)  # the sample of each row of logits
        targets = completion_ids[:, :used]  # [S, used]
    else:  # packed: [N, V], the attended completion tokens only, of samples `owner` at steps `step`
        logits, owner, step = packed
        targets = completion_ids[owner, step]  # [N]
    logits = logits.float()
    if isinstance(temperature, Tensor):
        logits = logits / temperature.to(logits)[owner].view(-1, *[1] * (logits.dim() - 1))
    elif temperature != 1.0:
        logits = logits / temperature
    settings = list(_settings(top_k, top_p, S))
    ent: Tensor | None = None
    if len(settings) == 1 and settings[0][2] is None:
        k, p, _ = settings[0]
        logp = truncated_log_softmax(logits, top_k=k, top_p=p)  # [..., V]; log_softmax when untruncated
        picked = logp.gather(-1, targets[..., None]).squeeze(-1)
        if entropy:
            ent = entropy_of(logp)
    else:  # samples drawn with different truncations: each setting on its samples' rows
        pieces, ents, order = [], [], []
        for k, p, chosen in settings:
            assert chosen is not None  # several settings: each names its samples
            rows = torch.isin(owner, chosen.to(owner.device)).nonzero().squeeze(1)
            logp = truncated_log_softmax(logits[rows], top_k=k, top_p=p)
            pieces.append(logp.gather(-1, targets[rows][..., None]).squeeze(-1))
            if entropy:
                ents.append(entropy_of(logp))
            order.append(rows)
        back = torch.argsort(torch.cat(order))
        picked = torch.cat(pieces)[back]
        if entropy:
            ent = torch.cat(ents)[back]
    zero = torch.zeros((), dtype=out.dtype, device=out.device)
    if packed is not None:  # back into the [S, C] layout
        out = out.index_put((owner, step), picked)
        ent = None if ent is None else torch.zeros_like(out).index_put((owner, step), ent.to(out.dtype))
    else:
        out = torch.cat([picked, out[:, used:]], dim=1) if used < C else picked
        if ent is not None:
            ent = torch.cat([ent, torch.zeros(S, C - used, dtype=ent.dtype, device=ent.device)], dim=1) if used < C else ent
    if ent is not None:
        ent = torch.where(completion_mask, ent, zero)
    return torch.where(completion_mask, out, zero), ent
