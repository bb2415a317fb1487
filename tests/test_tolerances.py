"""The tolerance helper (``tests/tolerances.py``): its bound covers rounding, stays under a real bug, refuses otherwise."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.models.families.builtin.model import Transformer
from flowrl.operators.generation import Generator
from flowrl.operators.logprobs import completion_logprobs
from tests.operators.helpers import TINY, prompts_of, tiny_generator_node
from tests.tolerances import REAL_BUG, ToleranceTooLoose, bound_logprob_atol, head_magnitude, reductions, rollout_logprob_atol, weights_magnitude


def test_the_magnitude_is_the_largest_abs_h_times_abs_w_sum():
    h = torch.tensor([[1.0, -2.0]])
    w = torch.tensor([[3.0, 1.0], [-1.0, -4.0]])
    assert head_magnitude(h, w) == 1 * 1 + 2 * 4  # row 1: |1|*|-1| + |-2|*|-4|, though z_1 = 7 and z_0 = 1


def test_the_reductions_count_every_layer():
    model = Transformer(TINY)  # dim 32, 4 heads of 8, ffn 88, 2 layers
    per_layer = [32, 32, 8, 10, 10, 32, 32, 32, TINY.hidden_dim]
    assert reductions(model, 10) == per_layer * 2 + [32, 32]


def test_the_weights_bound_covers_the_magnitude_computed():
    model = Transformer(TINY)
    seen: list[torch.Tensor] = []
    model.norm.register_forward_hook(lambda m, a, out: seen.append(out))
    model(torch.tensor([[1, 4, 5, 6, 14, 3, 9]]))
    assert head_magnitude(seen[0], model.tok_embeddings.weight) <= weights_magnitude(model)


def test_the_bound_covers_rounding_and_a_real_bug_exceeds_it():
    """A KV-cached rollout against a full forward differs by rounding only, within the bound; the same
    rollout evaluated without its top-p (the truncation bug) is off by more than the bound. (At
    initialisation the tiny model is near uniform over 16 tokens: a top-p of 0.95 keeps all of them, so
    0.7 here.)"""
    gen = Generator(tiny_generator_node(n_samples=4, max_new_tokens=8, top_p=0.7), seed=0)
    out = gen.generate(prompts_of([[1, 4, 5, 14], [1, 9, 8, 7, 6, 5, 14]]))
    atol = rollout_logprob_atol(gen.model, out)
    assert 0 < atol <= REAL_BUG / 2
    fields = [out[f] for f in ("sample_prompt_ids", "sample_prompt_lens", "completion_ids", "completion_mask")]
    mask = out["completion_mask"]
    with torch.no_grad():
        truncated = completion_logprobs(gen.model, *fields, top_p=0.7)
        untruncated = completion_logprobs(gen.model, *fields)
    assert float((truncated - out["behaviour_logprobs"])[mask].abs().max()) <= atol
    assert float((untruncated - out["behaviour_logprobs"])[mask].abs().min()) > atol


def test_a_tolerance_too_loose_to_catch_a_bug_is_refused():
    assert bound_logprob_atol(1.0, [64] * 10, 100) < REAL_BUG / 2
    with pytest.raises(ToleranceTooLoose, match=r"above REAL_BUG / 2 = 0.025: it could not tell a real bug from rounding"):
        bound_logprob_atol(1000.0, [4096] * 64, 32000)
    assert math.isclose(bound_logprob_atol(2.0, [10], 0, temperature=0.5), bound_logprob_atol(4.0, [10], 0))


# -- gradients and AdamW steps -------------------------------------------------------------------------


def test_the_gradient_magnitudes_are_the_abs_sums_of_a_linear_layers_contributions():
    """One linear layer, loss sum_t v . (W x_t): dL/dW = sum_t v x_t^T, and S = sum_t |v| |x_t|^T even
    where the contributions cancel (x_0 = -x_1 gives a zero gradient, S = 2 |v| |x_0|)."""
    from tests.tolerances import GradientMagnitudes

    layer = torch.nn.Linear(3, 2, bias=True)
    x = torch.tensor([[1.0, -2.0, 0.5], [-1.0, 2.0, -0.5]])
    v = torch.tensor([3.0, -1.0])
    with GradientMagnitudes(layer) as mags:
        (layer(x) @ v).sum().backward()
    elementwise, normwise, _ = mags._sums[id(layer.weight)]
    assert torch.equal(layer.weight.grad, torch.zeros(2, 3))
    assert torch.allclose(elementwise, 2 * v.abs()[:, None].double() * x[0].abs()[None, :].double())
    # normwise: sum_t (max|v| |x_t| + |v| max|x_t|)
    assert torch.allclose(normwise, 2 * (3.0 * x[0].abs()[None, :] + v.abs()[:, None] * 2.0).double())
    assert torch.allclose(mags._sums[id(layer.bias)][0], 2 * v.abs().double())


def test_the_gradient_bound_covers_micro_batching_and_a_real_bug_exceeds_it():
    """The whole batch's gradient against the sum of two halves' (the trainer's micro-batching, done by
    hand on the tiny model): within the bound; a half dropped or its normaliser doubled: outside it."""
    import copy

    from tests.tolerances import GradientMagnitudes, assert_within

    torch.manual_seed(0)
    model = Transformer(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (6, 9))
    weights = torch.randn(6, 8)

    def loss(m, rows, norm):
        logp = torch.log_softmax(m(tokens[rows])[:, :-1], -1).gather(-1, tokens[rows, 1:, None]).squeeze(-1)
        return -(weights[rows] * logp).sum() / norm

    whole, halves = copy.deepcopy(model), copy.deepcopy(model)
    with GradientMagnitudes(whole) as mags:
        loss(whole, slice(0, 6), 48).backward()
    tolerances = mags.tolerances(seq_len=9, partials=2)
    for rows in (slice(0, 3), slice(3, 6)):
        loss(halves, rows, 48).backward()
    for (name, a), b in zip(whole.named_parameters(), halves.parameters()):
        assert_within(b.grad, a.grad, tolerances[name], msg=name)
    dropped, doubled = copy.deepcopy(model), copy.deepcopy(model)
    loss(dropped, slice(0, 3), 48).backward()
    loss(doubled, slice(0, 3), 48).backward()
    loss(doubled, slice(3, 6), 24).backward()
    for broken in (dropped, doubled):
        with pytest.raises(AssertionError, match="differ by more than their float32 bound"):
            for (name, a), b in zip(whole.named_parameters(), broken.parameters()):
                assert_within(b.grad, a.grad, tolerances[name], msg=name)


def test_a_gradient_tolerance_too_loose_to_catch_a_bug_is_refused():
    """Contributions cancelling to a gradient a million times smaller than their sums (a loss
    ``f - (1 - 1e-6) f`` of two forwards): rounding could not be told from a bug, so no tolerance."""
    from tests.tolerances import GradientMagnitudes, ToleranceTooLoose

    model = Transformer(TINY)
    tokens = torch.tensor([[1, 4, 5, 6, 14, 3, 9]])
    with GradientMagnitudes(model) as mags:
        (model(tokens).sum() - (1 - 1e-6) * model(tokens).sum()).backward()
    with pytest.raises(ToleranceTooLoose, match="above GRAD_REAL_BUG / 2 = 0.05 of the gradient's norm"):
        mags.tolerances(seq_len=7)


def test_the_adamw_bound_is_twice_the_relative_gradient_error_and_at_most_two_lr_near_zero():
    """First step (m = (1 - b1) g, v = (1 - b2) g^2): r = g / (|g| + eps) ~ sign(g). A gradient far above
    its rounding d moves r by ~2 d / |g|; one within d of 0 may flip the sign: up to 2 lr. An AdamW step
    on two gradients that far apart stays within the bound."""
    from tests.tolerances import U32, adamw_param_atol

    lr, betas, eps = 1e-2, (0.9, 0.999), 1e-8
    g = torch.tensor([1.0, 1e-9, -0.5])
    d = torch.tensor([1e-6, 1e-8, 1e-6])
    p = torch.zeros(3)
    m, v = (1 - betas[0]) * g, (1 - betas[1]) * g * g
    bound = adamw_param_atol(d, m, v, p, step=1, lr=lr, betas=betas, eps=eps)
    assert math.isclose(float(bound[0]) - 16 * U32 * lr, lr * 2e-6, rel_tol=1e-3)  # less r's own rounding
    assert float(bound[1]) <= 2 * lr * 1.0001 and float(bound[1]) > lr
    runs = []
    for grad in (g, g + d * torch.tensor([1.0, -1.0, -1.0])):
        param = torch.nn.Parameter(p.clone())
        opt = torch.optim.AdamW([param], lr=lr, betas=betas, eps=eps, weight_decay=0.0)
        param.grad = grad.clone()
        opt.step()
        runs.append(param.detach().clone())
    assert bool(((runs[0] - runs[1]).abs() <= bound).all())
    assert float((runs[0] - runs[1]).abs()[1]) > lr / 2  # r from 0.09 to -0.47: the sign flip the bound allows for
