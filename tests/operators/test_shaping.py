"""Batch shaping: DAPO's overlong penalty, truncated completions, dynamic sampling; values by hand.

How the trainer uses them (loss and gradient against a hand-written reference) is tested in
``test_trainer.py::test_loss_and_gradient_on_a_padded_batch_equal_a_per_sample_reference_normalised_by_real_tokens``.
"""

from __future__ import annotations

import pytest
import torch

from flowrl.graph.configs import LossConfig
from flowrl.errors import ConfigError
from flowrl.operators.shaping import dynamic_sample, loss_normalizer, overlong_penalty, shape_batch, truncated_completions, uniform_groups


def _mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.tensor([[t < n for t in range(width)] for n in lengths])


def test_overlong_penalty_is_linear_in_the_buffer_by_hand():
    # Lmax 10, buffer 4: no penalty up to 6, then -penalty * (L - 6) / 4 up to -penalty at 10
    got = overlong_penalty(torch.tensor([0, 5, 6, 7, 8, 9, 10]), max_len=10, buffer=4, penalty=2.0)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, 0.0, -0.5, -1.0, -1.5, -2.0]))
    assert overlong_penalty(torch.tensor([10]), max_len=10, buffer=0, penalty=1.0).tolist() == [0.0]


def test_truncated_completions_are_those_at_the_width_without_a_stop():
    mask = _mask([4, 3, 4, 0], 4)
    assert truncated_completions(mask).tolist() == [True, False, True, False]
    # with the engine's stop flag, a completion whose stop fell on the last position is not truncated
    assert truncated_completions(mask, torch.tensor([True, True, False, False])).tolist() == [False, False, True, False]


def test_uniform_groups_by_hand():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 2.0])
    groups = torch.tensor([3, 3, 1, 1, 7, 7, 7, 9])  # any ids; 9 is a group of one
    assert uniform_groups(rewards, groups).tolist() == [True, True, False, False, True, True, True, True]


def test_shape_batch_applies_and_counts_each_option():
    batch = {
        "completion_mask": _mask([4, 2, 3, 4, 1, 1], 4),
        "group_ids": torch.tensor([0, 0, 1, 1, 2, 2]),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]),  # groups 1 and 2 all equal
        "prompt_index": torch.tensor([10, 11, 12]),  # per prompt: not filtered
    }
    config = LossConfig(dynamic_sampling=True, mask_truncated_completions=True, overlong_buffer=2, overlong_penalty=1.0)
    out, rewards, m = shape_batch(config, batch)
    assert out["group_ids"].tolist() == [0, 0] and out["prompt_index"].tolist() == [10, 11, 12]
    assert m["shaping/dropped_groups"] == 2 and m["shaping/dropped_samples"] == 4
    # lengths 4, 2 with Lmax 4, buffer 2: penalties -1, 0
    torch.testing.assert_close(rewards, torch.tensor([0.0, 0.0]))
    assert m["shaping/overlong_penalty_mean"] == pytest.approx(-0.5)
    assert out["completion_mask"].sum(1).tolist() == [0, 2] and m["shaping/truncated_frac"] == pytest.approx(0.5)
    # the divisor after shaping: 2 tokens (token_mean), 2 sequences (seq_mean), 2 * 4 (dr_grpo)
    assert loss_normalizer(config, batch) == 2.0
    assert loss_normalizer(LossConfig(dynamic_sampling=True, mask_truncated_completions=True, loss_agg="dr_grpo"), batch) == 8.0


def test_no_option_leaves_the_batch_as_it_is():
    batch = {"completion_mask": _mask([4, 2], 4), "group_ids": torch.tensor([0, 0]), "rewards": torch.tensor([1.0, 1.0])}
    out, rewards, m = shape_batch(LossConfig(), batch)
    assert m == {} and torch.equal(out["completion_mask"], batch["completion_mask"]) and rewards.tolist() == [1.0, 1.0]


def test_the_dynamic_sampling_cap_keeps_the_first_groups_with_a_signal_in_batch_order():
    """Groups 0 and 3 have equal rewards (dropped); of 1, 2 and 4 a cap of 2 keeps 1 and 2, by hand."""
    gid = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.5, 0.0, 2.0])
    out, metrics = dynamic_sample(LossConfig(dynamic_sampling=True, dynamic_sampling_groups=2), {"group_ids": gid, "rewards": rewards})
    assert out["group_ids"].tolist() == [1, 1, 2, 2] and out["rewards"].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert metrics == {"shaping/dropped_groups": 2.0, "shaping/dropped_samples": 4.0, "shaping/surplus_groups": 1.0, "shaping/kept_groups": 2.0}
    out, metrics = dynamic_sample(LossConfig(dynamic_sampling=True), {"group_ids": gid, "rewards": rewards})
    assert out["group_ids"].tolist() == [1, 1, 2, 2, 4, 4] and metrics["shaping/kept_groups"] == 3.0


@pytest.mark.parametrize(("options", "message"), [
    ({"dynamic_sampling_groups": 4}, "dynamic_sampling_groups=4 needs dynamic_sampling=True"),
    ({"dynamic_sampling": True, "dynamic_sampling_groups": -1}, "dynamic_sampling_groups=-1 must be >= 0"),
])
def test_a_bad_dynamic_sampling_cap_is_refused(options, message):
    with pytest.raises(ConfigError, match=message):
        LossConfig(**options)
