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

Gradients between two float32 computations of one loss (``GradientMagnitudes``), the global norm and
clipping (``grad_norm_atol``, ``clipped_atol``) and a parameter after an AdamW step
(``adamw_param_atol``) are derived the same way further down ("gradients and AdamW steps").
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
    "TokenTerms",
    "entropy_atol",
    "bound_entropy_atol",
    "logits_magnitude",
    "GRAD_REAL_BUG",
    "LAMBDA",
    "GradientMagnitudes",
    "assert_within",
    "grad_norm_atol",
    "clipped_atol",
    "adamw_param_atol",
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


def logits_magnitude(model: Any, sequences: Iterable[torch.Tensor]) -> float:
    """``M``: the ``|h|.|W|`` magnitude of ``model``'s logits on ``sequences``, which bounds every ``|z_j|``."""
    return _magnitude(model, sequences)[0]


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


class TokenTerms:
    """How far two float32 evaluations of a loss's per-token statistics may be apart (``loss``, the
    ratio and KL means and maxima of a metrics row) when their log-probs ``log pi`` differ by at most
    ``logprob_tol`` token by token (``logprob_atol``).

    Every such statistic is a weighted average (weights summing to at most 1: ``token_mean``,
    ``seq_mean``, ``dr_grpo``'s constant divisor) or a maximum of per-token terms built from the ratios
    ``r = exp(log pi - log mu)`` and ``r_ref = exp(log ref - log pi)``: ``r`` and its clip or
    truncation times an advantage ``A``, the k3 KL ``r - 1 - log r`` and ``kl_coef`` times its
    reference counterpart. With ``log pi`` moved by ``e`` (``|e| <= logprob_tol``), ``r`` moves by at most
    ``r expm1(|e|)`` and the k3 term by ``r expm1(|e|) + |e| <= (r + 1) expm1(|e|)``, so each term moves
    by at most ``scale * expm1(logprob_tol)`` with ``scale = (|A|max + 2) R + kl_coef (R_ref + 2)``
    (``R``, ``R_ref``: the largest ratios over the kept tokens, widened by ``logprob_tol``), and is
    itself at most ``scale`` in size (``r - 1 - log r <= 2 r``). Each evaluation then rounds an
    ``n``-term float32 sum of such terms, by at most ``gamma_n scale`` (Higham, section 3.1).

    A fraction of tokens past a threshold (``clip_frac``, ``truncated_frac``) changes only when a
    token's ratio lies within its tolerance of the threshold: ``near`` counts those.
    """

    def __init__(self, logp: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, *, logprob_tol: float, advantages: torch.Tensor,
                 ref: torch.Tensor | None = None, kl_coef: float = 0.0) -> None:  # fmt: skip
        keep = mask.bool()
        self.logprob_tol, self.n = logprob_tol, int(keep.sum())
        self.log_ratio = (logp - mu)[keep]
        ratio_max = math.exp(float(self.log_ratio.abs().max()) + logprob_tol) if self.n else 1.0
        ref_max = math.exp(float((ref - logp)[keep].abs().max()) + logprob_tol) if ref is not None and self.n else 1.0
        self.scale = (float(advantages.abs().max()) + 2) * ratio_max + kl_coef * (ref_max + 2)

    def atol(self) -> float:
        """The bound of the class docstring: ``scale * expm1(logprob_tol) + 2 gamma_n scale``."""
        gamma = self.n * U32 / (1 - self.n * U32)
        return self.scale * math.expm1(self.logprob_tol) + 2 * gamma * self.scale

    def near(self, thresholds: Iterable[float]) -> int:
        """How many kept tokens have a ratio within its tolerance of one of ``thresholds`` (ratios)."""
        logs = torch.tensor([math.log(t) for t in thresholds if t > 0], dtype=torch.float64)
        if not len(logs) or not self.n:
            return 0
        gap = (self.log_ratio.double()[:, None] - logs[None, :]).abs().min(dim=1).values
        return int((gap <= self.logprob_tol).sum())


