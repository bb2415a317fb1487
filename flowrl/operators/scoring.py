"""The scorer node's operator: rewards from a user function, validated.

The function is named in the graph as ``module:qualname`` and resolved on the first call (a graph
file never imports code when it is loaded). Per sample it is called as ``fn(prompt_ids,
completion_ids) -> float`` with plain ``list[int]``s: the real prompt tokens (no padding) and the
completion's real tokens (the stop token included when one was emitted). With ``batched=True`` it is
called once as ``fn(list_of_prompts, list_of_completions) -> list[float]``.

A scorer with ``inputs="text"`` is built with ``TextInputs`` (``flowrl.operators.text_inputs``) and
calls ``fn(prompt: str, completion: str, **fields) -> float`` with the decoded text and the fields of
each sample's prompt row (batched: ``fn(prompts, completions, **fields_as_lists) -> list[float]``).
A batched text function in TRL's form, ``fn(completions, **kwargs) -> list[float]``, is called as
TRL calls it, with keyword arguments: ``completions=``, ``prompts=`` and ``completion_ids=`` (where
its signature takes them) and the row fields, each a list. When the rows' prompts are chat messages,
it gets TRL's conversational form: ``prompts`` the messages, each completion
``[{"role": "assistant", "content": text}]``.

The function is resolved on first use (a text scorer's when it is built; the scorer program of a
run resolves it when the run starts); a signature that contradicts the node's ``inputs``/``batched``
(``flowrl.graph.scorer_forms``) is then a ``ConfigError`` naming the flags to set.

Every reward must be a finite real number or a bool (True is 1.0, False 0.0: a verifier's verdict); a function that raises or returns anything else fails with
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

import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from flowrl.errors import ConfigError, NodeExecutionError
from flowrl.graph.nodes import ScorerNode
from flowrl.graph.refs import resolve
from flowrl.graph.scorer_forms import form_mismatch, is_trl_form, text_hint
from flowrl.operators.batch import Batch
from flowrl.operators.text_inputs import TextInputs
from flowrl.models.families.builtin.tokenizer import DEFAULT_TOKENIZER

__all__ = ["Scorer", "unpad", "accepted"]


def accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``kwargs`` that ``fn`` takes: all of them if it takes ``**kwargs``."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params and params[k].kind is not inspect.Parameter.POSITIONAL_ONLY}


#: Sample index -> (prompt, completion) as an error message shows them.
Shown = Callable[[int], tuple[str, str]]


def unpad(rollout: Mapping[str, Tensor]) -> tuple[list[list[int]], list[list[int]]]:
    """The real prompt and completion tokens of every sample, as lists of ints."""
    prompt_ids, prompt_lens = rollout["sample_prompt_ids"], rollout["sample_prompt_lens"].tolist()
    completion_ids, completion_lens = rollout["completion_ids"], rollout["completion_lens"].tolist()
    width = prompt_ids.shape[1]
    prompts = [row[width - n :] if n else [] for row, n in zip(prompt_ids.tolist(), prompt_lens)]
    completions = [row[:n] for row, n in zip(completion_ids.tolist(), completion_lens)]
    return prompts, completions


class Scorer:
    """Scores rollouts with ``node.fn`` into the field ``node.output`` (see the module docstring).

    Args:
        node: the scorer node.
        text: for ``inputs="text"``, how to decode the rollout and find the rows; building it
            resolves ``fn`` and checks the fields it asks for.

    Raises:
        ConfigError: for a text scorer without ``text``, a function asking for a field the rows
            lack, or one whose signature contradicts ``inputs``/``batched`` (the flags to set).
        GraphError: when ``fn``'s reference does not resolve.
    """

    def __init__(self, node: ScorerNode, text: TextInputs | None = None) -> None:
        self.name = node.name
        self.node = node
        self._fn: Callable[..., Any] | None = None
        self.text = text
        self._fields: tuple[str, ...] | None = None
        self._trl = False
        if node.inputs == "text":
            if text is None:
                raise ConfigError(f"scorer {node.name!r} reads text: build it with TextInputs(graph, {node.name!r})")
            self._fields = text.fields_for(self.fn)

    @property
    def fn(self) -> Callable[..., Any]:
        """The user function, resolved on first use (``GraphError`` if the reference does not resolve;
        ``ConfigError`` if its signature contradicts ``inputs``/``batched``: ``flowrl.graph.scorer_forms``)."""
        if self._fn is None:
            fn = resolve(self.node.fn)
            mismatch = form_mismatch(fn, inputs=self.node.inputs, batched=self.node.batched)
            if mismatch:
                raise ConfigError(f"scorer {self.name!r}: {self.node.fn} {mismatch}")
            self._fn, self._trl = fn, is_trl_form(fn)
        return self._fn

    def _fail(self, message: str, index: int, shown: Shown) -> NodeExecutionError:
        prompt, completion = shown(index)
        return NodeExecutionError(
            f"scorer {self.name!r} ({self.node.fn}) {message}{text_hint(self.fn, self.node.inputs)} for sample {index} "
            f"(prompt {prompt!r}, completion {completion!r}); "
            "a reward function must return a finite float",
            node=self.name,
        )

    def _check(self, value: Any, index: int, shown: Shown) -> float:
        if type(value) is float and math.isfinite(value):  # the common case, without the ABC checks below
            return value
        if isinstance(value, (bool, np.bool_)):  # a verifier's verdict: True is 1.0, False 0.0
            return float(value)
        if not isinstance(value, numbers.Real):
            if isinstance(value, Tensor) and value.numel() == 1 and (value.dtype.is_floating_point or value.dtype == torch.bool):
                value = float(value)
            else:
                raise self._fail(f"returned {value!r} of type {type(value).__name__}", index, shown)
        value = float(value)
        if not math.isfinite(value):
            raise self._fail(f"returned {value!r}", index, shown)
        return value

    def _arguments(self, rollout: Mapping[str, Tensor]) -> tuple[list[Any], list[Any], list[dict[str, Any]], Shown]:
        """(prompts, completions, per-sample fields, the texts errors show) in the form ``fn`` takes;
        token ids are decoded for an error message only when one is raised."""
        prompts, completions = unpad(rollout)
        if self.text is None:
            tok = DEFAULT_TOKENIZER
            return prompts, completions, [{} for _ in prompts], lambda i: (tok.decode(prompts[i]), tok.decode(completions[i]))
        texts = [self.text.prompt_text(p) for p in prompts], [self.text.completion_text(c) for c in completions]
        return texts[0], texts[1], self.text.rows(rollout, self._fields), lambda i: (texts[0][i], texts[1][i])

    def score(self, rollout: Mapping[str, Tensor]) -> Batch:
        """``{node.output: float32[sample]}`` for ``rollout``.

        Raises:
            NodeExecutionError: when the function raises (the original error is ``__cause__``) or
                returns a non-finite or non-numeric value; the message names the sample.
        """
        fn = self.fn
        prompts, completions, fields, shown = self._arguments(rollout)
        if self.node.batched:
            columns = {k: [f.get(k) for f in fields] for k in dict.fromkeys(k for f in fields for k in f)}
            try:
                if self._trl:  # TRL's form: keyword arguments only, those its signature takes
                    messages = self.text.prompt_messages(rollout) if self.text is not None else None
                    if messages is not None:  # TRL's conversational form: prompts as messages, each completion one assistant message
                        prompts, completions = messages, [[{"role": "assistant", "content": c}] for c in completions]
                    given = {"prompts": prompts, "completion_ids": unpad(rollout)[1], **columns}
                    values = list(fn(completions=completions, **accepted(fn, given)))
                else:
                    values = list(fn(prompts, completions, **columns))
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
                    values.append(fn(prompt, completion, **fields[i]))
                except Exception as exc:
                    raise self._fail(f"raised {type(exc).__name__}: {exc}", i, shown) from exc
        rewards = [self._check(v, i, shown) for i, v in enumerate(values)]
        return {self.node.output: torch.tensor(rewards, dtype=torch.float32)}
