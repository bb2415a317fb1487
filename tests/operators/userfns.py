"""Module-level reward functions (good and broken) that the scorer tests reference by name."""

from __future__ import annotations

import math


def length_reward(prompt_ids, completion_ids):
    return float(len(completion_ids))


def raises(prompt_ids, completion_ids):
    if len(completion_ids) >= 0:
        raise ZeroDivisionError("boom")
    return 0.0


def nan_on_long(prompt_ids, completion_ids):
    return math.nan if len(completion_ids) > 2 else 1.0


def returns_text(prompt_ids, completion_ids):
    return "1.0"


def returns_bool(prompt_ids, completion_ids):
    return True


def batched_lengths(prompts, completions):
    return [len(c) + 0.5 for c in completions]


def batched_short(prompts, completions):
    return [0.0]


def task_factory(seed):
    from flowrl.operators.tasks import CopyTask

    return CopyTask(seed, n_digits=2)


def not_a_task(seed):
    return 42