def bound_entropy_atol(magnitude: float, logit_tol: float, *, vocab: int, n: int, temperature: float = 1.0) -> float:
    """How far two float32 evaluations of the mean entropy of ``softmax(z / T)`` over ``n`` tokens may
    be apart when their logits differ by at most ``logit_tol`` (``logit_atol``) and ``|z_j| <= magnitude``
    (``M``, the ``|h|.|W|`` bound of the module docstring).

    ``dH/dy_j = -p_j (y_j - sum_k p_k y_k)`` for ``y = z / T``, so ``H`` moves by at most
    ``sum_j p_j |y_j - y_bar| * max|dy| <= (2 M / T) (logit_tol / T)`` to first order; each evaluation
    rounds a ``vocab``-term log-sum-exp and ``p . y`` (terms up to ``log V + 2 M / T``) and the mean over
    ``n`` tokens of entropies up to ``log V``.
    """
    first_order = (2 * magnitude / temperature) * (logit_tol / temperature)
    per_token = vocab * U32 * (math.log(vocab) + 2 * magnitude / temperature)
    mean = n * U32 / (1 - n * U32) * math.log(vocab)
    return first_order + 2 * (per_token + mean)


def entropy_atol(model: Any, sequences: Sequence[torch.Tensor], *, n: int, temperature: float = 1.0) -> float:
    """``bound_entropy_atol`` for ``model``'s forward on ``sequences`` (its magnitude, ``logit_atol``, its vocabulary)."""
    magnitude = logits_magnitude(model, sequences)
    return bound_entropy_atol(magnitude, logit_atol(model, sequences), vocab=_shape(model)["vocab"], n=n, temperature=temperature)


