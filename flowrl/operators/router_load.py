"""A mixture-of-experts policy's routers in the trainer: the experts' load per layer and the load-balancing loss.

``RouterLoad(model, family, coef)`` hooks every router of the model (the modules the family's
``ModelFamily.router`` names: ``mlp.gate`` of each MoE block, whose forward returns its logits
``[tokens, experts]`` first) and the model's own forward (to know which of those rows are real
tokens). Inside ``with load.counting(part):`` each forward of the trainer records, over the real tokens
only (a padded forward's ``valid`` tokens; a packed forward's sequences, not its rows' padding tail,
whose layout ``flowrl.operators.packing.packed_real_mask`` gives):

- per layer, the tokens each expert receives: a token's top-``k`` experts by its router's
  probabilities (the family's own top-k; ties, as transformers', by ``torch.topk``), so each real
  token counts ``k`` times per layer;
- the load-balancing loss ``aux`` of that forward: transformers' ``load_balancing_loss_func``
  (Switch Transformer's, Fedus et al. 2021, eq. 4-6, pooled over the layers: ``E * sum_e f_e P_e``
  with ``f_e`` the share of top-k assignments expert ``e`` received and ``P_e`` its mean router
  probability, over every real token of every MoE layer), with gradients to the routers.

``metrics()`` then gives the step's ``moe/load_max_over_mean`` (per layer, the most tokens an expert
received over the mean an expert received, ``k * tokens / E``; averaged over the layers: 1 is a
perfect balance, ``E / k`` every token on the same experts), ``moe/load_max_over_mean_max`` (the worst
layer) and ``moe/aux_loss`` (the token-weighted mean of the forwards' ``aux``, whether or not it is
trained on). The trainer adds ``coef * aux * tokens / total`` to each micro-batch's loss (``total``:
the real tokens of all its micro-batches), so the gradient is the token-weighted mean's over
micro-batches (one micro-batch: exactly ``coef * aux`` of the batch).

Example:
    >>> import torch
    >>> counts = torch.tensor([[6.0, 2.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])  # 2 layers, 4 experts, 4 tokens x top-2
    >>> load_ratios(counts).tolist()
    [3.0, 1.0]
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from flowrl.models.family import ModelFamily
from flowrl.operators.logprobs import attended_mask
from flowrl.operators.packing import packed_real_mask

__all__ = ["RouterLoad", "load_ratios", "real_tokens"]


def load_ratios(counts: Tensor) -> Tensor:
    """Per layer, the most tokens an expert received over the mean an expert received: ``counts [layers, E]`` -> ``[layers]``."""
    mean = counts.sum(-1) / counts.shape[-1]
    return torch.where(mean > 0, counts.amax(-1) / mean.clamp(min=1e-30), torch.ones_like(mean))


def real_tokens(part: Mapping[str, Tensor]) -> int:
    """The real tokens a trainer's forward of ``part`` computes: each sample's prompt and attended
    completion, less the last token (which predicts nothing; ``flowrl.operators.logprobs.padded_layout``)."""
    attended = attended_mask(part["completion_mask"], part.get("completion_lens")).sum(1)
    n = part["sample_prompt_lens"].to(attended.device) + attended - 1
    return int(torch.where(attended > 0, n, 0).sum())


class RouterLoad:
    """The routers' hooks on one model and what they counted (module docstring).

    Args:
        model: the policy's ``HFCausalLM`` (its ``hf`` holds the transformers model).
        family: its family, a mixture of experts (``ModelFamily.router`` names its routers).
        coef: ``OptimizerConfig.router_aux_loss_coef`` (0: the loss is measured, not trained on).

    Attributes:
        layers: the routers' module names, in model order.
    """

    def __init__(self, model: nn.Module, family: ModelFamily, coef: float) -> None:
        inner: Any = getattr(model, "hf", model)  # the transformers model (not followed by the checker)
        config = inner.config
        self.experts, self.top_k, self.coef = int(config.num_experts), int(config.num_experts_per_tok), float(coef)
        routers = [(n, m) for n, m in inner.named_modules() if re.search(family.router, n)]
        self.layers = [n for n, _ in routers]
        self._loss_fn = getattr(sys.modules[type(inner).__module__], "load_balancing_loss_func")  # the family's own
        self._active = False
        self._logits: list[list[Tensor]] = [[] for _ in routers]
        self._real: list[Tensor] = []
        self.counts = torch.zeros(len(routers), self.experts, dtype=torch.float64)
        self._aux_sum, self._aux_tokens = 0.0, 0
        self._part: Mapping[str, Tensor] | None = None
        for i, (_, router) in enumerate(routers):
            router.register_forward_hook(self._router_hook(i))
        model.register_forward_pre_hook(self._model_hook, with_kwargs=True)

    def _router_hook(self, i: int) -> Any:
        def hook(module: nn.Module, args: Any, out: Any) -> None:
            if self._active:
                self._logits[i].append(out[0] if isinstance(out, tuple) else out)

        return hook

    def _model_hook(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if not self._active:
            return
        tokens = args[0] if args else kwargs["tokens"]
        if kwargs.get("packed_positions") is not None:
            assert self._part is not None
            p = self._part
            real = packed_real_mask(p["sample_prompt_lens"], attended_mask(p["completion_mask"], p.get("completion_lens")))
        else:
            valid = kwargs.get("valid")
            real = valid[:, -tokens.shape[1] :] if valid is not None else torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
        if tuple(real.shape) != tuple(tokens.shape):
            raise RuntimeError(f"router load: a forward of {tuple(tokens.shape)} tokens, real-token mask {tuple(real.shape)}; this is a flowrl bug")
        self._real.append(real.reshape(-1))

    @contextmanager
    def counting(self, part: Mapping[str, Tensor]) -> Iterator[None]:
        """Record the forwards of ``part`` inside: their load is counted and ``aux`` (the last
        forward's load-balancing loss, with gradients) set; nothing is recorded outside."""
        self._part, self._active = part, True
        self._logits = [[] for _ in self.layers]
        self._real = []
        self.aux: Tensor | None = None
        try:
            yield
        finally:
            self._active = False
        self._tally()

    def _tally(self) -> None:
        if not self._real and not any(self._logits):  # no forward ran (a micro-batch without attended tokens)
            return
        if any(len(l) != len(self._real) for l in self._logits):
            raise RuntimeError(f"router load: {len(self._real)} forwards but {[len(l) for l in self._logits]} router calls; this is a flowrl bug")
        real = torch.cat(self._real)
        per_layer = [torch.cat(l)[real.to(l[0].device)] for l in self._logits]  # [real tokens, E] per layer
        n = int(real.sum())
        if not n:
            return
        with torch.no_grad():
            for i, logits in enumerate(per_layer):
                top = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1).indices
                self.counts[i] += torch.bincount(top.reshape(-1).cpu(), minlength=self.experts).double()
        self.aux = self._loss_fn(tuple(per_layer), self.experts, self.top_k)
        self._aux_sum += float(self.aux.detach()) * n
        self._aux_tokens += n
        self._logits, self._real = [[] for _ in self.layers], []

    def metrics(self) -> dict[str, float]:
        """The load and aux loss counted since the last call (module docstring); empty if nothing was counted. Resets."""
        if not self._aux_tokens:
            return {}
        ratios = load_ratios(self.counts)
        out = {
            "moe/load_max_over_mean": float(ratios.mean()),
            "moe/load_max_over_mean_max": float(ratios.max()),
            "moe/aux_loss": self._aux_sum / self._aux_tokens,
        }
        self.counts.zero_()
        self._aux_sum, self._aux_tokens = 0.0, 0
        return out
