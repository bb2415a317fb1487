"""Float tolerances derived from float32 rounding at the magnitudes a test computes, not from one machine's output.

Two float32 evaluations of one model (vLLM's kernels and a transformers forward, a KV-cached decode
and a full forward, one row alone and the same row padded in a batch) differ by rounding only: each
sums the same products in another order. How far apart they may be follows from the computation:

* A dot product or sum of ``n`` float32 terms ``a_i b_i`` has an error of at most
  ``gamma_n * sum_i |a_i b_i|`` with ``gamma_n ~ n * u`` and ``u = eps32 / 2 = 2**-24`` (Higham,
  *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 3.1), whatever order or blocking a
  kernel uses. Two implementations each have that error: their difference is at most twice it.
* A transformer's relative error adds up layer by layer (RMSNorm and the residual stream carry a
  relative error forward; SwiGLU and rotary embeddings are Lipschitz with constant ~1 at these
  scales), so the final hidden state ``h`` carries ``u * N`` of relative error with ``N`` the sum of
  the reduction lengths on the path, the **depth** counted layer by layer (``reductions``): per
  layer the RMSNorm (hidden), the q/k/v projections (hidden), the attention scores (head_dim), the
  softmax's sum and the weighted sum of values (sequence length, twice), the output projection (heads
  x head_dim), the second RMSNorm (hidden), gate/up (hidden) and down (intermediate); then the final
  RMSNorm and the LM head (hidden each).
* A logit ``z_j = sum_i h_i W_ji`` then errs by at most ``u * N * M`` with ``M = max_j sum_i |h_i|
  |W_ji|``, the ``|h|.|W|`` sum of the logits actually computed (``head_magnitude``; hidden states
  captured at the LM head's input, over the test's own sequences). Cancellation in the sum does not
  shrink the error, which is why it is ``|h|.|W|``, not ``|z|``. Two evaluations' logits differ by
  at most twice that (``logit_atol``; a classifier's score head the same way). A run whose hidden
  states a test does not see bounds ``M`` from the weights (``weights_magnitude``, Cauchy-Schwarz),
  moved by the most its optimizer steps can move them (``trained_logprob_atol``, ``graph_logprob_atol``).
* ``log p_y = z_y - logsumexp(z)``, and logsumexp is 1-Lipschitz in the max norm, plus its own sum of
  ``vocab`` terms rounded relative to its value: ``|d log p| <= 2 max |dz| + vocab * u``.

So ``logprob_atol = 2 (two implementations) * (2 * u * N * M + vocab * u)``, and the ratio
``exp(pi - mu)`` of AIPO and the other objectives is 1 within ``ratio_atol = expm1(logprob_atol)``.
This is a worst-case bound, not a fit: on the vLLM test's model (2 layers, hidden 128, ~270
positions, ``M`` ~ 2) it is ~2e-3 where the errors seen are 1e-6 to 1e-5, so another CPU's kernels
(other blocking, other fused operations) stay inside it.

It must still fail a real bug. Wrong truncation (a top-p of 0.95 evaluated untruncated: log(1/0.95)
= 0.051), stale weights or a stale prefix cache (0.1 to 1 on these models) move a log-prob by 0.05 or
more; ``bound_logprob_atol`` refuses (``ToleranceTooLoose``) a tolerance above ``REAL_BUG / 2``, so
such a bug is at least twice the tolerance and fails the test, and a test whose magnitudes grow
until rounding and a bug could no longer be told apart fails loudly instead of passing a bug. Keep
test models small and near their initialisation (``M`` of a few; the vLLM test's weights perturbed by
0.2, ``M`` ~ 22, give 0.017).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = [
    "U32",
    "REAL_BUG",
    "ToleranceTooLoose",
    "reductions",
    "head_magnitude",
    "weights_magnitude",
    "trained_logprob_atol",
    "graph_logprob_atol",
    "bound_logprob_atol",
    "logprob_atol",
    "logit_atol",
    "rollout_sequences",
    "rollout_logprob_atol",
    "ratio_atol",
    "k3_atol",
]

#: float32's unit roundoff: half the gap between 1 and the next float32.
U32 = torch.finfo(torch.float32).eps / 2

#: The smallest log-prob error of a real bug the tests guard against: a top-p of 0.95 left out of pi
#: (log(1/0.95) = 0.0513), stale weights, a stale prefix cache. A tolerance stays 2x below it.
REAL_BUG = 0.05


class ToleranceTooLoose(AssertionError):
    """A derived tolerance too large to tell float32 rounding from a real bug."""


def _shape(model: Any) -> dict[str, int]:
    """The reduction lengths' ingredients of a flowrl ``CausalLM``, a built-in ``Transformer`` or a
    transformers model (its ``config``)."""
    inner = getattr(model, "hf", model)  # flowrl's HF wrapper holds the transformers model
    config = getattr(inner, "config", None)
    if hasattr(config, "n_layers"):  # the built-in ModelConfig
        return {
            "layers": config.n_layers,
            "hidden": config.dim,
            "heads_x_dim": config.n_heads * config.head_dim,
            "head_dim": config.head_dim,
            "intermediate": config.hidden_dim,
            "vocab": config.vocab_size,
        }
    if config is not None and hasattr(config, "num_hidden_layers"):
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return {
            "layers": config.num_hidden_layers,
            "hidden": config.hidden_size,
            "heads_x_dim": heads * head_dim,
            "head_dim": head_dim,
            "intermediate": config.intermediate_size,
            "vocab": config.vocab_size,
        }
    raise TypeError(f"no transformer shape found on {type(model).__name__}: pass reductions yourself")


def reductions(model: Any, seq_len: int) -> list[int]:
    """The length of every float32 reduction on a token's path through ``model``, layer by layer
    (see the module docstring), for sequences of up to ``seq_len`` tokens."""
    s = _shape(model)
    per_layer = [s["hidden"], s["hidden"], s["head_dim"], seq_len, seq_len, s["heads_x_dim"], s["hidden"], s["hidden"], s["intermediate"]]
    return per_layer * s["layers"] + [s["hidden"], s["hidden"]]


def _norm_and_head(model: Any) -> tuple[torch.nn.Module, torch.Tensor]:
    """The module whose output the LM head reads (the final norm) and the head's weight."""
    inner = getattr(model, "hf", model)
    if hasattr(inner, "get_output_embeddings"):  # transformers: a causal LM's head, or a classifier's score
        head = inner.get_output_embeddings() or inner.score
        return head, head.weight
    head = inner.output if getattr(inner, "output", None) is not None else None  # the built-in Transformer
    weight = head.weight if head is not None else inner.tok_embeddings.weight
    return inner.norm, weight


