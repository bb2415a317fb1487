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