# -- gradients and AdamW steps ---------------------------------------------------------------------
#
# Two float32 computations of one loss's gradient (the whole batch against micro-batches, one process
# against data-parallel ranks whose partial gradients are all-reduced, FSDP's reduce-scatter, a padded
# batch against rows alone) sum the same per-token contributions in another order. A weight's gradient
# is such a sum: for a linear layer ``y = x W^T (+ b)``, ``dL/dW_ij = sum_t delta_ti x_tj`` over every
# position ``t`` of the batch (``delta = dL/dy``), ``dL/db_i = sum_t delta_ti``; an embedding row sums
# the ``delta`` of the positions holding its token; an RMSNorm gain ``g`` sums ``delta_t * x_t/rms(x_t)``.
# Higham's bound (section 3.1, as for the forward) applied to that sum and to the factors:
#
# * every contribution ``c_t = delta_ti x_tj`` carries the errors of its factors: ``x_t`` the forward's,
#   ``u * N`` (``N = sum(reductions(model, seq_len))``, the module docstring's depth), and ``delta_t``
#   the backward's, which runs the same reductions transposed from the loss down to the layer (``u * N``
#   again), from a ``delta`` at the logits ``w_t (onehot - p) / T`` whose ``p`` and whose per-token
#   weight ``w_t`` (an AIPO/PPO ratio ``exp(log p - mu)``, clipped or not) carry the log-prob's error
#   ``e = 2 u N M / T + vocab u`` as a relative error each (``M`` the |h|.|W| magnitude at the LM head,
#   as for the log-probs). These errors are taken normwise: a matrix-vector product's element errs by
#   ``gamma_n (|A| |x|)_i`` (Higham section 3.5), the scale of its terms, not of its value, and through
#   a chain of layers that scale is the whole vector's: ``delta_ti`` errs by ``(2 e + u N) max_i |delta_ti|``, ``x_tj`` by ``u N max_j |x_tj|``. So
#   ``c_t`` errs by ``(2 e + 2 u N) (max|delta_t| |x_tj| + |delta_ti| max|x_t|)``, summed over ``t``: the
#   **normwise** sum ``S' = sum_t (max|delta_t| |x_tj| + |delta_ti| max|x_t|)``. (An elementwise model,
#   relative to ``|delta_ti|`` itself, was 6x short of a difference seen on an HF embedding row.)
# * the sum of the ``n`` contributions adds ``gamma_n ~ u n`` of ``S = sum_t |c_t|`` in any order or
#   blocking (micro-batches, ranks, shards: the same terms in another tree; section 3.1), and each of the
#   ``P`` partial gradients is scaled by its normaliser (its share of the batch's tokens or sequences)
#   once and then accumulated or all-reduced: ``u P`` more;
# * so one computation's gradient entry errs by at most ``(2 e + 2 u N) S' + u (n + P) S``, both sums
#   captured by hooks on the layers during a backward of the test's own batch (``GradientMagnitudes``);
#   two computations: twice that (``GradientMagnitudes.tolerances``). Cancellation in the sum does not
#   shrink the error: it is ``S``, not ``|grad|``, as ``|h|.|W|`` is for a logit. The model is first
#   order (every relative error << 1).
# * Worst case (``gamma_n = n u``) it is refused on test_torchrun's 256-sample batch (13% of the
#   gradient's norm: its sums are 110x the norm, the advantages cancel). The gradients therefore take
#   Higham and Mary's probabilistic bound (*A New Approach to Probabilistic Rounding Error Analysis*,
#   SIAM J. Sci. Comput. 41(5), 2019, theorem 2.4): with rounding errors independent and of mean zero,
#   a sum of ``n`` terms errs by at most ``lambda sqrt(n) u sum|terms|`` except with probability
#   ``2 n exp(-lambda^2 / 2)``; ``LAMBDA = 8`` makes that < 1e-8. Every ``u n`` above becomes
#   ``LAMBDA sqrt(n) u`` (``e`` too). The positions' path errors, independent in the same model, add
#   up by Hoeffding's inequality: ``sum_t eps_t a_t`` with ``|eps_t| <= eps`` exceeds
#   ``LAMBDA eps sqrt(sum_t a_t^2)`` with probability ``2 exp(-LAMBDA^2 / 2)`` (< 3e-14), so ``S'`` is
#   replaced by ``min(S', LAMBDA sqrt(sum_t a_t^2))``, ``a_t`` the normwise contribution (a batch of
#   thousands of positions: ~50x tighter; a few positions: ``S'``). On the trainer, HF and LoRA tests
#   the bound is 700x to 2000x the differences seen; a rank's equal share instead of its token share
#   exceeds it 3.6x (test_torchrun) and 4.6x (test_fsdp).
#
# It must still fail a real bug: a gradient off by a factor of 2, by a missing or wrong normaliser, a
# dropped micro-batch or rank share moves it by 10% of its norm or more (``GRAD_REAL_BUG``); the
# tolerances are refused (``ToleranceTooLoose``) when their norm exceeds half of that of the gradient,
# so no such bug fits inside them.
#
# AdamW (Loshchilov and Hutter; torch's ``AdamW``) moves a parameter by ``lr * r`` with
# ``r = mhat / (sqrt(vhat) + eps)``, ``mhat = sum_k a_k g_k`` and ``vhat = sum_k w_k g_k^2`` bias-corrected
# averages of the gradients (weights ``a_k``, ``w_k`` summing to 1; ``a_n = (1 - b1) / (1 - b1^n)`` and
# ``w_n = (1 - b2) / (1 - b2^n)`` for the newest). When two runs' states agree before a step and the
# step's gradients differ by at most ``d`` an element: ``|d mhat| <= a_n d``; ``s = sqrt(vhat)`` is a
# weighted 2-norm of the gradient history, so ``|d s| <= sqrt(w_n) d`` (triangle inequality); hence
# ``|d r| <= a_n d / (s + eps) + |mhat'| sqrt(w_n) d / ((s + eps)(s' + eps))`` with ``s' >= s - sqrt(w_n) d``
# and ``|mhat'| <= |mhat| + a_n d``, and never more than ``|r| + |r'| <= |r| + c`` (Cauchy-Schwarz:
# ``|mhat| <= c s``, ``c = sqrt(sum_k a_k^2 / w_k)``, 1 on the first step; Kingma and Ba, *Adam*,
# section 2.1). That is ``lr`` times the relative error of ``m / sqrt(v)``: ~``2 d / |g|`` where ``|g|``
# is well above ``d``, and up to ``2 lr`` (a sign flip of ``lr * sign(g)``) where a gradient is within
# rounding of 0, which is why an Adam step magnifies rounding there. The parameter's own rounding to
# float32 adds ``u |p'|`` per run and the float32 evaluation of ``r`` a few ``u`` of ``lr c``
# (``adamw_param_atol``).

#: ``lambda`` of Higham and Mary's probabilistic bound: a sum of ``n`` terms errs by more than
#: ``lambda sqrt(n) u sum|terms|`` with probability at most ``2 n exp(-lambda^2 / 2)`` (< 1e-8 for n < 1e5; Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019, theorem 2.4).
LAMBDA = 8.0

#: The smallest relative change of a gradient (in norm) by a real bug the gradient tests guard against: a
#: dropped micro-batch or rank share (1 sample in 10), a normaliser off by one token in 10, a factor of 2.
GRAD_REAL_BUG = 0.1


