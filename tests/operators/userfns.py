"""Module-level reward functions (good and broken) that the scorer tests reference by name."""

from __future__ import annotations

import math


def length_reward(prompt_ids, completion_ids):
    return float(len(completion_ids))


def mean_id_reward(prompt_ids, completion_ids):
    """The completion's mean token id: differs between samples of a random model (a nonzero advantage)."""
    return sum(completion_ids) / max(len(completion_ids), 1)


def raises(prompt_ids, completion_ids):
    if len(completion_ids) >= 0:
        raise ZeroDivisionError("boom")
    return 0.0


def nan_on_long(prompt_ids, completion_ids):
    return math.nan if len(completion_ids) > 2 else 1.0


def returns_text(prompt_ids, completion_ids):
    return "1.0"


def returns_bool(prompt_ids, completion_ids):
    return len(completion_ids) > 2  # a verifier's verdict: False, True on ROLLOUT


def batched_bools(prompts, completions):
    import numpy as np

    return [np.bool_(len(completions[0]) > 2), torch_bool(len(completions[1]) > 2)]


def torch_bool(value):
    import torch

    return torch.tensor(value)


def batched_lengths(prompts, completions):
    return [len(c) + 0.5 for c in completions]


def batched_short(prompts, completions):
    return [0.0]


def task_factory(seed):
    from flowrl.operators.tasks import CopyTask

    return CopyTask(seed, n_digits=2)


def not_a_task(seed):
    return 42


# -- text scorers (inputs="text") -----------------------------------------------------------------
SEEN: list[tuple] = []


def text_echo(prompt: str, completion: str, answer: str, id: int) -> float:
    """Records what it was given; 1.0 when the completion equals the row's answer."""
    SEEN.append((prompt, completion, answer, id))
    return float(completion == answer)


def text_batched(prompts: list[str], completions: list[str], answer: list[str]) -> list[float]:
    SEEN.append((list(prompts), list(completions), list(answer)))
    return [float(c == a) for c, a in zip(completions, answer)]


def text_needs_solution(prompt: str, completion: str, solution: str) -> float:
    return 0.0


def text_optional(prompt: str, completion: str, solution: str = "", **rest: object) -> float:
    SEEN.append(dict(rest, solution=solution))
    return 0.5


def text_nan(prompt: str, completion: str) -> float:
    return float("nan")


def text_record(prompts: list[str], completions: list[str], **fields: list) -> list[float]:
    """Batched: records the prompts of each batch it scores (in-process runs only); rewards the answer."""
    SEEN.append(list(prompts))
    return [float(c.strip() == str(a)) for c, a in zip(completions, fields.get("answer", [""] * len(completions)))]


def text_untyped(prompt, completion, **fields):
    """The README's text form without annotations: only its ``**fields`` says it wants rows."""
    return float(fields["answer"] in completion)


# -- TRL's reward-function form: f(completions, **kwargs) -> list[float], called with keywords ------
def trl_length(completions, **kwargs):
    """TRL's documented example (reward_len), closer to 3 characters is better; records its keyword arguments."""
    SEEN.append(sorted(kwargs))
    return [-abs(3 - len(c)) for c in completions]


def trl_accuracy(completions, answer, **kwargs):
    """A row field named as a parameter: a list, one per completion."""
    SEEN.append((list(completions), list(answer), list(kwargs["prompts"])))
    return [float(c == a) for c, a in zip(completions, answer)]


def trl_conversational(completions, prompts, answer, **kwargs):
    """TRL's conversational form: each completion a list of one assistant message, each prompt its messages."""
    SEEN.append((completions, prompts))
    return [float(c[0]["content"] == a) for c, a in zip(completions, answer)]


def trl_typo(completion, **kwargs):
    """TRL's form with a typo (``completion``): the batched text call passes two positional lists."""
    return [float(len(c)) for c in completion]


def ids_one(prompt_ids):
    """Room for one positional argument where the id call passes two."""
    return 0.0


def ids_star(*ids):
    """``*args`` takes both positional arguments."""
    return 0.0


def text_strip(prompt, completion):
    """Text-minded, nothing in its signature says so: ``.strip()`` fails on a list of ids."""
    return float(completion.strip() == "4")