def head_magnitude(hidden: torch.Tensor, weight: torch.Tensor) -> float:
    """``M = max_j sum_i |h_i| |W_ji|`` over every position of ``hidden`` ``[..., d]`` and row of ``weight`` ``[V, d]``."""
    h = hidden.detach().reshape(-1, hidden.shape[-1]).double().abs()
    return float((h @ weight.detach().double().abs().T).max())


def weights_magnitude(model: Any, *, move: float = 0.0) -> float:
    """An upper bound of ``head_magnitude`` from the weights alone, for runs whose hidden states a test
    does not see: RMSNorm's output is ``g * x / rms(x)`` with ``|| x / rms(x) ||_2 = sqrt(d)``, so by
    Cauchy-Schwarz ``sum_i |h_i| |W_ji| <= sqrt(d) max|g| ||W_j||_2``; ``move``: every weight may have
    moved by that much since (``max|g| + move``, ``||W_j||_2 + sqrt(d) move``)."""
    inner = getattr(model, "hf", model)
    _, weight = _norm_and_head(model)
    norm = inner.norm if hasattr(inner, "norm") else inner.model.norm
    d = weight.shape[1]
    gain = float(norm.weight.detach().abs().max()) + move
    row = float(weight.detach().double().norm(dim=1).max()) + math.sqrt(d) * move
    return math.sqrt(d) * gain * row


def trained_logprob_atol(
    model: Any, *, seq_len: int, updates: int, lr: float, betas: tuple[float, float] = (0.9, 0.99), temperature: float = 1.0
) -> float:
    """The log-prob tolerance of a run's rows (mu against pi) after ``updates`` AdamW steps from
    ``model``'s weights, which a test does not see: ``weights_magnitude`` with every weight moved by
    the most AdamW moves one, ``lr * max(1, (1 - beta1) / sqrt(1 - beta2))`` a step (Kingma and Ba,
    *Adam*, section 2.1; decoupled weight decay only shrinks weights), over sequences of up to
    ``seq_len`` tokens."""
    beta1, beta2 = betas
    move = updates * lr * max(1.0, (1 - beta1) / math.sqrt(1 - beta2))
    magnitude = weights_magnitude(model, move=move)
    return bound_logprob_atol(magnitude, reductions(model, seq_len), _shape(model)["vocab"], temperature=temperature)


def graph_logprob_atol(graph: Any, *, steps: int) -> float:
    """``trained_logprob_atol`` for a run of ``graph`` (one policy, one generator) over ``steps`` trainer
    steps: the policy's initial model (its config's seed), its optimizer's lr and betas, its updates
    per batch, the generator's temperature, sequences up to the model's ``max_seq_len``."""
    from flowrl.models.registry import build_model

    (policy,) = graph.nodes_of_kind("policy")
    (generator,) = graph.nodes_of_kind("generator")
    model = build_model(policy.model)
    opt = policy.optimizer
    return trained_logprob_atol(
        model, seq_len=model.max_seq_len, updates=steps * graph.updates_per_batch(), lr=opt.lr, betas=tuple(opt.betas),
        temperature=generator.sampling.temperature,
    )