class GradientMagnitudes:
    """Hooks capturing ``S = sum_t |c_t|`` and the normwise ``S'`` of every parameter's gradient
    contributions (the comment above) during whatever forwards and backwards run inside ``with GradientMagnitudes(model) as mags:``
    (a reference's ``loss.backward()``, a ``Trainer.train_step``), and the ``|h|.|W|`` magnitude of the
    logits computed. Linear layers (peft's ``lora_A``/``lora_B`` too), embeddings, RMSNorm gains and the
    built-in model's tied head are covered; a parameter that gets a gradient none of them accounts for
    raises ``TypeError`` in ``tolerances``. Do not use it on a gradient-checkpointed model (its recomputed
    forwards would count twice)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.inner = getattr(model, "hf", model)
        self._sums: dict[int, torch.Tensor] = {}
        self._terms: dict[int, int] = {}
        self._hidden: list[torch.Tensor] = []
        self._handles: list[Any] = []
        self._last_norm: torch.Tensor | None = None

    def _add(self, param: torch.Tensor, elementwise: torch.Tensor, normwise: torch.Tensor, squares: torch.Tensor, terms: int) -> None:
        key = id(param)
        if key in self._sums:
            elementwise, normwise, squares = (a + b for a, b in zip(self._sums[key], (elementwise, normwise, squares)))
        self._sums[key] = (elementwise, normwise, squares)
        self._terms[key] = self._terms.get(key, 0) + terms

    def _on_grad(self, out: Any, fn: Any) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda delta: fn(delta.detach().double().abs()))

    def _outer(self, param: torch.Tensor, d: torch.Tensor, x: torch.Tensor) -> None:
        """``sum_t |delta_t| |x_t|^T`` (elementwise) and ``sum_t (max|delta_t| |x_t| + |delta_t| max|x_t|)``
        (normwise) of a gradient ``sum_t delta_t x_t^T``; ``d`` ``[n, out]``, ``x`` ``[n, in]``, both absolute."""
        dmax, xmax = d.amax(1), x.amax(1)
        squares = (dmax.square() @ x.square())[None, :] + 2 * (d * (dmax * xmax)[:, None]).T @ x + (d.square().T @ xmax.square())[:, None]
        self._add(param, d.T @ x, (dmax @ x)[None, :] + (d.T @ xmax)[:, None], squares, d.shape[0])

    def _linear(self, module: torch.nn.Linear, args: tuple, out: torch.Tensor) -> None:
        x = args[0].detach().reshape(-1, module.in_features).double().abs()

        def grad(delta: torch.Tensor) -> None:
            d = delta.reshape(-1, module.out_features)
            if module.weight.requires_grad:
                self._outer(module.weight, d, x)
            if module.bias is not None and module.bias.requires_grad:
                self._add(module.bias, d.sum(0), d.sum(0) + d.amax(1).sum(), (d + d.amax(1, keepdim=True)).square().sum(0), d.shape[0])

        self._on_grad(out, grad)

    def _embedding(self, module: torch.nn.Embedding, args: tuple, out: torch.Tensor) -> None:
        ids = args[0].detach().reshape(-1)  # a one-hot input: max|x_t| = 1

        def grad(delta: torch.Tensor) -> None:
            d = delta.reshape(ids.numel(), -1)
            zeros = torch.zeros_like(module.weight, dtype=torch.float64)
            elementwise = zeros.index_add(0, ids, d)
            dmax = d.amax(1, keepdim=True)
            squares = zeros.index_add(0, ids, (d + dmax).square())
            self._add(module.weight, elementwise, elementwise + zeros.index_add(0, ids, dmax.expand_as(d)), squares, ids.numel())

        if module.weight.requires_grad:
            self._on_grad(out, grad)

    def _norm(self, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
        x = args[0].detach().double()
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).abs().reshape(-1, x.shape[-1])
        if module is getattr(self.inner, "norm", None):
            self._last_norm = out.detach()

        def grad(delta: torch.Tensor) -> None:  # sum_t delta_t * xhat_t, element by element
            d = delta.reshape(normed.shape)
            a = d.amax(1, keepdim=True) * normed + d * normed.amax(1, keepdim=True)
            self._add(module.weight, (d * normed).sum(0), a.sum(0), a.square().sum(0), d.shape[0])

        if module.weight.requires_grad:
            self._on_grad(out, grad)

    def _tied_head(self, module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
        """The built-in model with tied embeddings: ``logits = norm(x) E^T`` outside any module."""
        if self._last_norm is None or not isinstance(out, torch.Tensor):
            return
        h = self._last_norm[:, -out.shape[1] :].reshape(-1, self._last_norm.shape[-1]).double().abs()
        weight = self.inner.tok_embeddings.weight
        if weight.requires_grad:
            self._on_grad(out, lambda d: self._outer(weight, d.reshape(h.shape[0], -1), h))

    def __enter__(self) -> GradientMagnitudes:
        for module in self.inner.modules():
            if isinstance(module, torch.nn.Linear):
                self._handles.append(module.register_forward_hook(self._linear))
            elif isinstance(module, torch.nn.Embedding):
                self._handles.append(module.register_forward_hook(self._embedding))
            elif (
                isinstance(getattr(module, "weight", None), torch.nn.Parameter) and module.weight.dim() == 1
                and (hasattr(module, "eps") or hasattr(module, "variance_epsilon"))
            ):
                self._handles.append(module.register_forward_hook(self._norm))
        if getattr(self.inner, "output", 0) is None and hasattr(self.inner, "tok_embeddings"):
            self._handles.append(self.inner.register_forward_hook(self._tied_head))
        try:
            head, _ = _norm_and_head(self.model)
        except AttributeError:  # not a language model (a unit test's layer): no logits, no M
            return self
        is_head = head is not getattr(self.inner, "norm", None)
        self._handles.append(head.register_forward_hook(lambda m, args, out: self._hidden.append((args[0] if is_head else out).detach())))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def head_magnitude(self) -> float:
        """``M``: the |h|.|W| magnitude of the logits computed inside the ``with``."""
        _, weight = _norm_and_head(self.model)
        return max(head_magnitude(h, weight) for h in self._hidden)

    def tolerances(
        self, *, seq_len: int, partials: int = 1, positions: int = 0, temperature: float = 1.0, extra: Sequence[int] = (),
        named: Iterable[tuple[str, torch.nn.Parameter]] | None = None, grad_norm: float | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per element, the largest difference of each parameter's gradient between two float32
        computations of this loss (the comment above): ``2 ((2 e + 2 u N) S' + u (n + P) S)``.

        Args:
            seq_len: the longest sequence (padded width) either computation runs.
            partials: ``P``, the partial gradients scaled and summed (micro-batches x ranks), the larger
                of the two computations'.
            positions: the other computation's summed positions, when it sums more (a padded batch).
            temperature: the loss's sampling temperature (its logits are divided by it).
            extra: reductions the model adds to a token's path (a LoRA adapter's rank per adapted layer).
            named: ``(name, parameter)`` pairs to report (default: ``model.named_parameters()``).
            grad_norm: the gradients' norm before any clipping (a ``train_step``'s ``policy/grad_norm``),
                when ``.grad`` holds them clipped (default: the norm of ``.grad``).

        Raises:
            ToleranceTooLoose: the tolerances' norm exceeds ``GRAD_REAL_BUG / 2`` of the gradients'.
            TypeError: a parameter has a gradient whose contributions no hook saw.
        """
        shape = _shape(self.model)
        depth = sum(reductions(self.model, seq_len)) + sum(extra)

        def gamma(n: int) -> float:  # Higham and Mary's probabilistic gamma~_n(lambda) ~ lambda sqrt(n) u
            return LAMBDA * math.sqrt(n) * U32

        e = 2 * gamma(depth) * self.head_magnitude() / temperature + gamma(shape["vocab"])
        out: dict[str, torch.Tensor] = {}
        tol_sq = grad_sq = 0.0
        pairs = list(named) if named is not None else list(self.model.named_parameters())
        for name, param in pairs:
            if param.grad is None:
                continue
            if id(param) not in self._sums:
                raise TypeError(f"no gradient magnitude captured for {name}: add a hook for its module to GradientMagnitudes")
            n = max(self._terms[id(param)], positions)
            elementwise, normwise, squares = self._sums[id(param)]
            across = torch.minimum(normwise, LAMBDA * squares.sqrt())  # the positions' errors summed: Hoeffding, or worst case
            tol = (2 * ((2 * e + 2 * gamma(depth)) * across + gamma(n + partials) * elementwise)).reshape(param.shape).float()
            out[name] = tol
            tol_sq += float(tol.double().pow(2).sum())
            grad_sq += float(param.grad.double().pow(2).sum())
        if grad_norm is not None:
            grad_sq = grad_norm**2
        if math.sqrt(tol_sq) > GRAD_REAL_BUG / 2 * math.sqrt(grad_sq):
            raise ToleranceTooLoose(
                f"float32 rounding of this gradient may reach {math.sqrt(tol_sq):.3g} in norm, above GRAD_REAL_BUG / 2 = "
                f"{GRAD_REAL_BUG / 2} of the gradient's norm {math.sqrt(grad_sq):.3g}: it could not tell a real bug from rounding"
            )
        return out


