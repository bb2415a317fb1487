"""Scorers: user reward functions on real tokens, every reward a finite float, failures that name the sample."""

from __future__ import annotations

import pytest
import torch

from flowrl.errors import GraphError, NodeExecutionError
from flowrl.graph.nodes import ScorerNode
from flowrl.operators.scoring import Scorer, unpad

ROLLOUT = {
    "sample_prompt_ids": torch.tensor([[0, 1, 4, 14], [1, 5, 6, 14]]),
    "sample_prompt_lens": torch.tensor([3, 4]),
    "completion_ids": torch.tensor([[4, 2, 0], [5, 7, 8]]),
    "completion_lens": torch.tensor([2, 3]),
}


def scorer(fn: str, **kw) -> Scorer:
    return Scorer(ScorerNode(name="judge", fn=fn, **kw))


def test_functions_see_real_tokens_only():
    prompts, completions = unpad(ROLLOUT)
    assert prompts == [[1, 4, 14], [1, 5, 6, 14]]
    assert completions == [[4, 2], [5, 7, 8]]


def test_rewards_are_float32_per_sample_under_the_output_name():
    out = scorer("tests.operators.userfns:length_reward", output="reward_len").score(ROLLOUT)
    assert list(out) == ["reward_len"]
    assert out["reward_len"].dtype == torch.float32
    assert out["reward_len"].tolist() == [2.0, 3.0]


def test_builtin_copy_reward():
    out = scorer("flowrl.operators.tasks:copy_reward").score(ROLLOUT)
    assert out["rewards"].tolist() == [1.0, pytest.approx(1 / 3)]


def test_batched_functions_score_the_whole_batch():
    out = scorer("tests.operators.userfns:batched_lengths", batched=True).score(ROLLOUT)
    assert out["rewards"].tolist() == [2.5, 3.5]


@pytest.mark.parametrize(("fn", "batched"), [("returns_bool", False), ("batched_bools", True)], ids=["bool", "numpy-and-tensor-bool"])
def test_a_bool_reward_is_0_or_1(fn, batched):
    """A verifier's True/False (Python, numpy or a 0-d torch bool) is the reward 1.0/0.0 (ROLLOUT's completions: 2 and 3 tokens)."""
    assert scorer(f"tests.operators.userfns:{fn}", batched=batched).score(ROLLOUT)["rewards"].tolist() == [0.0, 1.0]


@pytest.mark.parametrize(
    ("fn", "batched", "match"),
    [
        ("raises", False, r"scorer 'judge' \(tests.operators.userfns:raises\) raised ZeroDivisionError: boom for sample 0"),
        ("nan_on_long", False, r"returned nan for sample 1 \(prompt '<s>23=', completion '245'\)"),
        ("returns_text", False, r"returned '1.0' of type str for sample 0"),
        ("batched_short", True, r"returned 1 rewards for 2 samples"),
    ],
    ids=["raises", "nan", "text", "batched-length"],
)
def test_bad_rewards_fail_naming_scorer_and_sample(fn, batched, match):
    with pytest.raises(NodeExecutionError, match=match) as info:
        scorer(f"tests.operators.userfns:{fn}", batched=batched).score(ROLLOUT)
    assert info.value.node == "judge"


def test_the_original_error_is_kept():
    with pytest.raises(NodeExecutionError) as info:
        scorer("tests.operators.userfns:raises").score(ROLLOUT)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_functions_resolve_on_first_use_not_at_construction():
    lazy = scorer("tests.operators.userfns:no_such_function")  # constructing imports nothing
    with pytest.raises(GraphError, match="has no attribute 'no_such_function'"):
        lazy.score(ROLLOUT)
