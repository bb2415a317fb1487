"""The scorer node's operator: rewards from a user function, validated.

The function is named in the graph as ``module:qualname`` and resolved on the first call (a graph
file never imports code when it is loaded). Per sample it is called as ``fn(prompt_ids,
completion_ids) -> float`` with plain ``list[int]``s: the real prompt tokens (no padding) and the
completion's real tokens (the stop token included when one was emitted). With ``batched=True`` it is
called once as ``fn(list_of_prompts, list_of_completions) -> list[float]``.

Every reward must be a finite real number; a function that raises or returns anything else fails with
``NodeExecutionError`` naming the scorer, the function, the sample index and the offending value.

Example:
    >>> from flowrl.graph.nodes import ScorerNode
    >>> scorer = Scorer(ScorerNode(name="r", fn="flowrl.operators.tasks:copy_reward"))
    >>> rollout = {"sample_prompt_ids": torch.tensor([[1, 4, 14]]), "sample_prompt_lens": torch.tensor([3]),
    ...            "completion_ids": torch.tensor([[4, 2, 0]]), "completion_lens": torch.tensor([2])}
    >>> scorer.score(rollout)["rewards"].tolist()
    [1.0]
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from flowrl.errors import NodeExecutionError
from flowrl.graph.nodes import ScorerNode
from flowrl.graph.refs import resolve
from flowrl.operators.batch import Batch
from flowrl.operators.tokenizer import DEFAULT_TOKENIZER

__all__ = ["Scorer", "unpad"]


def unpad(rollout: Mapping[str, Tensor]) -> tuple[list[list[int]], list[list[int]]]:
    """The real prompt and completion tokens of every sample, as lists of ints."""
    prompt_ids, prompt_lens = rollout["sample_prompt_ids"], rollout["sample_prompt_lens"].tolist()
    completion_ids, completion_lens = rollout["completion_ids"], rollout["completion_lens"].tolist()
    width = prompt_ids.shape[1]
    prompts = [row[width - n :] if n else [] for row, n in zip(prompt_ids.tolist(), prompt_lens)]
    completions = [row[:n] for row, n in zip(completion_ids.tolist(), completion_lens)]
    return prompts, completions


class Scorer:
    """Scores rollouts with ``node.fn`` into the field ``node.output`` (see the module docstring)."""

    def __init__(self, node: ScorerNode) -> None:
        self.name = node.name
        self.node = node
        self._fn: Callable[..., Any] | None = None

    @property
    def fn(self) -> Callable[..., Any]:
        """The user function, resolved on first use (``GraphError`` if the reference does not resolve)."""
        if self._fn is None:
            self._fn = resolve(self.node.fn)
        return self._fn

    def _fail(self, message: str, index: int, prompts: list[list[int]], completions: list[list[int]]) -> NodeExecutionError:
        tok = DEFAULT_TOKENIZER
        return NodeExecutionError(
            f"scorer {self.name!r} ({self.node.fn}) {message} for sample {index} "
            f"(prompt {tok.decode(prompts[index])!r}, completion {tok.decode(completions[index])!r}); "
            "a reward function must return a finite float",
            node=self.name,
        )

    def _check(self, value: Any, index: int, prompts: list[list[int]], completions: list[list[int]]) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            if isinstance(value, Tensor) and value.numel() == 1 and value.dtype.is_floating_point:
                value = float(value)
            else:
                raise self._fail(f"returned {value!r} of type {type(value).__name__}", index, prompts, completions)
        value = float(value)
        if not math.isfinite(value):
            raise self._fail(f"returned {value!r}", index, prompts, completions)
        return value

    def score(self, rollout: Mapping[str, Tensor]) -> Batch:
        """``{node.output: float32[sample]}`` for ``rollout``.

        Raises:
            NodeExecutionError: when the function raises (the original error is ``__cause__``) or
                returns a non-finite or non-numeric value; the message names the sample.
        """
        fn = self.fn
        prompts, completions = unpad(rollout)
        if self.node.batched:
            try:
                values = list(fn(prompts, completions))
            except Exception as exc:
                raise NodeExecutionError(
                    f"scorer {self.name!r} ({self.node.fn}) raised {type(exc).__name__}: {exc} on a batch of {len(prompts)} samples",
                    node=self.name,
                ) from exc
            if len(values) != len(prompts):
                raise NodeExecutionError(
                    f"scorer {self.name!r} ({self.node.fn}) returned {len(values)} rewards for {len(prompts)} samples",
                    node=self.name,
                )
        else:
            values = []
            for i, (prompt, completion) in enumerate(zip(prompts, completions)):
                try:
                    values.append(fn(prompt, completion))
                except Exception as exc:
                    raise self._fail(f"raised {type(exc).__name__}: {exc}", i, prompts, completions) from exc
        rewards = [self._check(v, i, prompts, completions) for i, v in enumerate(values)]
        return {self.node.output: torch.tensor(rewards, dtype=torch.float32)}
