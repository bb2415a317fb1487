"""The one interface the operators use for any model: ``CausalLM``, and the weights a transport moves.

A ``CausalLM`` is an ``nn.Module`` whose ``state_dict()`` names are those of the model family (the
built-in transformer's own names, or Hugging Face parameter names), with:

- ``forward(tokens [B, T], *, valid [B, S], cache=None, keep=0) -> logits [B, T or keep, V]``:
  ``valid`` is True on real tokens over the cached past *and* the new tokens (``S = past + T``;
  prompts are left-padded); positions count real tokens before each token, pads are never attended.
  ``keep > 0`` returns the logits of the last ``keep`` positions only.
- ``forward(tokens [R, L], *, packed_positions [R, L])``, in a family with ``ModelFamily.packing``:
  packed rows, several sequences concatenated in each; each token's position within its own
  sequence, counting from 0, and a sequence starts wherever a position does not follow the one
  before it by 1 (transformers' packed-sequence convention); attention stays within each sequence,
  causal. No ``valid`` and no cache with it.
- ``new_cache(batch, max_len)``: an empty KV cache that ``forward`` extends.
- ``splice_cache(cache, part, source, rows, start) -> bool``: copy the keys/values of sequences
  ``source`` of another cache ``part`` (``T`` tokens) into rows ``rows``, positions
  ``[start, start + T)`` of ``cache`` (already filled; its length does not change), so that
  continuous batching prefills only the prompts it refills rows with; False, changing nothing,
  where the cache layout does not allow it.
- ``vocab_size`` (rows of the embedding) and ``max_seq_len`` (longest prompt + completion).
- ``enable_gradient_checkpointing()``: recompute block activations in the backward pass.

Tied weights (an output projection sharing the input embedding) appear once in ``weight_dict``,
under the first name ``state_dict`` gives them, so transports move each tensor once and both ends
of a weight edge hold the same names.

Example:
    >>> from flowrl.graph.configs import ModelConfig
    >>> from flowrl.models.registry import build_model
    >>> model = build_model(ModelConfig(vocab_size=16, dim=32, n_layers=1, n_heads=2, n_kv_heads=1))
    >>> isinstance(model, CausalLM), sorted(weight_dict(model))[:2]
    (True, ['layers.0.attention.wk.weight', 'layers.0.attention.wo.weight'])
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

__all__ = ["CausalLM", "as_module", "weight_dict"]


@runtime_checkable
class CausalLM(Protocol):
    """A causal language model as the operators see it (see the module docstring)."""

    vocab_size: int
    max_seq_len: int

    def __call__(self, tokens: Tensor, *, valid: Tensor | None = None, cache: Any = None, keep: int = 0, packed_positions: Tensor | None = None) -> Tensor: ...

    def new_cache(self, batch: int, max_len: int) -> Any: ...

    def splice_cache(self, cache: Any, part: Any, source: Tensor, rows: Tensor, start: int) -> bool: ...

    def enable_gradient_checkpointing(self) -> None: ...

    # The two ``nn.Module`` methods the operators call on any model (``as_module`` gives the rest).
    def train(self, mode: bool = True) -> Any: ...

    def eval(self) -> Any: ...


def as_module(model: CausalLM | nn.Module) -> nn.Module:
    """``model`` as the ``nn.Module`` every ``CausalLM`` is (a protocol cannot inherit a class, so the
    type checker learns it here, at run time).

    Raises:
        TypeError: when ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"a CausalLM is an nn.Module; got {type(model).__name__}")
    return model


def weight_dict(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` (views, not copies) without the entries that alias an earlier one.

    Args:
        model: any module.

    Returns:
        name -> tensor, each storage once (a tied ``lm_head.weight`` is dropped in favour of the
        embedding it shares).
    """
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():  # the Parameter objects: a tied one is the same object
        if id(t) in seen:
            continue
        seen.add(id(t))
        out[name] = t.detach()
    return out