def grad_norm_atol(tolerances: dict[str, torch.Tensor], grad_norm: float) -> float:
    """How far two computations' global gradient norms may be apart when their gradients are within
    ``tolerances`` element by element: ``||t||_2`` (triangle inequality) plus each norm's own float32
    rounding, a sum of ``numel`` squares (``gamma_numel`` relative on the square, half on its root)."""
    numel = sum(t.numel() for t in tolerances.values())
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tolerances.values())) + numel * U32 * grad_norm


def clipped_atol(tolerances: dict[str, torch.Tensor], clipped: dict[str, torch.Tensor], *, grad_norm: float, max_norm: float) -> dict[str, torch.Tensor]:
    """The tolerances of gradients after ``clip_grad_norm_(max_norm)`` (``clipped``: one run's, after
    the clip; ``grad_norm``: its norm before), from those before it: each run scales by
    ``c = min(1, max_norm / (norm + 1e-6))``, whose relative difference between the runs is at most the
    norms' (``grad_norm_atol / grad_norm``), so ``c t + (dn / n + u) |c g|``."""
    if not max_norm or max_norm <= 0:
        return tolerances
    scale = min(1.0, max_norm / (grad_norm + 1e-6))
    rel = grad_norm_atol(tolerances, grad_norm) / grad_norm + U32
    return {name: scale * t + rel * clipped[name].detach().abs().float() for name, t in tolerances.items()}


