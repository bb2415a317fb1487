"""User functions referenced by ``module:qualname`` from the bad-input tests: broken scorers and task factories.

Every scorer fails on sample 1 (the second), so that a message naming sample 0 would be wrong.
"""

from __future__ import annotations

import math

from flowrl.operators.tasks import CopyTask

_calls = {"n": 0}


def _on_second(value, prompt_ids, completion_ids):
    _calls["n"] += 1
    return value if _calls["n"] % 2 == 0 else 0.5


def reset() -> None:
    _calls["n"] = 0


def raises(prompt_ids, completion_ids):
    if _on_second(True, prompt_ids, completion_ids) is True:
        raise KeyError("the reward table has no such answer")
    return 0.5


def returns_nan(prompt_ids, completion_ids):
    return _on_second(math.nan, prompt_ids, completion_ids)


def returns_inf(prompt_ids, completion_ids):
    return _on_second(-math.inf, prompt_ids, completion_ids)


def returns_none(prompt_ids, completion_ids):
    return _on_second(None, prompt_ids, completion_ids)


def returns_text(prompt_ids, completion_ids):
    return _on_second("1.0", prompt_ids, completion_ids)


class _Prompts(CopyTask):
    """The copy task with a broken prompt at index 3."""

    def __init__(self, seed: int, bad: list[int]) -> None:
        super().__init__(seed)
        self.bad = bad

    def prompt(self, index: int) -> list[int]:
        return list(self.bad) if index == 3 else super().prompt(index)


def empty_prompt_task(seed: int) -> CopyTask:
    return _Prompts(seed, [])


def long_prompt_task(seed: int) -> CopyTask:
    return _Prompts(seed, super(_Prompts, _Prompts(seed, [])).prompt(0) * 20)  # 100 tokens; the model takes 32


def failing_task(seed: int) -> CopyTask:
    """A task factory that raises: the source's program cannot be built."""
    raise ValueError(f"no dataset shard for seed {seed}")


def failing_program(node, graph, env, transports):
    """A ``RunConfig.programs`` factory that raises: the node's program cannot be built."""
    raise ValueError(f"cannot build a program for {node.name}")
