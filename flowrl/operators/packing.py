"""Sequence packing for the trainer's forward passes: a micro-batch's sequences concatenated into rows.

Padded, a micro-batch of S samples costs ``S x W`` positions, ``W`` its longest prompt + completion;
packed, its sequences (each the real prompt tokens, then the attended completion tokens but the
last, which predicts nothing) are laid into rows of ``L`` = the longest sequence by first-fit
decreasing, and it costs ``R x L`` positions with ``R`` rows, about ``sum(lengths) / L``. Positions
restart at 0 with each sequence and attention stays within it (``CausalLM.forward(packed_positions=)``:
the built-in model's ``packed_attention_mask``, transformers' packed-sequence detection), so every
sequence gets the computation it gets alone, as in the padded layout: the logits equal the padded
ones to float rounding, and so do the loss and its gradients whatever the aggregation, which reads
the log-probs of the same tokens, laid back into the ``[S, C]`` layout (``packed_logits`` gives the
logits of the attended completion tokens only, so the log-softmax skips the padding too).

A micro-batch that packing would not shorten (``R x L >= S x W``: equal lengths, or one sequence
per row anyway) runs padded: packing is never more positions than padding.

Example:
    >>> pack_rows([5, 2, 3, 1, 4], capacity=5)
    [[0], [4, 3], [2, 1]]
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from flowrl.errors import ConfigError
from flowrl.models.causal_lm import as_module
from flowrl.models.routing import RoutingAgreement, moe_shape, replaying, unrecorded

if TYPE_CHECKING:
    from flowrl.graph.configs import AnyModelConfig
    from flowrl.models.causal_lm import CausalLM

__all__ = ["pack_rows", "packed_logits", "packed_real_mask", "check_packing", "packs"]


def check_packing(config: AnyModelConfig, *, owner: str) -> None:
    """Refuse packing for a model whose family cannot take packed rows (``ModelFamily.packing``).

    Raises:
        ConfigError: naming the family and the families that can.
    """
    from flowrl.models.families import FAMILIES
    from flowrl.models.registry import family_of

    family = family_of(config, owner=owner)
    if not family.packing:
        able = [name for name, f in FAMILIES.items() if f.packing]
        raise ConfigError(
            f"{owner}: packing=True needs a model family whose attention takes packed rows; {family.name!r} does not "
            f"(the families that do: {', '.join(able)}); set packing=False or use one of those"
        )


def packs(requested: bool | None, config: AnyModelConfig, *, owner: str) -> bool:
    """Whether a node with ``packing=requested`` packs: ``None`` (the default) when its model's family
    takes packed rows (``ModelFamily.packing``), padded otherwise; ``True`` packs and refuses another
    family (``check_packing``); ``False`` pads.

    Raises:
        ConfigError: for ``True`` with a family that cannot pack, or a model description
            ``family_of`` cannot read.
    """
    from flowrl.models.registry import family_of

    if requested is None:
        return family_of(config, owner=owner).packing
    if requested:
        check_packing(config, owner=owner)
    return bool(requested)


def pack_rows(lengths: list[int], *, capacity: int) -> list[list[int]]:
    """Sequences (indices into ``lengths``) per row, first-fit decreasing into rows of ``capacity``
    tokens; a sequence of length 0 goes nowhere.

    Raises:
        ConfigError: for a sequence longer than ``capacity``.
    """
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        n = lengths[i]
        if n == 0:
            continue
        if n > capacity:
            raise ConfigError(f"a sequence of {n} tokens does not fit rows of {capacity}")
        r = next((r for r, free in enumerate(room) if free >= n), None)
        if r is None:
            rows.append([i])
            room.append(capacity - n)
        else:
            rows[r].append(i)
            room[r] -= n
    return rows


def _layout(prompt_lens: Tensor, attended: Tensor) -> tuple[list[int], int, list[list[int]]]:
    """``packed_logits``' rows: each sample's input length (prompt + attended completion, less the last
    token, which predicts nothing; 0 without a completion), the row length (the longest) and the rows."""
    n = [p_i + a_i - 1 if a_i > 0 else 0 for p_i, a_i in zip(prompt_lens.tolist(), attended.sum(1).tolist())]
    L = max(n, default=0)
    return n, L, pack_rows(n, capacity=L) if L else []


def packed_real_mask(prompt_lens: Tensor, attended: Tensor) -> Tensor:
    """Bool ``[R, L]``: the real tokens of the packed rows ``packed_logits`` lays out for these samples
    (each row's sequences, not its padding tail), for a caller that counts per token (a mixture of
    experts' router load, ``flowrl.operators.router_load``).

    Example:
        >>> packed_real_mask(torch.tensor([2, 3, 1]), torch.tensor([[True, True], [True, False], [True, True]])).int().tolist()
        [[1, 1, 1], [1, 1, 1], [1, 1, 0]]
    """
    n, L, rows = _layout(prompt_lens, attended)
    used = torch.tensor([sum(n[i] for i in members) for members in rows], dtype=torch.int64)
    return torch.arange(L)[None, :] < used[:, None]


def packed_logits(
    model: CausalLM,
    prompt_ids: Tensor,
    prompt_lens: Tensor,
    completion_ids: Tensor,
    attended: Tensor,
    *,
    routed_experts: Tensor | None = None,
    agreement: RoutingAgreement | None = None,
) -> tuple[Tensor, Tensor, Tensor] | None:
    """The logits predicting each attended completion token, computed over packed rows: ``(logits
    [N, V], sample [N], step [N])``, logit ``j`` predicting ``completion_ids[sample[j], step[j]]``;
    None when packing would not cost fewer positions than padding (the caller pads).

    Args:
        model: a ``CausalLM`` of a family with ``ModelFamily.packing``.
        prompt_ids: ``[S, Tp]`` left-padded prompts.
        prompt_lens: ``[S]`` real prompt lengths.
        completion_ids: ``[S, C]`` completions.
        attended: ``[S, C]`` bool, a prefix of each row: the completion tokens attended.
        routed_experts: ``[S, Tp + C', layers, k]`` (``C' >= C``) the experts of each prompt and completion
            token, laid into the packed rows with them and forced (``flowrl.models.routing.replaying``;
            the rows' padding routes by its own routers); None: the routers choose.
        agreement: counts the routers' agreement with ``routed_experts``.
    """
    S, Tp = prompt_ids.shape
    C = completion_ids.shape[1]
    p = prompt_lens.tolist()
    a = attended.sum(1).tolist()
    if any(a_i > 0 and p_i == 0 for p_i, a_i in zip(p, a)):
        return None  # a completion with no prompt before it: no position predicts its first token
    n, L, rows = _layout(prompt_lens, attended)
    if L == 0:
        return None
    if len(rows) * L >= S * (max(p) + C - 1):
        return None
    device = prompt_ids.device
    tokens = torch.zeros(len(rows) * L, dtype=prompt_ids.dtype, device=device)  # flat [R * L]; pads: id 0
    positions = torch.zeros(len(rows) * L, dtype=torch.int64, device=device)
    sources, sample, step = [], [], []  # where each wanted logit is (flat), and which token it predicts
    for r, members in enumerate(rows):
        offset = r * L
        for i in members:
            tokens[offset : offset + n[i]] = torch.cat([prompt_ids[i, Tp - p[i] :], completion_ids[i, : a[i] - 1]])
            positions[offset : offset + n[i]] = torch.arange(n[i], device=device)
            sources.append(torch.arange(offset + p[i] - 1, offset + n[i], device=device))
            sample.append(torch.full((a[i],), i, device=device))
            step.append(torch.arange(a[i], device=device))
            offset += n[i]
        tail = (r + 1) * L - offset  # the row's padding: a sequence of its own, never read
        positions[offset : offset + tail] = torch.arange(tail, device=device)
    routed = None
    if routed_experts is not None:  # each sequence's experts where its tokens went; the padding's: unrecorded
        routed = torch.full((len(rows) * L, *routed_experts.shape[2:]), unrecorded(moe_shape(as_module(model)).experts), dtype=routed_experts.dtype, device=device)
        for r, members in enumerate(rows):
            offset = r * L
            for i in members:
                routed[offset : offset + n[i]] = routed_experts[i, Tp - p[i] : Tp + a[i] - 1]
                offset += n[i]
    with replaying(model, routed, owner="packed_logits", agreement=agreement):
        logits = model(tokens.view(len(rows), L), packed_positions=positions.view(len(rows), L))  # [R, L, V]
    return logits.reshape(-1, logits.shape[-1])[torch.cat(sources)], torch.cat(sample), torch.cat(step)