def assert_within(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor | float, msg: str = "") -> None:
    """``|actual - expected| <= tol`` element by element (a per-element tolerance from the helpers here)."""
    diff = (actual.double() - expected.double()).abs()
    excess = diff - torch.as_tensor(tol, dtype=torch.float64)
    if bool((excess > 0).any()):
        i = int(excess.reshape(-1).argmax())
        bound = torch.as_tensor(tol, dtype=torch.float64).expand_as(diff).reshape(-1)[i]
        raise AssertionError(
            f"{msg}: {int((excess > 0).sum())} of {diff.numel()} elements differ by more than their float32 bound; worst: "
            f"{float(diff.reshape(-1)[i]):.3g} > {float(bound):.3g} ({float(actual.reshape(-1)[i]):.6g} vs {float(expected.reshape(-1)[i]):.6g})"
        )


def _adam_weights(step: int, beta1: float, beta2: float) -> tuple[float, float, float]:
    """``(a_n, w_n, c)`` of the comment above at step ``n`` (counted from 1)."""
    a = [(1 - beta1) * beta1 ** (step - k) / (1 - beta1**step) for k in range(1, step + 1)]
    w = [(1 - beta2) * beta2 ** (step - k) / (1 - beta2**step) for k in range(1, step + 1)]
    return a[-1], w[-1], math.sqrt(sum(ai * ai / wi for ai, wi in zip(a, w)))


def adamw_param_atol(
    grad_atol: torch.Tensor | float, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, param: torch.Tensor, *, step: int, lr: float,
    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
) -> torch.Tensor:
    """Per element, the largest difference of a parameter between two runs after an AdamW step whose
    states agreed before it and whose gradients differ by at most ``grad_atol`` (``GradientMagnitudes``'
    bound), from one run's state after the step (``exp_avg``, ``exp_avg_sq``, torch's names, and the
    parameter): ``lr`` times the bound on ``|d r|`` above, plus float32 rounding of ``r`` and ``p``.
    Weight decay multiplies equal parameters by the same factor: it adds nothing here."""
    beta1, beta2 = betas
    a, w, c = _adam_weights(step, beta1, beta2)
    d = torch.as_tensor(grad_atol, dtype=torch.float64)
    mhat = exp_avg.detach().double().abs() / (1 - beta1**step)
    s = (exp_avg_sq.detach().double() / (1 - beta2**step)).sqrt()
    ds = math.sqrt(w) * d
    other = ((s - ds).clamp(min=0) + eps)
    dr = a * d / (s + eps) + (mhat + a * d) * ds / ((s + eps) * other)
    dr = torch.minimum(dr, mhat / (s + eps) + c)
    return lr * dr + 2 * U32 * (param.detach().double().abs() + 8 * lr * c)
