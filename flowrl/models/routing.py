"""Mixture-of-experts routing of a model's forward: find the routers, record the experts they choose, force given ones.

A MoE family declares where its routers are (``ModelFamily.router``, a module-name pattern); a dense
family has none. Each router's ``forward(h)`` returns ``(logits [N, E], weights [N, k], experts
[N, k])`` for the ``N`` tokens of the forward, row-major over ``[batch, time]``. This module works
through forward hooks on those modules, so it needs nothing from the model's code:

- ``RoutingRecorder``: each router's chosen experts, stacked ``[N, layers, k]`` per forward (the
  generator records every token it feeds, prompt and completion, as it decodes with the KV cache).
- ``RoutingReplay``: the router's output replaced by the given experts ``[N, layers, k]`` (also in the
  recomputation activation checkpointing runs in the backward pass), with the
  gate weights read from the router's *own* logits at those experts, as the family computes them:
  ``softmax(logits)`` in float32, gathered at the experts, renormalised over them when
  ``norm_topk_prob``, cast to the logits' dtype (transformers' ``Qwen3MoeTopKRouter``, op for op, so
  replaying a forward's own record gives bit-identical logits). An entry equal to the expert count
  (``unrecorded(E)``) is "not recorded": that token keeps the router's own choice. It counts, over the
  recorded tokens, how often the router's own top-k set equals the given one (``agreement``).

Routing travels as the rollout field ``routed_experts`` ``[sample, time, layer, top_k]`` (time: the
left-padded prompt's columns, then the completion's) in the smallest integer dtype that holds the
expert count and the "not recorded" mark (``expert_dtype``: uint8 up to 255 experts, int16 above).

Example:
    >>> expert_dtype(8), expert_dtype(256), unrecorded(8)
    (torch.uint8, torch.int16, 8)
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from flowrl.errors import ConfigError
from flowrl.models.causal_lm import CausalLM, as_module

__all__ = [
    "MoeShape",
    "moe_routers",
    "moe_shape",
    "expert_dtype",
    "unrecorded",
    "RoutingRecorder",
    "RoutingReplay",
    "RoutingAgreement",
    "routing_agreement",
    "replaying",
]

#: The largest expert count ``routed_experts`` can carry (int16, with one value left for "not recorded").
MAX_EXPERTS = 32766


@dataclass(frozen=True)
class MoeShape:
    """A MoE model's routing shape.

    Attributes:
        layers: routers (MoE blocks), in layer order.
        experts: experts per block (``E``).
        top_k: experts each token goes to (``k``).
        norm_topk_prob: the gate weights are renormalised over the chosen experts.
    """

    layers: int
    experts: int
    top_k: int
    norm_topk_prob: bool


def _model_type(model: nn.Module) -> str | None:
    """The transformers ``model_type`` of the first submodule carrying a config (None: not a Hugging Face model)."""
    for module in model.modules():
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        if isinstance(model_type, str):
            return model_type
    return None


def moe_routers(model: nn.Module) -> list[Any]:
    """The routers of ``model``, one per MoE block in layer order, as its family declares them
    (``ModelFamily.router``); ``[]`` for a dense model (the built-in transformer, Llama, Qwen2/3)."""
    from flowrl.models.families import FAMILIES

    family = FAMILIES.get(_model_type(model) or "builtin")
    if family is None or not family.router:
        return []
    found: list[tuple[int, Any]] = []  # transformers' router modules: num_experts, top_k, norm_topk_prob
    for name, module in model.named_modules():
        match = re.search(family.router, name)
        if match:
            found.append((int(match.group(1)), module))
    return [module for _, module in sorted(found, key=lambda pair: pair[0])]


def moe_shape(model: nn.Module, *, owner: str = "model") -> MoeShape:
    """The routing shape of a MoE ``model``.

    Raises:
        ConfigError: for a dense model (naming ``owner``), or routers that disagree on their experts.
    """
    routers = moe_routers(model)
    if not routers:
        kind = _model_type(model) or "builtin"
        raise ConfigError(f"{owner}: its model ({kind!r}) is dense, it has no mixture-of-experts routers to record or replay")
    shapes = {(int(r.num_experts), int(r.top_k), bool(r.norm_topk_prob)) for r in routers}
    if len(shapes) != 1:
        raise ConfigError(f"{owner}: its routers disagree on (experts, top_k, norm_topk_prob): {sorted(shapes)}")
    experts, top_k, norm = shapes.pop()
    if experts > MAX_EXPERTS:
        raise ConfigError(f"{owner}: {experts} experts exceed the {MAX_EXPERTS} that routed_experts (int16) can carry")
    return MoeShape(layers=len(routers), experts=experts, top_k=top_k, norm_topk_prob=norm)


def expert_dtype(experts: int) -> torch.dtype:
    """The dtype of ``routed_experts`` for ``experts`` experts: uint8 when the ids and ``unrecorded`` fit, else int16."""
    return torch.uint8 if experts <= 255 else torch.int16


def unrecorded(experts: int) -> int:
    """The value of a ``routed_experts`` entry that records nothing (the token keeps its router's own choice)."""
    return experts


def routing_agreement(own: Tensor, given: Tensor, experts: int) -> tuple[int, int]:
    """``(agree, total)`` over the recorded token-layer choices (``given`` not ``unrecorded``):
    those whose top-k *set* in ``own`` equals the one in ``given`` (``[..., k]`` each)."""
    recorded = (given != unrecorded(experts)).all(-1)
    same = (own.sort(-1).values == given.sort(-1).values.to(own.dtype)).all(-1)
    return int((same & recorded).sum()), int(recorded.sum())


class _Hooks:
    """Forward hooks on every router of a model, removed on ``close()`` / leaving the ``with`` block."""

    def __init__(self, model: nn.Module, *, owner: str) -> None:
        self.owner = owner
        self.shape = moe_shape(model, owner=owner)
        self._handles: list[RemovableHandle] = []
        for layer, router in enumerate(moe_routers(model)):
            self._handles.append(router.register_forward_hook(self._hook_of(layer)))

    def _hook_of(self, layer: int) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RoutingRecorder(_Hooks):
    """Records the experts every router chooses (see the module docstring); a dense model is refused.

    Example::

        with RoutingRecorder(model, owner="generator 'gen'") as rec:
            model(tokens)          # [B, T]
            experts = rec.take()   # [B * T, layers, k], int64
    """

    def __init__(self, model: nn.Module, *, owner: str) -> None:
        self._calls: list[list[Tensor]] = []
        super().__init__(model, owner=owner)
        self._calls = [[] for _ in range(self.shape.layers)]

    def _hook_of(self, layer: int) -> Any:
        def hook(module: nn.Module, args: Any, output: tuple[Tensor, Tensor, Tensor]) -> None:
            self._calls[layer].append(output[2].detach())

        return hook

    def take(self) -> Tensor:
        """The experts of the forward(s) since the last ``take``, ``[N, layers, k]`` (tokens of each
        forward in order), and forget them.

        Raises:
            ConfigError: when the routers saw different numbers of tokens (a forward left unfinished).
        """
        per_layer = [torch.cat(calls) if calls else torch.zeros(0, self.shape.top_k, dtype=torch.int64) for calls in self._calls]
        counts = {int(t.shape[0]) for t in per_layer}
        if len(counts) != 1:
            raise ConfigError(f"{self.owner}: its routers recorded different token counts {sorted(counts)}; a forward did not finish")
        for calls in self._calls:
            calls.clear()
        return torch.stack(per_layer, dim=1)


def _gate(logits: Tensor, chosen: Tensor, norm_topk_prob: bool) -> Tensor:
    """The gate weights at experts ``chosen`` ``[N, k]``, as the family computes them: softmax of the
    router's ``logits`` in float32, gathered, renormalised over the chosen when ``norm_topk_prob``."""
    weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, chosen)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward pass (activation checkpointing recomputes forwards there)."""
    return torch._C._current_graph_task_id() != -1


class _ReplaySlot:
    """The state of one router's permanent replay hook (``RoutingReplay``).

    Attributes:
        active: the replay the block now running forces, and this router's layer in it (None: the router chooses).
        saved: the experts the last forward that recorded gradients forced here: what a recomputation
            in the backward pass (activation checkpointing) must force again, after the block ended.
    """

    def __init__(self, norm_topk_prob: bool) -> None:
        self.active: tuple[RoutingReplay, int] | None = None
        self.saved: Tensor | None = None
        self.norm_topk_prob = norm_topk_prob

    def __call__(self, module: nn.Module, args: Any, output: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor] | None:
        logits, _, own = output
        backward = _in_backward()
        if self.active is not None:
            replay, layer = self.active
            chosen = replay.choose(layer, own, count=not backward)
        elif backward and self.saved is not None and self.saved.shape[0] == own.shape[0]:
            chosen = self.saved  # a checkpointed layer recomputed: the experts its forward was given
        else:
            if torch.is_grad_enabled() and not backward:
                self.saved = None
            return None  # the router's own output
        if torch.is_grad_enabled() and not backward:
            self.saved = chosen
        return logits, _gate(logits, chosen, self.norm_topk_prob), chosen


def _slots(model: nn.Module, *, owner: str) -> list[_ReplaySlot]:
    """Each router's replay slot, its hook registered (first, before any other hook) on first use and kept."""
    slots = []
    for router in moe_routers(model):
        slot = router.__dict__.get("_flowrl_replay")
        if slot is None:
            slot = _ReplaySlot(bool(router.norm_topk_prob))
            router.__dict__["_flowrl_replay"] = slot
            router.register_forward_hook(slot, prepend=True)
        slot.norm_topk_prob = bool(router.norm_topk_prob)
        slots.append(slot)
    return slots