def bound_logprob_atol(magnitude: float, reduction_lengths: Sequence[int], vocab: int, *, temperature: float = 1.0) -> float:
    """The largest |difference| of one token's log-prob between two float32 evaluations (module
    docstring); at a sampling temperature ``T`` the logits are divided by ``T``, and so is their error.

    Raises:
        ToleranceTooLoose: when it exceeds ``REAL_BUG / 2``: such a test could pass a real bug.
    """
    one = 2 * U32 * sum(reduction_lengths) * magnitude / temperature + vocab * U32
    atol = 2 * one
    if atol > REAL_BUG / 2:
        raise ToleranceTooLoose(
            f"float32 rounding of this computation may reach {atol:.3g} in a log-prob (|h|.|W| magnitude {magnitude:.3g}, "
            f"reductions summing to {sum(reduction_lengths)}), above REAL_BUG / 2 = {REAL_BUG / 2}: it could not tell a "
            "real bug from rounding; use a smaller model or weights nearer their initialisation"
        )
    return atol


def _magnitude(model: Any, sequences: Iterable[torch.Tensor]) -> tuple[float, int]:
    """``head_magnitude`` over ``model``'s forward of each sequence, and the longest sequence's length."""
    module, weight = _norm_and_head(model)
    inner = getattr(model, "hf", model)
    seen: list[torch.Tensor] = []
    is_head = module is not getattr(inner, "norm", None)
    hook = module.register_forward_hook(lambda m, args, out: seen.append(args[0] if is_head else out))
    longest = 0
    try:
        with torch.no_grad():
            for seq in sequences:
                longest = max(longest, int(seq.numel()))
                ids = seq.reshape(1, -1)
                inner(input_ids=ids) if hasattr(inner, "get_output_embeddings") else inner(ids)
    finally:
        hook.remove()
    return max(head_magnitude(h, weight) for h in seen), longest


def logprob_atol(model: Any, sequences: Iterable[torch.Tensor], *, extra: Sequence[int] = (), temperature: float = 1.0) -> float:
    """The log-prob tolerance for ``model`` (a flowrl ``CausalLM``, a built-in ``Transformer`` or a
    transformers causal LM, peft's too) evaluated on ``sequences`` (1-D token ids each, unpadded), from
    the ``|h|.|W|`` magnitude of the logits it computes on them; ``extra``: reductions the model adds
    to the path (a LoRA adapter's rank, once per adapted layer)."""
    magnitude, longest = _magnitude(model, sequences)
    return bound_logprob_atol(magnitude, reductions(model, longest) + list(extra), _shape(model)["vocab"], temperature=temperature)


def logit_atol(model: Any, sequences: Iterable[torch.Tensor], *, extra: Sequence[int] = ()) -> float:
    """The tolerance between two float32 evaluations of ``model``'s logits on ``sequences``:
    ``2 * u * N * M`` (module docstring), under ``REAL_BUG / 2`` like the log-probs'."""
    magnitude, longest = _magnitude(model, sequences)
    atol = 2 * U32 * sum(reductions(model, longest) + list(extra)) * magnitude
    if atol > REAL_BUG / 2:
        raise ToleranceTooLoose(f"float32 rounding of these logits may reach {atol:.3g} (|h|.|W| magnitude {magnitude:.3g}), above REAL_BUG / 2")
    return atol


def rollout_sequences(rollout: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each sample's prompt and completion, unpadded (a multi-turn completion with its environment's
    tokens: ``completion_lens``)."""
    ids, lens, comp = rollout["sample_prompt_ids"], rollout["sample_prompt_lens"], rollout["completion_ids"]
    ends = rollout["completion_lens"] if "completion_lens" in rollout else rollout["completion_mask"].sum(1)
    width = ids.shape[1]
    return [torch.cat([ids[s, width - int(lens[s]) :], comp[s, : int(ends[s])]]) for s in range(ids.shape[0])]


def rollout_logprob_atol(model: Any, rollout: dict[str, torch.Tensor], *, extra: Sequence[int] = (), temperature: float = 1.0) -> float:
    """``logprob_atol`` over a rollout's sequences (prompt + completion of each sample)."""
    return logprob_atol(model, rollout_sequences(rollout), extra=extra, temperature=temperature)


def ratio_atol(logprob_tolerance: float) -> float:
    """How far ``exp(pi - mu)`` may be from 1 when ``|pi - mu| <= logprob_tolerance``."""
    return math.expm1(logprob_tolerance)


def k3_atol(logprob_tolerance: float) -> float:
    """How far the k3 KL estimate ``mean(r - 1 - log r)`` (``aipo/kl``, ``loss/kl_ref``) may be from 0
    when ``|log r| <= logprob_tolerance``: ``expm1(a) - a``, plus the float32 rounding of ``r = exp(log r)``
    near 1 (one ulp of 1, ``eps32``), which ``r - 1`` keeps."""
    return math.expm1(logprob_tolerance) - logprob_tolerance + torch.finfo(torch.float32).eps