class RoutingReplay:
    """Forces the given experts in every forward of its block (see the module docstring).

    Each router carries one permanent forward hook (registered on first use, inert outside a block):
    a forward that records gradients keeps the experts it was given, so that activation checkpointing,
    which recomputes a layer's forward in the backward pass after the block ended, routes it the same
    way (and is not counted twice in the agreement).

    Args:
        model: a MoE model.
        experts: ``[N, layers, k]`` integer, the experts of each of the ``N`` tokens each forward under
            it feeds (row-major ``[batch, time]``); ``unrecorded(E)`` where the router chooses.
        owner: names the node in errors.

    Attributes:
        agree, total: over the recorded token-layer choices of the forwards so far, how many had the
            router's own top-k set equal to the given one, and how many there were.
    """

    def __init__(self, model: nn.Module, experts: Tensor, *, owner: str) -> None:
        self.owner = owner
        self.shape = s = moe_shape(model, owner=owner)
        if experts.dim() != 3 or tuple(experts.shape[1:]) != (s.layers, s.top_k):
            raise ConfigError(
                f"{owner}: routed_experts has shape {tuple(experts.shape)}; its model routes through {s.layers} MoE layers "
                f"with top_k={s.top_k}, so it must be [tokens, {s.layers}, {s.top_k}] (was it recorded by another model?)"
            )
        if experts.numel() and int(experts.max()) > s.experts:
            raise ConfigError(f"{owner}: routed_experts names expert {int(experts.max())} but its model has {s.experts} experts")
        self.experts = experts.long()
        self.agree = 0
        self.total = 0
        self._slots = _slots(model, owner=owner)
        for layer, slot in enumerate(self._slots):
            slot.active = (self, layer)

    def choose(self, layer: int, own: Tensor, *, count: bool) -> Tensor:
        """The experts ``[N, k]`` layer ``layer`` routes by: the given ones, the router's ``own`` where
        unrecorded; counts the agreement when ``count``.

        Raises:
            ConfigError: when the forward's token count is not the given routing's.
        """
        given = self.experts[:, layer].to(own.device)  # [N, k]
        if given.shape[0] != own.shape[0]:
            raise ConfigError(
                f"{self.owner}: the forward routes {own.shape[0]} tokens but routed_experts holds {given.shape[0]}; "
                "the replayed routing must be laid out as the forward's tokens"
            )
        if count:
            agree, total = routing_agreement(own, given, self.shape.experts)
            self.agree += agree
            self.total += total
        free = (given == unrecorded(self.shape.experts)).any(-1, keepdim=True)  # [N, 1]: the router's own choice
        return torch.where(free, own, given)

    def close(self) -> None:
        """End the block: the routers choose again (a recomputation in backward still forces what its forward did)."""
        for slot in self._slots:
            if slot.active is not None and slot.active[0] is self:
                slot.active = None

    def __enter__(self) -> RoutingReplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class RoutingAgreement:
    """A running count of routing agreement (``RoutingReplay.agree`` / ``total``), summed over forwards.

    Attributes:
        agree: recorded token-layer choices whose router's own top-k set equalled the given one.
        total: recorded token-layer choices seen.
    """

    agree: int = 0
    total: int = 0

    def metrics(self) -> dict[str, float]:
        """``routing/agreement`` (``agree / total``) and ``routing/tokens`` (``total``: token-layer choices); ``{}`` when nothing was replayed."""
        return {"routing/agreement": self.agree / self.total, "routing/tokens": float(self.total)} if self.total else {}


@contextlib.contextmanager
def replaying(model: nn.Module | CausalLM, experts: Tensor | None, *, owner: str, agreement: RoutingAgreement | None = None) -> Iterator[None]:
    """Run the block's forwards with ``experts`` ``[..., layers, k]`` forced (``RoutingReplay``; the
    leading dims flattened are the forward's tokens, row-major); nothing when ``experts`` is None.
    Adds the block's agreement to ``agreement``."""
    if experts is None:
        yield
        return
    with RoutingReplay(as_module(model), experts.reshape(-1, *experts.shape[-2:]), owner=owner) as replay:
        yield
    if agreement is not None:
        agreement.agree += replay.agree
        agreement.total += replay.total
